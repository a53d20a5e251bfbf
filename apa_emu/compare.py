"""An engine against the emulator: the first divergence of two Results, reproducer files and their
replay (``apa check``, ``python -m apa_gpu.replay``, tests/test_gpu_kernel.py).

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
from pathlib import Path

import numpy as np

from . import api
from . import trace as tr
from .call import logical_kv, resolve_call
from .config import Config
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
    records (b, hk, row, field), the output."""
    if (emu.visits is None) != (other.visits is None):
        return {"where": "visits", "field": "presence", "emulator": emu.visits is not None,
                name: other.visits is not None}
    if emu.visits is not None:
        d = _record_divergence("visits", emu.visits, other.visits, ("b", "hk", "warp", "visit") + tr.VISIT_FIELDS,
                               ("b", "hk", "warp", "visit"), name)
        if d is not None:
            return d
    if emu.hot.shape != other.hot.shape or not np.array_equal(emu.hot, other.hot):
        if emu.hot.shape != other.hot.shape:
            return {"where": "hot", "field": "shape", "emulator": emu.hot.shape, name: other.hot.shape}
        idx = tuple(int(i) for i in np.argwhere(emu.hot != other.hot)[0])
        return {"where": "hot", "index (b, hk, warp, word)": idx, "emulator": hex(int(emu.hot[idx])),
                name: hex(int(other.hot[idx]))}
    if (emu.rows is None) != (other.rows is None):
        return {"where": "rows", "field": "presence", "emulator": emu.rows is not None, name: other.rows is not None}
    if emu.rows is not None:
        d = _record_divergence("rows", emu.rows, other.rows, ("b", "hk", "row") + tr.ROW_FIELDS, ("b", "hk", "row"),
                               name)
        if d is not None:
            return d
    return (_array_divergence("out", emu.out, other.out, name)
            or _array_divergence("err_bound", emu.err_bound, other.err_bound, name)
            or _array_divergence("err_est", emu.err_est, other.err_est, name))


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
