"""Kernel sources A/B: the per-launch times of two or more copies of ``cuda/`` on the same inputs, run
back to back on one device, and their outputs compared bit for bit.

    python tools/bench_ab.py HEAD cuda                    # the last commit's kernel against the working tree's
    python tools/bench_ab.py old/cuda new/cuda --keys 32768 --family outlier-heavy --rounds 3

A SOURCE is a directory holding a copy of cuda/ (its apa.cu), or a git revision, whose cuda/ is exported
with ``git archive``; the first is the baseline. Each source runs in a process of its own with
APA_GPU_SOURCES pointing at it (the build cache keys on the sources' contents), round by round: base,
new, ..., base, new, ..., so that a drift of the machine shows in every column, and the first kernel
timed in a process is not always the same one. Times are medians of --reps CUDA-event timings of each
launch of ``prep`` (and their sum) and of ``attend`` (tools/bench_gpu.py ``launch_times``), for the exact
and the fast build, on the inputs of tools/bench_gpu.py. Then every variant's output, hot masks, error
bounds, error estimates and per-head statistics are compared with the baseline's, bits and all: a
change meant to be scheduling only must read EQUAL everywhere. The host code is this checkout's: a
source whose parameter structs or exported layout differ from it is refused at its first launch
(apa_gpu.device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODES = ("exact", "fast")
SAVED = ("out", "hot", "bound", "est", "kvstat")


def source_dir(src: str, work: Path) -> Path:
    """The directory of SOURCE: itself when it holds apa.cu, else the cuda/ of a git revision."""
    if (Path(src) / "apa.cu").is_file():
        return Path(src).resolve()
    dest = work / f"rev{len(list(work.glob('rev*')))}"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", src, "cuda"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"bench_ab: {src!r} is neither a directory holding apa.cu nor a git revision of this checkout")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "cuda"


def worker(args) -> None:
    """One source, one round: prep and attend per family and mode, the launches timed (on a GPU; the
    simulator has no clock worth reading, so there it only compares), the results saved."""
    from apa_emu.config import Config
    from apa_emu.geometry import Shape
    from apa_gpu import device
    from apa_gpu.plan import Plan

    be = device.backend()
    if be.name == "cuda":
        from bench_gpu import launch_times
    else:
        launch_times = None
    for family in args.family:
        z = np.load(args.work / f"inputs_{family}.npz")
        (n, H, d), (S, Hkv, _) = z["q"].shape, z["k"].shape
        qd, kd, vd = (be.xp.asarray(z[x])[None] for x in "qkv")
        for mode in args.modes:
            cfg = Config(eps=args.eps) if mode == "exact" else Config(eps=args.eps, exp2="fast")
            plan = Plan(Shape(B=1, n=n, H=H, Hkv=Hkv, S=S, d=d, q_offset=int(z["q_offset"])), cfg)
            if launch_times:  # the timed calls leave the plan prepared and attended
                prep = launch_times(plan, lambda: plan.prep(qd, kd, vd), args.reps)
                times = {"prep": sum(prep.values())} | prep | launch_times(plan, lambda: plan.attend(qd), args.reps)
            else:
                times = {}
                plan.prep(qd, kd, vd)
                plan.attend(qd)
            np.savez(args.work / f"{args.worker}_{family}_{mode}.npz",
                     **{k: be.xp.asnumpy(getattr(plan, k)) for k in SAVED})
            print(json.dumps(dict(family=family, mode=mode, times=times)), flush=True)


def compare(work: Path, base: str, other: str, family: str, mode: str) -> str:
    a, b = (np.load(work / f"{name}_{family}_{mode}.npz") for name in (base, other))
    parts = []
    for key in SAVED:
        x, y = a[key], b[key]
        same = x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))
        bits = f"u{x.dtype.itemsize}"  # elements whose bits differ (a NaN equals its own bits)
        parts.append(f"{key} " + ("EQUAL" if same else f"DIFF ({int((x.view(bits) != y.view(bits)).sum())} elements)"))
    return ", ".join(parts)


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a timed run (inputs, modes, repetitions, report file), shared with bench_floors."""
    ap.add_argument("--keys", type=int, default=122880)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--family", nargs="+", default=["real-like", "outlier-heavy"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--eps", type=float, default=0.005)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the report here (a new file)")


