"""Time the ``apa`` studies on the GPU engine end to end against their time targets, beside the CPU engine.

On a synthetic Llama-3.2-3B-shaped dump (24/8 heads, d = 128, ``--rows`` × ``--keys``, default
2048 × 122880, written to a temporary folder) it runs ``apa_emu.study.cli.main`` in this process,
tables to a file, each command end to end (read and check the dump, prep, kernel, float64 reference,
metrics, table, plot):

* ``apa scan`` over every pair (target ≤ 10 s);
* ``apa attribute`` over every pair with the 14 kernel variants (13 variants and "none";
  ``--cpu-worst 0`` leaves out the emulator-only MMA models) (target ≤ 60 s);
* ``apa sweep`` over 6 ε values (target ≤ 30 s).

A small warm-up run first builds the kernel and CuPy's kernels, and loads Numba's cache. Beside each
time, the CPU engine's for the same work, **estimated**: one KV head's scan is timed on ``--cpu-warps``
and twice as many warps (one core), the difference gives the cost of a warp and the rest the fixed
cost of a KV head (prep), scaled to every warp of every KV head, times the number of configs. The
same pairs run on the GPU engine as a self-check: outputs bitwise, cosines within 1e-12 (exit 1 if not).

    python tools/bench_study.py                        # the default table, printed as markdown
    python tools/bench_study.py --out bench.md         # and written to a file
    python tools/bench_study.py --keys 32768 --rows 512 --cpu-warps 2   # a quicker run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from apa_emu.config import Config
from apa_emu.geometry import ROWS
from apa_emu.study import cli, engine, scan
from apa_emu.study.dump import read_dump, write_dump
from apa_emu.study.synth import synthetic_preset
from apa_gpu.engine import GpuEngine

EPS = ("0.001", "0.002", "0.005", "0.01", "0.02", "0.05")


def _apa(argv: list[str], log: Path) -> float:
    """Seconds of one ``apa`` command in this process, its tables appended to ``log``."""
    with open(log, "a") as f, contextlib.redirect_stdout(f):
        t0 = time.perf_counter()
        rc = cli.main(argv)
        seconds = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"bench_study: apa {' '.join(argv)} exited {rc} (tables in {log})")
    return seconds


def _warp_job(dump, hk: int, warps: int) -> scan.Job:
    """The pairs of the first ``warps`` warps of KV head ``hk`` (§6.2 packing)."""
    packed = np.arange(min(warps * ROWS, dump.n * dump.group))
    return scan.Job(dump, scan.Pairs(packed // dump.group, hk * dump.group + packed % dump.group), "warps")


def _cpu_estimate(dump, warps: int, gpu) -> tuple[float, str]:
    """CPU seconds of a whole-dump scan, from one KV head on ``warps`` and 2 × ``warps`` warps; the
    GPU engine reruns the larger set as a self-check."""
    cpu = engine.CpuEngine(1)
    times, scans = [], []
    for w in (warps, 2 * warps):
        t0 = time.perf_counter()
        scans.append(scan.scan_jobs([_warp_job(dump, 0, w)], Config(), cpu)[0])
        times.append(time.perf_counter() - t0)
    per_warp = (times[1] - times[0]) / warps
    fixed = times[0] - warps * per_warp
    nw = -(-dump.n * dump.group // ROWS)
    g = scan.scan_jobs([_warp_job(dump, 0, 2 * warps)], Config(), gpu)[0]
    dcos = float(np.nanmax(np.abs(g.cos - scans[1].cos)))
    if g.out.tobytes() != scans[1].out.tobytes() or not dcos <= 1e-12:
        sys.exit(f"bench_study: self-check failed: GPU and CPU engines differ (outputs equal: "
                 f"{g.out.tobytes() == scans[1].out.tobytes()}, max |Δcos| {dcos:.3g})")
    how = (f"one core; one KV head timed on {warps} and {2 * warps} warps ({times[0]:.1f} s, {times[1]:.1f} s): "
           f"{per_warp:.2f} s a warp, {fixed:.1f} s fixed, scaled to {dump.nkv} KV heads × {nw} warps. Self-check "
           f"on those {len(g.pairs)} pairs: GPU outputs bitwise the CPU's, max |Δcos| {dcos:.1e}")
    return dump.nkv * (fixed + nw * per_warp), how


def _machine() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    return (f"{props['name'].decode()} ({props['totalGlobalMem'] / 2**30:.0f} GiB), CuPy {cupy.__version__}, "
            f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, NumPy {np.__version__}, Python "
            f"{sys.version.split()[0]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048, help="query rows of the dump")
    ap.add_argument("--keys", type=int, default=122880, help="keys of the dump")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic dump")
    ap.add_argument("--cpu-warps", type=int, default=4, help="warps of the CPU estimate's smaller run")
    ap.add_argument("--devices", default="", help="GPUs for --devices of every command (e.g. 0,1)")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    why = GpuEngine.missing()
    if why:
        print(f"bench_study: needs the GPU engine: {why}", file=sys.stderr)
        return 2
    devices = ["--devices", args.devices] if args.devices else []
    with tempfile.TemporaryDirectory(prefix="apa_bench_") as tmp:
        tmp = Path(tmp)
        log = tmp / "tables.txt"
        t0 = time.perf_counter()
        d = synthetic_preset("llama-3.2-3b", args.rows, args.keys, seed=args.seed)
        path = write_dump(tmp / f"llama_{args.rows}x{args.keys}.apadump", d.q, d.k, d.v, d.q_offset)
        del d
        made = time.perf_counter() - t0
        small = synthetic_preset("llama-3.2-3b", 64, 2048, seed=1)
        warm = str(write_dump(tmp / "warm.apadump", small.q, small.k, small.v, small.q_offset))
        for command, *options in (["scan"], ["attribute", "--worst", "4", "--plot", ""],
                                  ["sweep", "--eps", "0.01", "--plot", ""]):
            _apa([command, warm, "--backend", "gpu", *options], log)
        _apa(["scan", warm, "--backend", "cpu", "--rows", "0:8"], log)
        p = str(path)
        runs = [
            ("`apa scan`, every pair", 10, 1, _apa(["scan", p, "--backend", "gpu", *devices], log)),
            ("`apa attribute`, every pair, 14 kernel variants", 60, 14,
             _apa(["attribute", p, "--backend", "gpu", "--cpu-worst", "0", "--plot", str(tmp / "heat.png"), *devices],
                  log)),
            (f"`apa sweep`, every pair, {len(EPS)} ε", 30, len(EPS),
             _apa(["sweep", p, "--backend", "gpu", "--eps", *EPS, "--plot", str(tmp / "sweep.png"), *devices], log)),
        ]
        cpu_scan, how = _cpu_estimate(read_dump(path), args.cpu_warps, GpuEngine())
        dump = read_dump(path, check_finite=False)
        title = (f"{args.rows} × {args.keys} keys, Llama-3.2-3B-shaped ({dump.nh}/{dump.nkv} heads, d = {dump.hd}, "
                 f"{dump.nbytes / 2**30:.2f} GiB, {dump.n * dump.nh} pairs)")
    lines = [f"**Machine:** {_machine()}. **Date:** {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
             f"**Command:** `python tools/bench_study.py {' '.join(argv if argv is not None else sys.argv[1:])}`. "
             f"Dump: {title}, made in {made:.0f} s (not timed), in the page cache.", "",
             "| study | GPU engine, end to end, s | target, s | met | CPU engine, s (estimated) | speed-up |",
             "|---|---:|---:|:---:|---:|---:|"]
    for name, target, configs, seconds in runs:
        cpu = configs * cpu_scan
        hours = f" ({cpu / 3600:.1f} h)" if cpu >= 3600 else ""
        lines.append(f"| {name} | {seconds:.1f} | ≤ {target} | {'yes' if seconds <= target else 'NO'} | "
                     f"{cpu:,.0f}{hours} | {cpu / seconds:,.0f}× |")
    lines += ["", f"CPU engine estimate: {how}; attribute = 14 × scan, sweep = {len(EPS)} × scan."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
