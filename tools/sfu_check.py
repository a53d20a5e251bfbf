"""Do the special-function models (docs/numerics.md §13, apa_emu/sfu.py) hold on this GPU?

Checks each modelled instruction against the hardware: every binary32 input of ex2.approx(.ftz).f32 and
rcp.approx(.ftz).f32 (2³² each), every binary16 input of ex2.approx.f16 and .f16x2, and div.full.f32 on
its special classes and ``--pairs`` random pairs. It prints, per instruction, the inputs checked, how
many results differ and the first differing inputs, and exits 1 if any differs. Nothing is assumed equal.

``--measure OUT.npz`` first reads the tables from this GPU and writes them to OUT.npz, which the check
then uses (and which ``APA_SFU_TABLES=OUT.npz`` hands to the emulator); without it the check uses the
package's tables (measured on an H200). A GPU that differs from the package's tables gets its own that way.

    python tools/sfu_check.py                          # the package's tables, 2³⁰ division pairs
    python tools/sfu_check.py --measure my_gpu.npz     # this GPU's tables, then the check on them
    python tools/sfu_check.py --only div.full.f32 --pairs 100000000
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np

from apa_emu import sfu
from apa_emu.study.report import progress_bar
from apa_gpu import sfu as gpu_sfu

UNARY = tuple(sfu.UNARY)
ALL = (*UNARY, "ex2.approx.f16", "div.full.f32")


def _tables(measure: Path | None) -> sfu.Tables:
    if measure is None:
        return sfu.tables()
    t = gpu_sfu.measure()
    np.savez_compressed(measure, **sfu.pack(t), **_about())
    print(f"sfu_check: measured tables written to {measure}")
    return t


def _about() -> dict:
    """Which GPU and driver, and when: stored beside every measurement."""
    import cupy

    rt = cupy.cuda.runtime
    return dict(device=np.str_(rt.getDeviceProperties(rt.getDevice())["name"].decode()),
                driver=np.int64(rt.driverGetVersion()), date=np.str_(datetime.date.today().isoformat()))


def _run(name: str, t: sfu.Tables, pairs: int) -> list:
    if name == "ex2.approx.f16":
        return gpu_sfu.check_f16(t)
    total = (pairs + gpu_sfu.special_operands().size ** 2) if name == "div.full.f32" else 1 << 32
    with progress_bar(True, name, wait="compiling the models") as update:
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if update:
                update(done[0], total)

        if name == "div.full.f32":
            return [gpu_sfu.check_div(t, pairs, progress=step)]
        return [gpu_sfu.check_unary(name, t, progress=step)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", type=Path, metavar="OUT.npz", help="read the tables from this GPU first")
    ap.add_argument("--only", nargs="+", choices=ALL, default=ALL, metavar="INSTRUCTION",
                    help=f"the instructions to check, of: {', '.join(ALL)}")
    ap.add_argument("--pairs", type=int, default=1 << 30, help="random division pairs (default 2³⁰)")
    ap.add_argument("--samples", type=Path, metavar="OUT.npz",
                    help="also store this GPU's results on the hard cases and random inputs the tests keep")
    args = ap.parse_args(argv)
    if args.pairs < 0:
        ap.error(f"--pairs {args.pairs}: expected a count ≥ 0")
    for path in (args.measure, args.samples):
        if path is not None and path.exists():
            raise SystemExit(f"sfu_check: {path} exists; name a new file (nothing is overwritten)")
    t = _tables(args.measure)
    if args.samples:
        np.savez_compressed(args.samples, **gpu_sfu.samples(), **_about())
        print(f"sfu_check: hardware samples written to {args.samples}")
    bad = 0
    for name in args.only:
        t0 = time.perf_counter()
        for rep in _run(name, t, args.pairs):
            first, *more = rep.lines()
            print(f"{first} ({time.perf_counter() - t0:.0f} s)", *more, sep="\n", flush=True)
            bad += rep.differing
    print(f"sfu_check: {'PASS' if not bad else 'FAIL'}: {bad:,} results differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
