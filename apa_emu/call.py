"""The call contract: one step that resolves and checks an attention call for every engine.

``resolve_call`` takes ``attention``'s arguments, on NumPy or device arrays, refuses every bad one
with a ValueError naming it, and returns a typed ``Call``: the batched inputs, their ``Shape``, the
checked pages (§5.0), the sequences of a varlen batch (§6.6), the KV state (§5.9) and what to trace
(§10). An engine then only runs a Call (``apa_emu.api.run``, ``apa_gpu.api.run``), so the emulator
and the kernel refuse the same inputs with the same message. The model is FlashAttention-3's
``Arguments → to_underlying_arguments → Params``: the host arguments are lowered once.

This module is also apa_emu's declared contract with the engines outside it (apa_gpu, and later
users' own kernels): its ``__all__`` is all they import from apa_emu, and the import-linter contracts
in pyproject.toml hold apa_gpu to it (with the Engine interface of apa_emu/engines.py, which builds on
this module). Besides the call, that is the Result an engine returns, the Config, the geometry, the
prep statistics' layout, the KV state (§5.9), the varlen sequences (§6.6) and the trace records (§10).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from . import kvstate, trace, varlen
from . import trace as tr
from .config import Config
from .geometry import HEAD_DIMS, ROWS, TILE, Shape, cdiv
from .kvstate import KVState, Stats
from .paging import Pages, check_pages, gather
from .prep import KV_STATS, slot_keys
from .varlen import Seqs

__all__ = [
    "Call", "resolve_call", "resolve_config", "logical_kv", "validate", "Result",
    "Config", "Shape", "HEAD_DIMS", "ROWS", "TILE", "cdiv", "KV_STATS", "slot_keys",
    "kvstate", "KVState", "Stats", "Seqs", "trace", "Overflow", "NonFiniteOutput", "run_checked",
]

MAX_POSITION = 2**31 - 1  # positions are int32 in the kernel (cuda/common.cuh Geom)


@dataclass(frozen=True)
class Overflow:
    """A computed (row, head) pair whose output is not finite: its index into ``out`` without the last
    axis ((row, head), or (b, row, head) for a batched q) and the first stage of §10's row record that
    went non-finite (``trace.overflow_stage``)."""

    index: tuple[int, ...]
    stage: str


class NonFiniteOutput(RuntimeWarning):
    """``attention`` returned pairs whose output is not finite (``Result.overflow`` lists them)."""


@dataclass
class Result:
    """Output of one run. ``out`` has the shape of q; hot masks are per (b, hk, warp) (§10).
    ``err_bound`` (binary32, the shape of ``out`` without its last axis) bounds ‖out − exact‖₂ of
    each (row, head) (§9.7); ``err_est`` (the same shape) estimates it, about 2 standard deviations
    (§9.8: at the default ε it covers the error on at least 99.9 % of the pairs measured, and overstates
    it 2.5–7× at the median); rows not computed hold NaN in all three. ``overflow``: the computed pairs
    whose output is not finite, each with the stage that made it so (``attention`` fills it and warns)."""

    out: np.ndarray
    err_bound: np.ndarray
    hot: np.ndarray
    active_tiles: int
    hot_tiles: int
    config: Config
    visits: np.ndarray | None = None
    rows: np.ndarray | None = None
    meta: dict = field(default_factory=dict)
    overflow: list[Overflow] = field(default_factory=list)
    err_est: np.ndarray | None = None

    @property
    def hot_share(self) -> float:
        return self.hot_tiles / self.active_tiles if self.active_tiles else 0.0


@dataclass(frozen=True)
class Call:
    """A checked call. ``q`` is [B, n, H, d]; ``k``, ``v`` are [B, S, Hkv, d], or the page pools
    [pages, page_size, Hkv, d] when ``pages`` is set; in a varlen call (``seqs``) all three are the
    packed arrays [1, total, heads, d] and ``shape`` is the longest sequence's, B the sequences.
    Arrays stay where the caller had them (NumPy or device)."""

    q: Any
    k: Any
    v: Any
    shape: Shape
    squeeze: bool = False
    pages: Pages | None = None
    seqs: varlen.Seqs | None = None
    kv_state: KVState | None = None
    want: tr.TraceRequest | None = None
    warps: frozenset | None = None
    trace_spec: Any = None  # the trace= argument as given: a varlen call picks each sequence's share

    def sequences(self) -> list[Call | None]:
        """A varlen call as its sequences, each a bottom-right causal call of its own (§6.6) with its
        share of ``warps`` and ``trace`` renumbered to b = 0; None for a sequence none of whose warps
        is chosen."""
        cq, ck, n, S = self.seqs.cq, self.seqs.ck, self.seqs.n, self.seqs.S
        subs = []
        for b in range(n.shape[0]):
            warps = None if self.warps is None else [(0, hk, w) for bb, hk, w in sorted(self.warps) if bb == b]
            if warps == []:
                subs.append(None)
                continue
            q, k, v = self.q[0, cq[b]:cq[b + 1]], self.k[0, ck[b]:ck[b + 1]], self.v[0, ck[b]:ck[b + 1]]
            subs.append(resolve_call(q, k, v, int(S[b] - n[b]), window=self.shape.window,
                                     trace=_pick(self.trace_spec, b), warps=warps))
        return subs


def _pick(spec, b: int):
    """The (b, hk, warp) triples of sequence b, renumbered to b = 0."""
    if spec is None or isinstance(spec, str) or spec is True or spec is False:
        return spec
    return [(0, hk, w) for bb, hk, w in (tuple(int(x) for x in t) for t in spec) if bb == b]


def _array_module(arrays):
    """CuPy when any input is a CuPy array, else NumPy: the call's values are checked where they are."""
    for x in arrays:
        if type(x).__module__.startswith("cupy"):
            import cupy

            return cupy
    return np


