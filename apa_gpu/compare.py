"""Kernel-vs-emulator comparison, reproducer files and their replay (tests/test_gpu_kernel.py).

A reproducer is an ``.npz`` with q, k, v, q_offset, the config as JSON and the trace request;
``python -m apa_gpu.replay FILE`` reruns both sides and prints the first divergence, after
comparing the prep outputs stage by stage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from apa_emu import trace as tr
from apa_emu.config import Config

canon_nan = tr.canonical_nan


def _record_divergence(where, emu_recs, gpu_recs, fields, keys):
    """apa_emu.trace.first_difference, with the two sides named and their bit patterns shown."""
    d = tr.first_difference(emu_recs, gpu_recs, fields, keys=keys)
    if d is None:
        return None
    out = {"where": where, **{k: v for k, v in d.items() if k not in ("left", "right", "element")}}
    if d.get("element") is not None:
        out["row in warp" if where == "visits" else "channel"] = d["element"]
    a, b = d["left"], d["right"]
    out.update(emulator=a, gpu=b)
    if isinstance(a, np.floating):
        out.update(emulator_bits=hex(int(np.asarray(a).view(f"u{a.itemsize}"))),
                   gpu_bits=hex(int(np.asarray(b).view(f"u{b.itemsize}"))))
    return out


def first_divergence(emu, gpu) -> dict | None:
    """The first difference between two Results, in the order the kernel computes: pass-1 visit
    records (b, hk, warp, visit, field), hot masks, row records (b, hk, row, field), the output."""
    if (emu.visits is None) != (gpu.visits is None):
        return {"where": "visits", "field": "presence", "emulator": emu.visits is not None,
                "gpu": gpu.visits is not None}
    if emu.visits is not None:
        d = _record_divergence("visits", emu.visits, gpu.visits, ("b", "hk", "warp", "visit") + tr.VISIT_FIELDS,
                               ("b", "hk", "warp", "visit"))
        if d is not None:
            return d
    if emu.hot.shape != gpu.hot.shape or not np.array_equal(emu.hot, gpu.hot):
        if emu.hot.shape != gpu.hot.shape:
            return {"where": "hot", "field": "shape", "emulator": emu.hot.shape, "gpu": gpu.hot.shape}
        idx = tuple(int(i) for i in np.argwhere(emu.hot != gpu.hot)[0])
        return {"where": "hot", "index (b, hk, warp, word)": idx, "emulator": hex(int(emu.hot[idx])),
                "gpu": hex(int(gpu.hot[idx]))}
    if (emu.rows is None) != (gpu.rows is None):
        return {"where": "rows", "field": "presence", "emulator": emu.rows is not None, "gpu": gpu.rows is not None}
    if emu.rows is not None:
        d = _record_divergence("rows", emu.rows, gpu.rows, ("b", "hk", "row") + tr.ROW_FIELDS, ("b", "hk", "row"))
        if d is not None:
            return d
    return _array_divergence("out", emu.out, gpu.out) or _array_divergence("err_bound", emu.err_bound, gpu.err_bound)


def _array_divergence(where: str, emu: np.ndarray, gpu: np.ndarray) -> dict | None:
    """The first element where two float arrays differ bitwise (NaNs canonical), with the count."""
    a, b = canon_nan(emu), canon_nan(gpu)
    if a.shape != b.shape:
        return {"where": where, "field": "shape", "emulator": a.shape, "gpu": b.shape}
    bits = f"u{a.dtype.itemsize}"
    bad = np.argwhere(a.view(bits) != b.view(bits))
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        return {"where": where, "index": idx, "count": len(bad), "emulator": a[idx], "gpu": b[idx]}
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


def prep_divergence(q, k, v, q_offset, cfg: Config) -> str | None:
    """The first prep output (numerics.md §5) where kernel and emulator differ, or None."""
    from apa_emu.call import validate
    from apa_emu.prep import prepare

    from .api import prep_arrays

    qb, kb, vb, _ = validate(q, k, v, q_offset)
    gpu = prep_arrays(qb, kb, vb, q_offset, cfg)
    for b in range(qb.shape[0]):
        p = prepare(qb[b], kb[b], vb[b], int(q_offset), cfg)
        for name, emu in (("kmean", p.kmean), ("kg", p.kg), ("vg", p.vg), ("qhat", p.qhat), ("cq", p.cq),
                          ("sh", p.sh), ("khat", p.khat), ("vhat_t", p.vhat_t), ("qstat", p.qstat),
                          ("kvstat", p.kvstat)):
            g = np.asarray(gpu[name][b], np.float32)
            e = np.asarray(emu, np.float32)
            if g.shape != e.shape:
                return f"prep {name} (batch {b}): shape gpu {g.shape} vs emulator {e.shape}"
            bad = np.argwhere(canon_nan(g).view(np.uint32) != canon_nan(e).view(np.uint32))
            if bad.size:
                i = tuple(int(x) for x in bad[0])
                return (f"prep {name} (batch {b}) differs at {i} ({len(bad)} elements): gpu {g[i]!r} "
                        f"vs emulator {e[i]!r}")
    return None
