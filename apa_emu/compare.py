"""An engine against the emulator: the first divergence of two Results, reproducer files and their
replay (``apa check``, ``python -m apa_gpu.replay``, tests/kernel/test_gpu_kernel.py); and ``check``, any
engine (docs/engines.md) against the emulator on one problem, bitwise or in tolerance, which ``apa
check --engine`` and the pytest plugin (apa_emu.testing) share.

A reproducer is an ``.npz`` with q, k, v, q_offset, the config as JSON, the trace request, the window,
the paging and the engine's run options (the kernel's schedule and segment); ``replay`` reruns both
sides and prints the first divergence, after comparing the prep outputs stage by stage. The other
side is named after its engine ("gpu" for the kernel).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import api
from . import trace as tr
from .call import logical_kv, owner, resolve_call
from .config import Config
from .engines import EngineError, as_result, check_untouched, guarded, input_copy
from .prep import prepare

canon_nan = tr.canonical_nan


def _record_divergence(where, emu_recs, other_recs, fields, keys, name):
    """apa_emu.trace.first_difference, with the two sides named and their bit patterns shown."""
    d = tr.first_difference(emu_recs, other_recs, fields, keys=keys)
    if d is None:
        return None
    out = {"where": where, **{k: v for k, v in d.items() if k not in ("left", "right", "element")}}
    if d.get("element") is not None:
        out["row in warp" if where == "visits" else "channel"] = d["element"]
    a, b = d["left"], d["right"]
    out.update({"emulator": a, name: b})
    if isinstance(a, np.floating):
        out.update({"emulator_bits": hex(int(np.asarray(a).view(f"u{a.itemsize}"))),
                    f"{name}_bits": hex(int(np.asarray(b).view(f"u{b.itemsize}")))})
    return out


def first_divergence(emu, other, name: str = "gpu") -> dict | None:
    """The first difference between the emulator's Result and an engine's (called ``name``), in the
    order the kernel computes: pass-1 visit records (b, hk, warp, visit, field), hot masks, row
    records (b, hk, row, field), then the arrays (out, err_bound, and any other array field of
    Result, in its order). A field the engine returned as None is not compared (whether it should
    have returned it is the checker's question, ``check``)."""
    if emu.visits is not None and other.visits is not None:
        d = _record_divergence("visits", emu.visits, other.visits, ("b", "hk", "warp", "visit") + tr.VISIT_FIELDS,
                               ("b", "hk", "warp", "visit"), name)
        if d is not None:
            return d
    if other.hot is not None and (emu.hot.shape != other.hot.shape or not np.array_equal(emu.hot, other.hot)):
        if emu.hot.shape != other.hot.shape:
            return {"where": "hot", "field": "shape", "emulator": emu.hot.shape, name: other.hot.shape}
        idx = tuple(int(i) for i in np.argwhere(emu.hot != other.hot)[0])
        return {"where": "hot", "index (b, hk, warp, word)": idx, "emulator": hex(int(emu.hot[idx])),
                name: hex(int(other.hot[idx]))}
    if emu.rows is not None and other.rows is not None:
        d = _record_divergence("rows", emu.rows, other.rows, ("b", "hk", "row") + tr.ROW_FIELDS, ("b", "hk", "row"),
                               name)
        if d is not None:
            return d
    for f in _array_fields(emu):
        if getattr(other, f) is not None:
            d = _array_divergence(f, getattr(emu, f), np.asarray(getattr(other, f)), name)
            if d is not None:
                return d
    return None


def _array_fields(res) -> list[str]:
    """Result's per-pair array fields (out, err_bound, and any added later), found by their values."""
    return [f.name for f in dataclasses.fields(res) if f.name not in ("hot", "visits", "rows")
            and isinstance(getattr(res, f.name), np.ndarray)]


def _array_divergence(where: str, emu: np.ndarray, other: np.ndarray, name: str) -> dict | None:
    """The first element where two float arrays differ bitwise (NaNs canonical), with the count."""
    a, b = canon_nan(emu), canon_nan(other)
    if a.shape != b.shape:
        return {"where": where, "field": "shape", "emulator": a.shape, name: b.shape}
    bits = f"u{a.dtype.itemsize}"
    bad = np.argwhere(a.view(bits) != b.view(bits))
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        return {"where": where, "index": idx, "count": len(bad), "emulator": a[idx], name: b[idx]}
    return None


def describe(div: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in div.items())


def config_to_json(cfg: Config) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def config_from_json(text: str) -> Config:
    return Config(**json.loads(text))


def repro_dir() -> Path:
    return Path(os.environ.get("APA_GPU_REPRO_DIR", "/tmp/apa_gpu_repro"))


def save_reproducer(q, k, v, q_offset, cfg: Config, trace="all", note: str = "", schedule: str = "separate",
                    window: int | None = None, block_table=None, seqlen_k: int | None = None,
                    segment_tiles: int | None = None) -> Path:
    """Write an .npz reproducer named by a hash of its content (the launch schedule and the bounded
    schedule's segment, the window and the paging included: each is its own code path); returns its
    path."""
    h = hashlib.sha256()
    table = np.zeros((0, 0), np.int32) if block_table is None else np.asarray(block_table, np.int32)
    for x in (q, k, v, table):
        h.update(np.ascontiguousarray(x).tobytes())
    cfg_json = config_to_json(cfg)
    h.update(f"{q_offset}|{cfg_json}|{trace}|{schedule}|{window}|{seqlen_k}|{segment_tiles}".encode())
    path = repro_dir() / f"apa_gpu_{h.hexdigest()[:16]}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, q=q, k=k, v=v, q_offset=np.int64(q_offset), config=cfg_json,
                        trace=json.dumps(trace), note=note, schedule=schedule, window=json.dumps(window),
                        block_table=table, seqlen_k=json.dumps(seqlen_k), segment_tiles=json.dumps(segment_tiles))
    return path