def _host_view(x, xp):
    """What ``validate`` reads of an input: itself on the host; for a device array, a zero-copy
    stand-in of its shape when it is finite float16 (its values were checked on the device), else a
    host copy, so that the first bad index is named exactly as for a host array."""
    if xp is np or not isinstance(x, xp.ndarray):
        return x
    if x.dtype == np.float16 and bool(xp.isfinite(x).all()):
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)
    return xp.asnumpy(x)


def validate(q, k, v, q_offset) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Check shapes, dtypes, head layout and values; return batched [B, ...] views and whether the
    input had no batch axis. Every problem is a ValueError naming the argument."""
    q, k, v = _float16s(q, k, v)
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v: batch axis must be present in all or none (ndim {q.ndim}, {k.ndim}, {v.ndim})")
    squeeze = q.ndim == 3
    qb, kb, vb = (x[None] if squeeze else x for x in (q, k, v))
    _check_dims(qb, kb, vb, q.shape, k.shape, v.shape)
    _check_offset(q_offset, qb.shape[1])
    for name, x in (("q", qb), ("k", kb), ("v", vb)):
        # all strides zero: one value seen everywhere (a stand-in for a device array checked there)
        bad = ~np.isfinite(x if any(x.strides) else x[(slice(0, 1),) * x.ndim])
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}: non-finite value {x[idx]} at index {idx if not squeeze else idx[1:]}")
    return qb, kb, vb, squeeze


def _float16s(q, k, v):
    arrays = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise ValueError(f"{name}: expected a numpy array, got {type(x).__name__}")
        if x.dtype.kind != "f" or x.dtype.itemsize != 2:
            raise ValueError(f"{name}: expected dtype float16, got {x.dtype}")
        if x.ndim not in (3, 4):
            raise ValueError(f"{name}: expected shape [n, heads, d] or [batch, n, heads, d], got {x.shape}")
        arrays.append(x.astype(np.float16, copy=False))  # a byte-swapped float16 is converted, not refused
    return arrays


def _check_dims(qb, kb, vb, q_shape, k_shape, v_shape) -> None:
    if not (qb.shape[0] == kb.shape[0] == vb.shape[0]):
        raise ValueError(f"q, k, v: batch sizes differ ({qb.shape[0]}, {kb.shape[0]}, {vb.shape[0]})")
    if kb.shape != vb.shape:
        raise ValueError(f"k, v: shapes differ ({k_shape} vs {v_shape})")
    B, n, H, d = qb.shape
    S, Hkv = kb.shape[1], kb.shape[2]
    if kb.shape[3] != d:
        raise ValueError(f"k: head dim {kb.shape[3]} differs from q's {d}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head dim {d} is not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
    if n < 1 or S < 1 or H < 1 or Hkv < 1 or B < 1:
        raise ValueError(f"q, k: every dimension must be at least 1 (q {q_shape}, k {k_shape})")
    if H % Hkv:
        raise ValueError(f"q, k: query heads {H} are not a multiple of KV heads {Hkv}")


def _check_offset(q_offset, n: int) -> None:
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)):
        raise ValueError(f"q_offset: expected an integer, got {q_offset!r}")
    q_offset = int(q_offset)  # a Python int: NumPy fixed-width arithmetic would wrap around
    if q_offset < 0:
        raise ValueError(f"q_offset: {q_offset} leaves query row 0 with no key (it must be >= 0)")
    if int(q_offset) + n - 1 > MAX_POSITION:
        raise ValueError(f"q_offset: {q_offset} puts query positions past {MAX_POSITION} (int32 positions)")


def resolve_config(config) -> Config:
    """``config=``: None (the default Config) or a Config. Checked here, once for every engine, so that
    a string or a dict is one ValueError rather than an AttributeError deep in an engine."""
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise ValueError(f"config: expected an apa_emu Config or None, got {type(config).__name__} {config!r} "
                         f"(e.g. Config(eps=0.1))")
    return config


def check_triples(name: str, triples, shape: Shape) -> None:
    """``warps=``/``trace=``: every (b, hk, warp) must exist, or its rows would silently stay NaN."""
    if triples is None:
        return
    for t in tr.integer_triples(name, triples):
        if not (0 <= t[0] < shape.B and 0 <= t[1] < shape.Hkv and 0 <= t[2] < shape.nw):
            raise ValueError(f"{name}: warp {t} does not exist (b < {shape.B}, hk < {shape.Hkv}, "
                             f"warp < {shape.nw})")


def check_window(window, n: int, S: int, q_offset: int) -> int | None:
    """``window=``: None (full causal) or W ≥ 1 keys, and every query row must keep a key (§6.1)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
        raise ValueError(f"window: expected a positive integer (keys per row) or None, got {window!r}")
    # a Python int: a NumPy unsigned window would wrap around in the subtraction below
    window, q_offset = int(window), int(q_offset)
    if window < 1:
        raise ValueError(f"window={window}: must be >= 1 (the keys a row sees, its own position included)")
    last = q_offset + n - 1
    if last - window + 1 > S - 1:
        raise ValueError(f"window={window}: query row {n - 1} (position {last}) would see no key: its window "
                         f"starts at key {last - window + 1}, past the last key {S - 1}")
    return window