def check_run_arguments(ap: argparse.ArgumentParser, args) -> None:
    """One line through ap.error for a bad option of add_run_arguments."""
    from apa_emu.study.synth import FAMILIES

    bad = [f for f in args.family if f not in FAMILIES]
    if bad:
        ap.error(f"--family {bad[0]}: expected one of {', '.join(FAMILIES)}")
    if min(args.keys, args.rows, args.reps, args.rounds) < 1:
        ap.error("--keys, --rows, --reps and --rounds must be positive")
    if args.out is not None and args.out.exists():
        ap.error(f"--out {args.out}: exists; not overwritten")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="*", help="copies of cuda/ or git revisions; the first is the baseline")
    add_run_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from apa_emu.study.synth import FAMILIES, synthetic_preset

    if len(args.sources) < 2:
        ap.error("give at least two sources: the baseline and a variant")
    check_run_arguments(ap, args)
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as tmp:  # the sources, inputs and results: ~1 GB at 122880 keys
        times = collect(args, Path(tmp), FAMILIES, synthetic_preset)
        lines = report(args, Path(tmp), times)
    emit(lines, args.out)
    return 0


def emit(lines: list[str], out: Path | None) -> None:
    """The report on stdout, and in out when given (checked new by check_run_arguments)."""
    print("\n".join(lines))
    if out is not None:
        out.write_text("\n".join(lines) + "\n")


def collect(args, work: Path, families, synthetic_preset) -> dict:
    """The inputs, then the rounds of every source: {(source index, family, mode): [per-round {kernel: ms}]}
    (empty dicts on the simulator), each source's results saved in work as s{index}_{family}_{mode}.npz."""
    dirs = [source_dir(s, work) for s in args.sources]
    names = [f"s{i}" for i in range(len(dirs))]
    for family in args.family:
        dump = synthetic_preset("llama-3.2-3b", args.rows, args.keys, seed=args.seed, **families[family])
        np.savez(work / f"inputs_{family}.npz", q=dump.q, k=dump.k, v=dump.v, q_offset=dump.q_offset)

    times: dict = {}  # (source index, family, mode) -> [per-round {kernel: ms}]
    flags = ["--work", str(work), "--reps", str(args.reps), "--eps", str(args.eps), "--family", *args.family,
             "--modes", *args.modes]
    for r in range(args.rounds):
        for i, (name, d) in enumerate(zip(names, dirs)):
            print(f"round {r + 1}/{args.rounds}: {args.sources[i]}", file=sys.stderr, flush=True)
            run = subprocess.run([sys.executable, __file__, "--worker", name, *flags], capture_output=True, text=True,
                                 env=dict(os.environ, APA_GPU_SOURCES=str(d)), check=False)
            if run.returncode != 0:
                raise SystemExit(f"bench_ab: {args.sources[i]} failed:\n{run.stderr.strip()}")
            for line in run.stdout.splitlines():
                rec = json.loads(line)
                times.setdefault((i, rec["family"], rec["mode"]), []).append(rec["times"])
    return times


def report(args, work: Path, times: dict) -> list[str]:
    """The report's lines: the times of every kernel and source, then each variant's comparison."""
    n = len(args.sources)
    head = " | ".join(f"`{s}`" for s in args.sources)
    timed = any(t for runs in times.values() for t in runs)
    lines = [f"Kernel sources A/B: {args.rows} rows x {args.keys} keys, eps = {args.eps}, seed {args.seed}; " + (
        f"per launch, median of {args.reps}, ms, each round's in order (the change against the baseline's mean)."
        if timed else "no times (the simulator)."), ""]
    if timed:
        lines += [f"| family | mode | kernel | {head} |", "|---|---|---|" + "---:|" * n]
    for family in args.family:
        for mode in args.modes:
            kernels = dict.fromkeys(k for i in range(n) for t in times[(i, family, mode)] for k in t)
            for kernel in kernels:  # a kernel that a source does not launch reads "—"
                cells = []
                for i in range(n):
                    runs = [t[kernel] for t in times[(i, family, mode)] if kernel in t]
                    cell = " / ".join(f"{t:.3f}" for t in runs) or "—"
                    base = [t[kernel] for t in times[(0, family, mode)] if kernel in t]
                    if i and runs and base:
                        cell += f" ({100 * (np.mean(runs) / np.mean(base) - 1):+.1f} %)"
                    cells.append(cell)
                lines.append(f"| {family} | {mode} | {kernel.removeprefix('apa_')} | " + " | ".join(cells) + " |")
    lines += [""] * timed + ["Outputs, hot masks, error bounds and estimates, and kvstat against the baseline's, bits:", ""]
    for i in range(1, n):
        for family in args.family:
            for mode in args.modes:
                lines.append(f"* `{args.sources[i]}`, {family}, {mode}: {compare(work, 's0', f's{i}', family, mode)}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
