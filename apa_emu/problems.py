"""Problems in full: FP16 inputs of a given structure made from a seed, page pools and block tables,
and ``Problem``, a generated problem as a few numbers that JSON carries (``apa check --repro``).
NumPy only: ``apa_emu.strategies`` draws them with Hypothesis, a test extra.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields

import numpy as np

STRUCTURES = ("normal", "sink", "diffuse", "outliers", "channel", "tiny", "extreme")


def make_inputs(seed, B, n, Hkv, G, d, S, structure, batched=True):
    """FP16 q [B,n,H,d], k, v [B,S,Hkv,d] (no batch axis when not batched) of a given structure."""
    rng = np.random.default_rng(seed)
    H = Hkv * G
    q = rng.standard_normal((B, n, H, d))
    k = rng.standard_normal((B, S, Hkv, d))
    v = rng.standard_normal((B, S, Hkv, d))
    if structure == "sink":
        # key 0 (and sometimes a second key) aligned with every query: a dominant sink
        dirn = rng.standard_normal(d)
        dirn /= np.linalg.norm(dirn)
        q += 3.0 * dirn
        k[:, 0] += rng.uniform(4, 40) * dirn
        if S > 100:
            k[:, rng.integers(1, S)] += 8.0 * dirn
    elif structure == "diffuse":
        q *= 0.02
    elif structure == "outliers":
        for x in (q, k, v):
            x += rng.standard_normal(x.shape) * 10.0 * (rng.random(x.shape) < 0.002)
    elif structure == "channel":
        k += rng.standard_normal((1, 1, Hkv, d)) * rng.uniform(2, 200)
        q *= rng.uniform(0.05, 2)
    elif structure == "tiny":
        scale = 2.0 ** rng.integers(-30, -14)
        q *= scale * 2**10
        k *= scale
        v *= scale
    elif structure == "extreme":
        # magnitudes up to the top of FP16, finite; some rows and keys at the range edge
        amp = float(rng.choice([1e2, 3e3, 6e4]))
        q = np.clip(q * amp / 4, -65504, 65504)
        k = np.clip(k * amp / 4, -65504, 65504)
        v = np.clip(v * amp / 4, -65504, 65504)
        k[:, rng.integers(0, S)] = 65504.0 * np.sign(rng.standard_normal(d))
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    if not batched:
        q, k, v = q[0], k[0], v[0]
    return q, k, v


def paginate(k, v, page_size, seed):
    """k, v [S, Hkv, d] or [B, S, Hkv, d] as page pools [pages, page_size, Hkv, d] with a block table
    (numerics.md §5.0): every sequence's pages shuffled into one pool with two spare pages, and, for
    odd seeds, a random page of the first sequence a hole (its keys and values then read as zeros)."""
    rng = np.random.default_rng(seed)
    kb, vb = (x[None] if x.ndim == 3 else x for x in (k, v))
    B, S = kb.shape[:2]
    per = -(-S // page_size)
    pages = B * per + 2
    order = rng.permutation(pages)
    table = order[: B * per].reshape(B, per).astype(np.int32)
    pool_k = rng.standard_normal((pages, page_size, *kb.shape[2:])).astype(np.float16)  # spare pages: noise
    pool_v = rng.standard_normal(pool_k.shape).astype(np.float16)
    pad = per * page_size - S
    for b in range(B):
        for x, pool in ((kb, pool_k), (vb, pool_v)):
            rows = np.concatenate([x[b], np.zeros((pad, *x.shape[2:]), np.float16)])
            pool[table[b]] = rows.reshape(per, page_size, *x.shape[2:])
    if seed % 2:
        table[0, rng.integers(per)] = -1
    return pool_k, pool_v, table if k.ndim == 4 else table[0]


# each integer field's least value; window and page_size may also be None
_LEAST = dict(seed=0, B=1, n=1, Hkv=1, G=1, d=1, S=1, q_offset=0, window=1, page_size=1)


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_field(name: str, value) -> None:
    """One field of a Problem's JSON: its type and range, else a ValueError naming it."""
    if name == "structure":
        if value not in STRUCTURES:
            raise ValueError(f"problem: structure={value!r}: expected one of {', '.join(STRUCTURES)}")
    elif name == "batched":
        if not isinstance(value, bool):
            raise ValueError(f"problem: batched={value!r}: expected true or false")
    elif name == "seqlens":
        ok = value is None or isinstance(value, (list, tuple)) and value and all(
            isinstance(s, (list, tuple)) and len(s) == 2 and all(_integer(x) and x >= 1 for x in s) for s in value)
        if not ok:
            raise ValueError(f"problem: seqlens={value!r}: expected null or a non-empty list of [rows, keys] "
                             f"pairs of positive integers")
    elif not (value is None and name in ("window", "page_size")) and not (_integer(value) and
                                                                          value >= _LEAST[name]):
        raise ValueError(f"problem: {name}={value!r}: expected an integer >= {_LEAST[name]}"
                         + " or null" * (name in ("window", "page_size")))