def check_state_use(kv_state, window, block_table, cu_seqlens_q, cu_seqlens_k, warps=None) -> None:
    """§5.9: a KV state is a KVState, defined for a dense causal chunk only."""
    if kv_state is None:
        return
    if not isinstance(kv_state, KVState):
        raise ValueError(f"kv_state: expected an apa_emu.KVState, got {type(kv_state).__name__}")
    for name, value in (("window", window), ("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k), ("warps", warps)):
        if value is not None:
            raise ValueError(f"kv_state: chunked prefill with {name}= is not supported; pass one or the other")


def _no_seqlen_k(seqlen_k) -> None:
    if seqlen_k is not None:
        raise ValueError("seqlen_k: only with a block_table (a contiguous k holds its S keys)")


def _shape(qb, kb, q_offset) -> Shape:
    B, n, H, d = qb.shape
    return Shape(B=B, n=n, H=H, Hkv=kb.shape[2], S=kb.shape[1], d=d, q_offset=int(q_offset))


def _resolve_varlen(q, k, v, q_offset, window, block_table, seqlen_k, cu_seqlens_q, cu_seqlens_k, xp) -> Call:
    """§6.6: the packed arrays, checked by their packed index; every sequence's rows keep a key."""
    seqs = varlen.check(q, k, v, q_offset, cu_seqlens_q, cu_seqlens_k, block_table)
    qb, kb, vb, _ = validate(*(_host_view(x, xp) for x in (q, k, v)), 0)
    _no_seqlen_k(seqlen_k)
    packed = _shape(qb, kb, 0)
    for e in seqs.shapes(packed.H, packed.Hkv, packed.d, None):
        check_window(window, e.n, e.S, e.q_offset)
    shape = seqs.longest(packed.H, packed.Hkv, packed.d, None if window is None else int(window))
    packed = (qb, kb, vb) if xp is np else (x[None] for x in (q, k, v))
    return Call(*packed, shape, seqs=seqs)


def _resolve_paged(q, k, v, q_offset, block_table, seqlen_k, xp) -> Call:
    """§5.0: the pools' values are checked where the table reads them: through ``gather`` when a pool
    holds a non-finite value, so that the bad key is named by its logical index."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, (np.ndarray, xp.ndarray)):
            raise ValueError(f"{name}: expected a numpy array, got {type(x).__name__}")
    host_table = xp.asnumpy(block_table) if xp is not np and isinstance(block_table, xp.ndarray) else block_table
    pages = check_pages(host_table, k.shape, v.shape, q.ndim, q.shape[0], seqlen_k)
    logical = []
    for x in (k, v):
        if x.dtype == np.float16 and bool((xp if isinstance(x, xp.ndarray) else np).isfinite(x).all()):
            keys = np.broadcast_to(np.zeros((), x.dtype), (pages.table.shape[0], pages.S, *x.shape[2:]))
        else:
            keys = gather(x if isinstance(x, np.ndarray) else xp.asnumpy(x), pages)
        logical.append(keys if q.ndim == 4 else keys[0])
    qb, kb, _, squeeze = validate(_host_view(q, xp), *logical, q_offset)
    return Call(qb if xp is np else q[None] if squeeze else q, k, v, _shape(qb, kb, q_offset), squeeze, pages)


def _resolve_dense(q, k, v, q_offset, seqlen_k, xp) -> Call:
    _no_seqlen_k(seqlen_k)
    qb, kb, vb, squeeze = validate(*(_host_view(x, xp) for x in (q, k, v)), q_offset)
    batched = (x[None] if squeeze else x for x in (q, k, v))
    if xp is np:
        batched = qb, kb, vb  # validate's float16 views (a byte-swapped input converted)
    return Call(*batched, _shape(qb, kb, q_offset), squeeze)


def resolve_call(q, k, v, q_offset=0, *, window=None, block_table=None, seqlen_k=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, kv_state: KVState | None = None, trace=None, warps=None) -> Call:
    """``attention``'s arguments (see ``apa_emu.attention``), checked and lowered once. Inputs on a
    device are checked there, and only what names a bad value comes back to the host."""
    check_state_use(kv_state, window, block_table, cu_seqlens_q, cu_seqlens_k, warps)
    xp = _array_module((q, k, v, block_table))
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        call = _resolve_varlen(q, k, v, q_offset, window, block_table, seqlen_k, cu_seqlens_q, cu_seqlens_k, xp)
        return _with_warps(call, trace, warps, trace_spec=trace)
    if block_table is None:
        call = _resolve_dense(q, k, v, q_offset, seqlen_k, xp)
    else:
        call = _resolve_paged(q, k, v, q_offset, block_table, seqlen_k, xp)
    s = call.shape
    call = replace(call, shape=replace(s, window=check_window(window, s.n, s.S, s.q_offset)), kv_state=kv_state)
    return _with_warps(call, trace, warps)


def _with_warps(call: Call, trace, warps, **fields) -> Call:
    """The call with what to trace and which warps to run, each triple checked to exist (in a varlen
    call, b is the sequence and the warp one of the longest sequence's; each sequence checks its own)."""
    want = tr.TraceRequest.of(trace)
    for name, triples in (("warps", warps), ("trace", None if want is None else want.warps)):
        check_triples(name, triples, call.shape)
    chosen = None if warps is None else frozenset(tr.integer_triples("warps", warps))
    return replace(call, want=want, warps=chosen, **fields)


def logical_kv(call: Call):
    """A host call's contiguous keys and values [B, S, Hkv, d]: the pools gathered through the block
    table (§5.0), which defines a paged call, else the inputs."""
    if call.pages is None:
        return call.k, call.v
    return (gather(x, call.pages).astype(np.float16, copy=False) for x in (call.k, call.v))


def _nonfinite_pairs(res: Result) -> np.ndarray:
    """Indices (into ``out`` without its last axis) of the computed pairs whose output is not finite:
    rows not computed hold NaN in ``err_bound`` too, a computed non-finite one +inf (§9.7 step 11)."""
    out = np.asarray(res.out)
    return np.argwhere(~np.isfinite(out).all(axis=-1) & ~np.isnan(np.asarray(res.err_bound)))


def owner(call: Call, index) -> tuple[tuple[int, int, int], int]:
    """The (b, hk, warp) computing the pair at ``index`` and its packed row there (§6.2; in a varlen
    call b is the sequence and the row its own)."""
    *lead, row, head = (int(i) for i in index)
    G = call.shape.G
    if call.seqs is not None:
        b = int(np.searchsorted(call.seqs.cq, row, side="right")) - 1
        row -= int(call.seqs.cq[b])
    else:
        b = lead[0] if lead else 0
    packed = row * G + head % G
    return (b, head // G, packed // ROWS), packed


def run_checked(call: Call, run) -> Result:
    """``run(call)``, an engine's Result of the call, with ``overflow`` filled and a NonFiniteOutput
    warning when a computed pair's output is not finite. The stage comes from §10's row records, so
    the warps holding such pairs run once more, traced, from the KV state as it was before the call
    (its statistics and decision; the kernel's cached images are formed afresh, bitwise alike)."""
    before = None if call.kv_state is None else replace(call.kv_state, history=list(call.kv_state.history),
                                                        cache=None)
    res = run(call)
    bad = _nonfinite_pairs(res)
    if not len(bad):
        return res
    owners = [owner(call, index) for index in bad]
    triples = sorted({t for t, _ in owners})
    # only those warps run, except in a chunk: the state's update needs every KV head's statistics
    traced = run(replace(call, want=tr.TraceRequest(frozenset(triples)), trace_spec=triples, kv_state=before,
                         warps=frozenset(triples) if before is None else None))
    records = {(int(r["b"]), int(r["hk"]), int(r["row"])): r for r in traced.rows}
    for index, ((b, hk, w), packed) in zip(bad, owners):
        stage = tr.overflow_stage(records[b, hk, packed]) or "no stage of the row record (a planted bug?)"
        res.overflow.append(Overflow(tuple(int(i) for i in index), stage))
    first = res.overflow[0]
    warnings.warn(f"{len(bad)} (row, head) pair(s) of the output are not finite; the first, {first.index}: "
                  f"{first.stage} (Result.overflow lists each)", NonFiniteOutput, stacklevel=3)
    return res