def load_reproducer(path):
    z = np.load(path, allow_pickle=False)
    trace = json.loads(str(z["trace"]))
    if isinstance(trace, list):
        trace = [tuple(t) for t in trace]
    paged = "block_table" in z and z["block_table"].size > 0
    return dict(q=z["q"], k=z["k"], v=z["v"], q_offset=int(z["q_offset"]), config=config_from_json(str(z["config"])),
                trace=trace, schedule=str(z["schedule"]) if "schedule" in z else "separate",
                window=json.loads(str(z["window"])) if "window" in z else None,
                block_table=z["block_table"] if paged else None,
                seqlen_k=json.loads(str(z["seqlen_k"])) if paged else None,
                segment_tiles=json.loads(str(z["segment_tiles"])) if "segment_tiles" in z else None)


def prep_divergence(engine, qb, kb, vb, q_offset, cfg: Config) -> str | None:
    """The first prep output (numerics.md §5) where ``engine.prep_arrays`` and the emulator differ,
    or None; qb, kb, vb are a resolved call's batched arrays, the keys contiguous."""
    other = engine.prep_arrays(qb, kb, vb, q_offset, cfg)
    for b in range(qb.shape[0]):
        p = prepare(qb[b], kb[b], vb[b], int(q_offset), cfg)
        for name, emu in (("kmean", p.kmean), ("kg", p.kg), ("vg", p.vg), ("qhat", p.qhat), ("cq", p.cq),
                          ("sh", p.sh), ("khat", p.khat), ("vhat_t", p.vhat_t), ("qstat", p.qstat),
                          ("kvstat", p.kvstat)):
            g = np.asarray(other[name][b], np.float32)
            e = np.asarray(emu, np.float32)
            if g.shape != e.shape:
                return f"prep {name} (batch {b}): shape {engine.name} {g.shape} vs emulator {e.shape}"
            bad = np.argwhere(canon_nan(g).view(np.uint32) != canon_nan(e).view(np.uint32))
            if bad.size:
                i = tuple(int(x) for x in bad[0])
                return (f"prep {name} (batch {b}) differs at {i} ({len(bad)} elements): {engine.name} {g[i]!r} "
                        f"vs emulator {e[i]!r}")
    return None


def replay(saved: dict, engine, *, options: dict, workers: int = 1) -> int:
    """Rerun a loaded reproducer on the emulator and on ``engine`` with its run ``options``: print the
    problem, the prep comparison (when the engine offers its prep outputs) and the run's first
    divergence. Returns 0 when everything is bitwise equal, else 1."""
    q, k, v, off, cfg = saved["q"], saved["k"], saved["v"], saved["q_offset"], saved["config"]
    paging = dict(block_table=saved["block_table"], seqlen_k=saved["seqlen_k"])
    print(f"q {q.shape} k {k.shape} q_offset {off} window {saved['window']} paged {saved['block_table'] is not None}\n"
          f"config {cfg}" + "".join(f"\n{name} {options.get(name)}" for name in engine.options))
    call = resolve_call(q, k, v, off, window=saved["window"], trace=saved["trace"], **paging)
    prep = None
    if engine.prep_arrays is not None:
        prep = prep_divergence(engine, call.q, *logical_kv(call), off, cfg)  # of the contiguous layout (§5.0)
        print("prep: " + (prep or "bitwise equal"))
    emu = api.run(call, cfg, workers=workers)
    div = first_divergence(emu, engine.run(call, cfg, **options), engine.name)
    print("run: " + ("bitwise equal" if div is None else "first divergence: " + describe(div)))
    return 0 if div is None and prep is None else 1


