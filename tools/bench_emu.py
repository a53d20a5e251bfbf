"""Benchmark the emulator: seconds per warp at 122880 keys (d = 128) and a small full dump.

    python tools/bench_emu.py [--keys 122880] [--models sm90 exact] [--reps 3]

Reports the median over ``--reps`` runs of one warp (16 packed rows at the end of the context, so it
visits every tile), the peak resident memory of the process, and the time of a small full dump. Runs
single-threaded (one core), after a warm-up that compiles the Numba kernels.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apa_emu import Config, attention  # noqa: E402
from apa_emu.prep import prepare  # noqa: E402
from apa_emu.synth import synthetic  # noqa: E402


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def one_warp(keys: int, model: str, reps: int) -> tuple[list[float], list[float], float]:
    """16 query rows of one head at the end of the context: one warp that visits all keys/64 tiles.
    Returns (prep seconds, seconds of the whole call, hot share) per run; the warp is the difference."""
    dump = synthetic(16, keys, 1, 1, 128, seed=1, q_offset=keys - 16)
    cfg = Config(mma=model)
    preps, totals = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        prepare(dump.q, dump.k, dump.v, dump.q_offset, cfg)
        preps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = attention(dump.q, dump.k, dump.v, dump.q_offset, cfg)
        totals.append(time.perf_counter() - t0)
    return preps, totals, res.hot_share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=122880)
    ap.add_argument("--models", nargs="+", default=["sm90", "exact"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dump", default="512x2048", help="small full dump: QUERIESxKEYS (24/8 heads, d=128)")
    args = ap.parse_args()

    warm = synthetic(16, 256, 1, 1, 128, seed=0, q_offset=240)
    for model in args.models:
        attention(warm.q, warm.k, warm.v, warm.q_offset, Config(mma=model))

    print(f"# machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, 1 worker")
    print("| case | model | median s | runs (s) |")
    print("|---|---|---|---|")
    for model in args.models:
        preps, totals, share = one_warp(args.keys, model, args.reps)
        warp = [t - p for t, p in zip(totals, preps)]
        print(f"| prep of one KV head, {args.keys} keys | {model} | {statistics.median(preps):.2f} | "
              f"{', '.join(f'{t:.2f}' for t in preps)} |")
        print(f"| one warp, {args.keys} keys, d=128, hot share {share:.3f} | {model} | {statistics.median(warp):.2f} | "
              f"{', '.join(f'{t:.2f}' for t in warp)} |")
    nq, nk = (int(x) for x in args.dump.split("x"))
    dump = synthetic(nq, nk, 24, 8, 128, seed=2, q_offset=nk - nq)
    t0 = time.perf_counter()
    res = attention(dump.q, dump.k, dump.v, dump.q_offset, Config())
    dt = time.perf_counter() - t0
    print(f"| full dump {nq}x{nk}, 24/8 heads | sm90 | {dt:.2f} | 1 (hot share {res.hot_share:.3f}) |")
    print(f"# peak RSS {peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