@dataclass(frozen=True)
class Problem:
    """One attention problem, reproducible from these numbers alone: ``make_inputs``' arguments, the
    query offset, a sliding window (§6.1), a page size (§5.0: the keys in shuffled pages,
    ``paginate``) and, for a varlen batch (§6.6), each sequence's (rows, keys), packed from one
    ``make_inputs`` problem of their sums (then B = 1 and q_offset = 0)."""

    seed: int
    B: int
    n: int
    Hkv: int
    G: int
    d: int
    S: int
    structure: str
    batched: bool
    q_offset: int = 0
    window: int | None = None
    page_size: int | None = None
    seqlens: tuple[tuple[int, int], ...] | None = None

    def nbytes(self) -> int:
        """About the memory ``arguments`` takes at its peak: make_inputs' float64 draws and, paged, the
        page pools' float64 noise (more than the keys when a page outgrows the sequence)."""
        rows, keys = (self.B * self.n, self.B * self.S) if self.seqlens is None else \
            (sum(s[0] for s in self.seqlens), sum(s[1] for s in self.seqlens))
        need = 10 * self.Hkv * self.d * (rows * self.G + 2 * keys)
        if self.page_size is not None:
            need += 20 * self.Hkv * self.d * self.page_size * (self.B * -(-self.S // self.page_size) + 2)
        return need

    def arguments(self) -> tuple[tuple, dict]:
        """``attention``'s positional (q, k, v, q_offset) and keyword arguments; a MemoryError, before
        any allocation, when they cannot fit in memory."""
        from .api import available_bytes

        need, have = self.nbytes(), available_bytes()
        if have is not None and need > have:
            raise MemoryError(f"problem: {self.describe()} needs about {need / 2**30:.1f} GiB; "
                              f"{have / 2**30:.1f} GiB of memory is available")
        if self.seqlens is not None:
            rows, keys = (np.array([s[i] for s in self.seqlens]) for i in (0, 1))
            q, k, v = make_inputs(self.seed, 1, int(rows.sum()), self.Hkv, self.G, self.d, int(keys.sum()),
                                  self.structure, batched=False)
            cu = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (rows, keys)]
            return (q, k, v, 0), dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], window=self.window)
        q, k, v = make_inputs(self.seed, self.B, self.n, self.Hkv, self.G, self.d, self.S, self.structure,
                              batched=self.batched)
        kw = dict(window=self.window)
        if self.page_size is not None:
            k, v, table = paginate(k, v, self.page_size, self.seed)
            kw.update(block_table=table, seqlen_k=self.S)
        return (q, k, v, self.q_offset), {key: value for key, value in kw.items() if value is not None}

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)
                           if getattr(self, f.name) != f.default or f.name == "q_offset"}, separators=(",", ":"))

    @classmethod
    def from_json(cls, data) -> "Problem":
        """From JSON text or its dict; a missing, unknown or ill-typed field, or one out of range, is a
        ValueError naming it."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ValueError(f"problem: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"problem: expected an object of the problem's fields, got {data!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"problem: unknown field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ValueError(f"problem: missing field {missing[0]!r}")
        for name, value in data.items():
            _check_field(name, value)
        if data.get("seqlens") is not None:
            data["seqlens"] = tuple(tuple(s) for s in data["seqlens"])
        return cls(**data)

    def describe(self) -> str:
        extra = "".join(f", {name} {value}" for name, value in (("window", self.window), ("page_size", self.page_size),
                                                                ("seqlens", self.seqlens)) if value is not None)
        return (f"{self.structure} problem: B {self.B}, n {self.n}, S {self.S}, H {self.Hkv * self.G}/{self.Hkv}, "
                f"d {self.d}, q_offset {self.q_offset}{extra}")

    def asdict(self) -> dict:
        return asdict(self)