# -- any engine against the emulator: bitwise or in tolerance (apa check --engine, apa_emu.testing) ---

MODES = ("auto", "bitwise", "tolerance")
MAX_REL_L2 = 0.1  # tolerance mode's default bound on a pair's relative L2 distance to the emulator's output


@dataclass
class Outcome:
    """An engine's check against the emulator on one problem: the mode, and in bitwise mode the first
    differing (row, head) (``pair``, an index into ``out`` without its last axis) and the first
    divergence in data-flow order (``divergence``, as first_divergence); in tolerance mode the
    ``report``. ``repro`` is the one command that replays it, when the caller knows one."""

    engine: str
    mode: str
    passed: bool
    divergence: dict | None = None
    pair: tuple | None = None
    report: "ToleranceReport | None" = None
    repro: str | None = None
    emulator: object = None  # the emulator's traced Result, for a caller's own questions (its hot tiles)
    measures: "Measures | None" = None  # tolerance: the per-pair measures behind the report

    def lines(self) -> list[str]:
        if self.mode == "bitwise":
            if self.passed:
                lines = [f"{self.engine} equals the emulator bitwise"]
            else:
                lines = [f"{self.engine} differs from the emulator bitwise"]
                if self.pair is not None:
                    lines.append(f"  first differing (row, head): {_pair_words(self.pair)}")
                lines.append(f"  first divergence: {describe(self.divergence)}")
        else:
            lines = [f"{self.engine} against the emulator in tolerance: "
                     f"{'within' if self.passed else 'beyond'} relative L2 {self.report.bound:g}",
                     *("  " + line for line in self.report.lines())]
        if self.repro and not self.passed:
            lines.append(f"  replay: {self.repro}")
        return lines


def _pair_words(index) -> str:
    *lead, row, head = index
    return f"({row}, {head})" + (f" of batch {lead[0]}" if lead else "")


