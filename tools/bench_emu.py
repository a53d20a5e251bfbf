"""Benchmark the emulator: seconds per warp at 122880 keys (d = 128) and peak memory on a full dump.

    python tools/bench_emu.py [--keys 122880] [--models sm90 exact] [--reps 3]

with apa_emu importable (installed, or PYTHONPATH at the checkout). It times through the public
``apa_emu.prep.prepare_lowered`` and ``apa_emu.api.HeadRunner``, as a call runs each KV head.

1. One warp: 16 packed rows at the end of the context (one head), so it visits every tile. Prep of
   its KV head is timed apart from the warp (prep is shared by all warps of a head). Wall and CPU
   seconds per run, median over ``--reps``; single process, after a warm-up that compiles Numba.
2. Memory: a Llama-3.2-3B-shaped dump (2048 query rows, 24/8 heads, d = 128) over ``--keys`` keys,
   one warp per KV head through ``attention`` (prep of all 8 heads, streamed one at a time). Peak
   resident memory of the process, which includes the dump itself.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time

from apa_emu import Config, attention
from apa_emu.api import HeadRunner
from apa_emu.geometry import Shape
from apa_emu.prep import prepare_lowered
from apa_emu.study.synth import synthetic, synthetic_preset


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def one_warp(keys: int, model: str, reps: int):
    dump = synthetic(16, keys, 1, 1, 128, seed=1, q_offset=keys - 16)
    cfg = Config(mma=model)
    flags, qmul = cfg.flags(), cfg.qmul(128)
    shape = Shape(1, 16, 1, 1, keys, 128, dump.q_offset)
    prep_t, warp_t = [], []
    for _ in range(reps):
        prep, wall, cpu = timed(lambda: prepare_lowered(dump.q, dump.k, dump.v, dump.q_offset, flags, qmul))
        prep_t.append((wall, cpu))
        runner = HeadRunner(shape, 0, 0, prep, cfg, flags)
        res, wall, cpu = timed(lambda: runner.run(0))
        warp_t.append((wall, cpu))
    return prep_t, warp_t, res.nhot / res.active


def row(case, model, runs):
    wall = statistics.median(r[0] for r in runs)
    cpu = statistics.median(r[1] for r in runs)
    detail = ", ".join(f"{w:.2f}/{c:.2f}" for w, c in runs)
    print(f"| {case} | {model} | {wall:.2f} | {cpu:.2f} | {detail} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=122880)
    ap.add_argument("--models", nargs="+", default=["sm90", "exact"])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    warm = synthetic(16, 256, 1, 1, 128, seed=0)
    for model in args.models:
        attention(warm.q, warm.k, warm.v, warm.q_offset, Config(mma=model))

    print(f"# {platform.machine()}, python {platform.python_version()}, one process")
    print("| case | model | median wall s | median CPU s | runs (wall/CPU s) |")
    print("|---|---|---|---|---|")
    for model in args.models:
        prep_t, warp_t, share = one_warp(args.keys, model, args.reps)
        row(f"prep of one KV head, {args.keys} keys", model, prep_t)
        row(f"one warp, {args.keys} keys, d=128 (hot share {share:.3f})", model, warp_t)

    dump = synthetic_preset("llama-3.2-3b", 2048, args.keys, seed=2)
    G = dump.q.shape[1] // dump.k.shape[1]
    last_warp = (2048 * G) // 16 - 1
    picks = [(0, hk, last_warp) for hk in range(dump.k.shape[1])]
    _, wall, cpu = timed(lambda: attention(dump.q, dump.k, dump.v, dump.q_offset, Config(), warps=picks))
    print(f"| Llama-3.2-3B-shaped dump, 2048 x {args.keys}, prep of 8 KV heads + 8 warps | sm90 | "
          f"{wall:.2f} | {cpu:.2f} | 1 run |")
    print(f"# peak RSS of the process: {peak_rss_gib():.2f} GiB "
          f"(the dump itself: {(dump.q.nbytes + dump.k.nbytes + dump.v.nbytes) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