def resolve_mode(engine, mode: str) -> str:
    """``auto``: bitwise when the engine claims bit-exactness, else tolerance."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    return ("bitwise" if engine.bitexact else "tolerance") if mode == "auto" else mode


_FEATURE_OF = {"window": "window", "block_table": "paging", "cu_seqlens_q": "varlen", "kv_state": "kv_state"}


def rel_l2_bound(x) -> float:
    """``max_rel_l2`` as a float: a finite number >= 0, else a ValueError naming it (a negative or NaN
    bound would fail every pair, the emulator's own included)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)) \
            or not 0 <= x < np.inf:
        raise ValueError(f"max_rel_l2={x!r}: expected a finite number >= 0")
    return float(x)


def check(engine, args: tuple, kwargs: dict, cfg: Config, mode: str = "auto", *, warps=None, options=None,
          max_rel_l2: float = MAX_REL_L2, workers: int = 1) -> Outcome:
    """``engine`` (an apa_emu.engines.Engine) against the emulator on ``attention(*args, cfg, **kwargs)``,
    on the (b, hk, warp) triples ``warps`` (None: all), the engine run with its ``options`` and the
    emulator over ``workers`` processes. The emulator traces the warps it runs, to localise a
    divergence and to say where a tolerance engine departs; the engine traces when it claims "trace",
    and runs every warp unless it claims "warps".
    An engine that raises, returns something that is not a Result or an output of q's shape and
    dtype, returns NaN where the emulator's output is finite, or claims trace records it does not
    return, is an EngineError naming it; a problem using a feature it does not declare, a ValueError."""
    mode, max_rel_l2 = resolve_mode(engine, mode), rel_l2_bound(max_rel_l2)
    for key, feature in _FEATURE_OF.items():
        if kwargs.get(key) is not None and feature not in engine.features:
            raise ValueError(f"engine {engine.name} does not implement {feature} (it declares "
                             f"{', '.join(sorted(engine.features)) or 'no feature'})")
    want = "all" if warps is None else warps
    call = resolve_call(*args, trace=want, warps=warps, **kwargs)
    traced = "trace" in engine.features
    given = [input_copy(x) for x in args[:3]]  # the engine's own copies: it must not change them
    theirs = resolve_call(*given, *args[3:], trace=want if traced else None,
                          warps=warps if "warps" in engine.features else None, **_copied(kwargs))
    emu = api.run(call, cfg, workers=workers)
    with guarded(f"engine {engine.name} raised"):
        res = engine.run(theirs, cfg, **(options or {}))
    check_untouched(engine.name, _call_inputs(call), _call_inputs(theirs))
    res = as_result(engine.name, res, theirs, cfg)
    if traced and (res.visits is None or res.rows is None):
        raise EngineError(f"engine {engine.name} claims 'trace' but returned no trace records (visits, rows)")
    _check_finite(engine.name, emu.out, res.out)
    if mode == "bitwise":
        if warps is not None:
            _adopt_elsewhere(call, emu, res)
        div = first_divergence(emu, res, engine.name)
        return Outcome(engine.name, mode, div is None, divergence=_with_tile(div, emu),
                       pair=_first_pair(emu.out, res.out), emulator=emu)
    m = measure(call, emu, res.out)
    report = ToleranceReport.of([m], max_rel_l2)
    return Outcome(engine.name, mode, report.passed, report=report, emulator=emu, measures=m)


_COPIED = ("block_table", "cu_seqlens_q", "cu_seqlens_k")


def _copied(kwargs: dict) -> dict:
    return {key: input_copy(value) if key in _COPIED else value for key, value in kwargs.items()}


def _call_inputs(call) -> dict:
    """The arrays a resolved call hands an engine, by name."""
    seqs = call.seqs
    return dict(q=call.q, k=call.k, v=call.v, block_table=None if call.pages is None else call.pages.table,
                cu_seqlens_q=None if seqs is None else seqs.cq, cu_seqlens_k=None if seqs is None else seqs.ck)


def _adopt_elsewhere(call, emu, res) -> None:
    """The emulator ran the chosen warps only: elsewhere its per-pair arrays and hot masks become the
    engine's, so that only the chosen warps are compared."""
    chosen = _computed(call, np.asarray(emu.out).shape[:-1])
    for f in _array_fields(emu):
        theirs = getattr(res, f)
        if theirs is not None and np.shape(theirs) == getattr(emu, f).shape:
            getattr(emu, f)[~chosen] = np.asarray(theirs)[~chosen]
    if res.hot is not None and res.hot.shape == emu.hot.shape:
        for b, hk, w in np.ndindex(*emu.hot.shape[:3]):
            if (b, hk, w) not in call.warps:
                emu.hot[b, hk, w] = res.hot[b, hk, w]


def _computed(call, lead: tuple) -> np.ndarray:
    """Which pairs of an output of leading shape ``lead`` the call computes: those of its warps."""
    if call.warps is None:
        return np.ones(lead, bool)
    return np.array([owner(call, idx)[0] in call.warps for idx in np.ndindex(*lead)], bool).reshape(lead)


def _with_tile(div, emu):
    """A visit record's divergence with the tile of that visit named beside it."""
    if div is None or div["where"] != "visits" or "record" not in div:
        return div
    keys = list(div)
    at = keys.index("visit") + 1
    return {k: div[k] for k in keys[:at]} | {"tile": int(emu.visits[div["record"]]["tile"])} | \
        {k: div[k] for k in keys[at:]}


def _check_finite(name: str, emu_out, out) -> None:
    bad = ~np.isfinite(np.asarray(out, np.float32)) & np.isfinite(np.asarray(emu_out, np.float32))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise EngineError(f"engine {name} returned {out[idx]} at out index {idx}, where the emulator's output is "
                          f"finite ({emu_out[idx]})")


def _first_pair(emu_out, out) -> tuple | None:
    a, b = canon_nan(emu_out), canon_nan(np.asarray(out))
    if a.shape != b.shape:
        return None
    bad = np.argwhere((a.view(np.uint16) != b.view(np.uint16)).any(axis=-1))
    return tuple(int(i) for i in bad[0]) if bad.size else None


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a − b| in FP16 units in the last place: the distance between the two values' places on the
    ordered FP16 line (−0 and +0 one place)."""
    def place(x):
        bits = np.asarray(x, np.float16).view(np.uint16).astype(np.int64)
        return np.where(bits & 0x8000, 0x8000 - bits, bits)

    return np.abs(place(a) - place(b))


ULP_EDGES = (0, 1, 2, 4, 16, 64, 256, 1024)  # the histogram's bins: 0, 1, 2-3, 4-15, ..., >= 1024


NONFINITE_ULP = 1 << 16  # an element non-finite on one side only, or NaN against ±Inf: past every ULP bin
FINITE, ALIKE, DIFFER = 0, 1, 2  # a pair's non-finite elements: none, alike on both sides, different


class Measures(NamedTuple):
    """Per pair ((row, head)) of a tolerance check: its index into ``out`` without the last axis, its
    relative L2 distance and cosine to the emulator's output, its elements' ULP distances, whether its
    warp left a tile cold, whether a cold tile set its row's frame, and whether it holds a non-finite
    element (ALIKE: on both sides, of one kind in the same places; DIFFER: otherwise)."""

    index: np.ndarray  # [pairs, k]
    rel: np.ndarray
    cos: np.ndarray
    ulps: np.ndarray  # [pairs, d]
    cold: np.ndarray
    framed_cold: np.ndarray
    nonfinite: np.ndarray  # [pairs] FINITE, ALIKE or DIFFER


def _kind(x: np.ndarray) -> np.ndarray:
    """0 for a finite element, 1 for NaN, 2 for +Inf, 3 for −Inf."""
    return np.select([np.isnan(x), x == np.inf, x == -np.inf], [1, 2, 3], 0)


def measure(call, emu, out) -> Measures:
    """``out`` against the emulator's traced Result ``emu`` of ``call``, on the pairs it computed.
    Non-finite elements are compared as such (§8.7 lets the emulator's output overflow): a pair whose
    NaN and ±Inf sit in the same places on both sides is measured on its finite elements, any other
    non-finite element is a departure beyond every bound (relative L2 +inf, cosine 0)."""
    computed = _computed(call, np.asarray(emu.out).shape[:-1])
    index = np.argwhere(computed)
    e16, o16 = np.asarray(emu.out)[computed], np.asarray(out)[computed]
    e64, o64 = e16.astype(np.float64), o16.astype(np.float64)
    ke, ko = _kind(e64), _kind(o64)
    alike, finite = (ke == ko).all(axis=-1), (ke == 0) & (ko == 0)
    e, o = np.where(finite, e64, 0.0), np.where(finite, o64, 0.0)
    diff, norm, on = (np.linalg.norm(x, axis=-1) for x in (o - e, e, o))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(norm > 0, diff / norm, np.where(diff > 0, np.inf, 0.0))
        cos = np.where(norm * on > 0, (o * e).sum(-1) / (norm * on), np.where(diff > 0, 0.0, 1.0))
    rel, cos = np.where(alike, rel, np.inf), np.where(alike, cos, 0.0)
    ulps = np.where(finite, ulp_distance(e16, o16), np.where(ke == ko, 0, NONFINITE_ULP))
    nonfinite = np.where(finite.all(axis=-1), FINITE, np.where(alike, ALIKE, DIFFER))
    return Measures(index, rel, cos, ulps, *_tiles_and_frames(call, emu, index), nonfinite)


@dataclass
class ToleranceReport:
    """An approximate engine against the emulator, pair by pair ((row, head)): the ULP distance of the
    FP16 outputs and its histogram, each pair's relative L2 distance and cosine, and where the
    departure concentrates: by query head, by query position (quarters of the rows), by whether the
    pair's warp left tiles cold (APA's FP4 estimate) or recomputed every one exactly, and by which
    pass set the row's frame (the row max of the hot tiles, pass 2's m2, or of the cold ones, m1)."""

    bound: float
    pairs: int
    ulp_histogram: dict
    max_ulp: int
    rel_l2: np.ndarray
    cos: np.ndarray
    index: np.ndarray
    groups: dict  # name -> {label: (pairs, mean rel L2, max rel L2)}
    problem: str = ""  # the problem it measures, where a report stands for several (the worst of them)
    nonfinite: tuple = (0, 0)  # pairs with NaN or ±Inf alike on both sides, pairs that differ in them

    @classmethod
    def of(cls, parts: list[Measures], bound: float = MAX_REL_L2) -> "ToleranceReport":
        m = Measures(*(np.concatenate(x) for x in zip(*parts)))
        ulps = m.ulps.ravel()
        edges = (*ULP_EDGES, np.iinfo(np.int64).max)
        hist = {(f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" if hi < edges[-1] else f">={lo}"):
                int(((ulps >= lo) & (ulps < hi)).sum()) for lo, hi in zip(edges[:-1], edges[1:])}
        heads, rows = m.index[:, -1], m.index[:, -2]
        quarter = (4 * rows) // (int(rows.max()) + 1) if rows.size else rows
        groups = {
            "query head": _split(m.rel, {f"head {h}": heads == h for h in np.unique(heads)}),
            "query position": _split(m.rel, {f"rows {int(rows[quarter == i].min())}-{int(rows[quarter == i].max())}":
                                             quarter == i for i in np.unique(quarter)}),
            "tiles": _split(m.rel, {"warps with cold tiles": m.cold, "warps with every tile hot (exact)": ~m.cold}),
            "frame": _split(m.rel, {"set by a cold tile (m1 > m2)": m.framed_cold,
                                    "set by a hot tile": ~m.framed_cold}),
        }
        return cls(float(bound), len(m.index), hist, int(ulps.max()) if ulps.size else 0, m.rel, m.cos, m.index,
                   groups, nonfinite=(int((m.nonfinite == ALIKE).sum()), int((m.nonfinite == DIFFER).sum())))

    @property
    def passed(self) -> bool:
        return bool(np.all(self.rel_l2 <= self.bound))

    def worst(self) -> tuple | None:
        """(pair, relative L2, cosine) of the pair farthest from the emulator; None without pairs."""
        if not self.pairs:
            return None
        i = int(np.argmax(self.rel_l2))
        return tuple(int(x) for x in self.index[i]), float(self.rel_l2[i]), float(self.cos[i])

    @property
    def worst_rel(self) -> float:
        """The largest relative L2 distance of a pair (−inf without pairs), to rank reports."""
        return float(self.rel_l2.max()) if self.pairs else -np.inf

    def lines(self) -> list[str]:
        lines = [f"the worst problem: {self.problem}"] if self.problem else []
        if not self.pairs:
            return [*lines, "0 pairs: the emulator computed none of the chosen pairs"]
        pair, rel, cos = self.worst()
        hist = ", ".join(f"{label}: {count}" for label, count in self.ulp_histogram.items() if count)
        alike, differ = self.nonfinite
        lines += [f"{self.pairs} pairs; ULP distance of the output elements: {hist}; max {self.max_ulp}",
                  f"relative L2 per pair: median {np.median(self.rel_l2):.3g}, max {rel:.3g} at (row, head) "
                  f"{_pair_words(pair)} (cosine {cos:.6f}); lowest cosine {self.cos.min():.6f}"]
        if alike or differ:
            lines.append(f"non-finite outputs: {alike} pairs hold NaN or ±Inf alike on both sides (measured on "
                         f"their finite elements), {differ} pairs differ in them")
        for name, parts in self.groups.items():
            words = "; ".join(f"{label}: {count} pairs, mean {mean:.3g}, max {top:.3g}"
                              for label, (count, mean, top) in parts.items())
            lines.append(f"by {name}: {words}")
        return lines


def _split(rel, masks: dict) -> dict:
    return {label: (int(m.sum()), float(rel[m].mean()), float(rel[m].max())) for label, m in masks.items() if m.any()}


def _tiles_and_frames(call, emu, index) -> tuple[np.ndarray, np.ndarray]:
    """For each pair: whether its warp left an active tile cold, from the emulator's hot masks, and
    whether its row's frame came from a cold tile (the row records' m1 above m2)."""
    shapes = [sub.shape if sub is not None else None for sub in call.sequences()] if call.seqs is not None \
        else [call.shape] * call.shape.B
    frames = {(int(r["b"]), int(r["hk"]), int(r["row"])): (float(r["m1"]), float(r["m2"])) for r in emu.rows}
    cold, framed = np.zeros(len(index), bool), np.zeros(len(index), bool)
    counted = {}
    for i, idx in enumerate(index):
        (b, hk, w), packed = owner(call, idx)
        if (b, hk, w) not in counted:
            shape = shapes[b]
            first, last = int(shape.first_tiles(w)), int(shape.last_tiles(w))
            t = np.arange(first, last + 1)
            hot = (emu.hot[b, hk, w][t // 32] >> (t % 32).astype(np.uint32)) & 1
            counted[b, hk, w] = bool((hot == 0).any())
        cold[i] = counted[b, hk, w]
        m1, m2 = frames[b, hk, packed]
        framed[i] = m1 > m2
    return cold, framed
