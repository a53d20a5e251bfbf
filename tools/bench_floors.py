"""The floors of the two passes, measured: copies of cuda/ with a stage of the spec left out, timed
against the kernel in one run (tools/bench_ab.py), with cuDNN called directly on the same inputs.

    python tools/bench_floors.py --out docs/profiles/floors.md     # on the GPU machine, ~2 min

Each variant computes a wrong result on purpose; only its times mean anything, and only for the
pass it changes (the others' times follow from its wrong hot masks). What a variant leaves out:

  pass1-skeleton    pass 1 without §7.2-7.9: the ring, the turns and both wgmma chains, P̂ = f16(s)
  pass1-no-rounding pass 1 without §7.5's exp2 and E2M1 rounding, P̂ = f16(y) ⊗ scale; every
                    decision of §7.2-7.4 and §7.6-7.9 kept
  pass2-skeleton    pass 2 without §8.2-8.4 (no frame, exp2 or row sum), P16 = f16(x); the ring,
                    both MMA chains and the merge kept

A variant is made by literal edits of this checkout's cuda/; when the kernel's text moves on, the
edit that no longer applies is named and the run stops before anything is built.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

import bench_ab  # a sibling: `python tools/bench_floors.py` puts tools/ first on sys.path

ROOT = Path(__file__).resolve().parents[1]

_F16_OF_S = """{
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                pa[kk][0] = f16x2(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = f16x2(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
        }
        mma_turn(j + 1);"""
_F16_OF_X = """    uint32_t pa[4][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        pa[nt >> 1][(nt & 1) * 2 + 0] = f16x2(x[nt][0], x[nt][1]);
        pa[nt >> 1][(nt & 1) * 2 + 1] = f16x2(x[nt][2], x[nt][3]);
    }
"""
# name -> edits (file, old, new); old = (start, end) replaces start up to, not including, end.
VARIANTS = {
    "pass1-skeleton": [
        ("pass1_cta.cuh", "if (wr.warp_active && t >= wr.Fw && t <= wr.Tw)\n",
         "if (false && wr.warp_active && t >= wr.Fw && t <= wr.Tw)\n"),
        ("pass1_cta.cuh", """p1_zero(pa);
        mma_turn(j + 1);""", _F16_OF_S),
    ],
    "pass1-no-rounding": [
        ("pass1.cuh",
         "ph[j][e] = QUANT ? e2m1_exp2s_scaled(y, hi ? sc_hi : sc_lo) : fmul(exp2x(y), hi ? sc_hi : sc_lo);",
         "ph[j][e] = fmul(y, hi ? sc_hi : sc_lo);"),
        ("pass1.cuh", """pa[gi][2 * j] = e2m1_exp2_fast_x2(__fmaf_rn(sj[0], cq_lo, bias_lo), __fmaf_rn(sj[1], cq_lo, bias_lo),
                                                  sc2_lo);""",
         "pa[gi][2 * j] = hmul2(f16x2(__fmaf_rn(sj[0], cq_lo, bias_lo), __fmaf_rn(sj[1], cq_lo, bias_lo)), sc2_lo);"),
        ("pass1.cuh", """pa[gi][2 * j + 1] = e2m1_exp2_fast_x2(__fmaf_rn(sj[2], cq_hi, bias_hi),
                                                      __fmaf_rn(sj[3], cq_hi, bias_hi), sc2_hi);""",
         "pa[gi][2 * j + 1] = hmul2(f16x2(__fmaf_rn(sj[2], cq_hi, bias_hi), __fmaf_rn(sj[3], cq_hi, bias_hi)), sc2_hi);"),
    ],
    "pass2-skeleton": [
        ("pass2.cuh", ("    float ms_lo, ms_hi;\n    p2_frame(", "    p2_pv(st, pa, Vs);"), _F16_OF_X),
    ],
}
# Each pass and the variant whose time is its floor.
SKELETONS = {"pass1": "pass1-skeleton", "pass2": "pass2-skeleton"}


def make_variants(src: Path, dest: Path) -> dict[str, Path]:
    """Each variant as a copy of src (a cuda/) under dest, edited. SystemExit naming the first edit
    that does not apply exactly once."""
    out = {}
    for name, edits in VARIANTS.items():
        d = dest / name / "cuda"
        shutil.copytree(src, d)
        for fn, old, new in edits:
            text = (d / fn).read_text()
            if isinstance(old, tuple):
                start, end = old
                whole = text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
                old = text[text.index(start):text.index(end)] if whole else None
            if old is None or text.count(old) != 1:
                raise SystemExit(f"bench_floors: cuda/{fn} has changed: the {name} edit no longer applies "
                                 f"(update VARIANTS in tools/bench_floors.py)")
            (d / fn).write_text(text.replace(old, new))
        out[name] = d
    return out


def cudnn_ms(work: Path, family: str, reps: int) -> float | None:
    """cuDNN called directly on bench_ab's inputs of family (tools/bench_gpu.py), or None without it."""
    try:
        import cudnn  # noqa: F401
        from bench_gpu import bench_cudnn
    except ImportError:
        return None
    from apa_emu.config import Config

    z = np.load(work / f"inputs_{family}.npz")
    return bench_cudnn(z["q"], z["k"], z["v"], Config().softmax_scale(z["q"].shape[2]), reps)[0]


def floors(args, names: list[str], times: dict, cudnn: dict) -> list[str]:
    """The table of each pass against its skeleton, the sums, and their ratios to cuDNN."""
    def mean(name, family, mode, kernel):
        runs = [t[kernel] for t in times[(names.index(name), family, mode)] if kernel in t]
        return float(np.mean(runs)) if runs else float("nan")

    lines = ["", "Floors: per launch, mean of the rounds, ms; 'skeletons' = prep + both passes' skeletons.", "",
             "| family | mode | prep | pass 1 | pass 1 skeleton | pass 1 without §7.5's rounding | pass 2 "
             "| pass 2 skeleton | prep + passes | skeletons | cuDNN direct | prep + passes / cuDNN | skeletons / cuDNN |",
             "|---|---|" + "---:|" * 11]
    for family in args.family:
        for mode in args.modes:
            prep = mean("kernel", family, mode, "prep")
            p1, p2 = (mean("kernel", family, mode, f"apa_{p}") for p in ("pass1", "pass2"))
            s1, s2 = (mean(SKELETONS[p], family, mode, f"apa_{p}") for p in ("pass1", "pass2"))
            nr = mean("pass1-no-rounding", family, mode, "apa_pass1")
            whole, skel, cu = prep + p1 + p2, prep + s1 + s2, cudnn.get(family)
            ratio = (lambda x: f"{x / cu:.2f}×") if cu else (lambda x: "—")
            lines.append(f"| {family} | {mode} | {prep:.3f} | {p1:.3f} | {s1:.3f} | {nr:.3f} | {p2:.3f} | {s2:.3f} "
                         f"| {whole:.3f} | {skel:.3f} | {f'{cu:.3f}' if cu else '—'} | {ratio(whole)} | {ratio(skel)} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_ab.add_run_arguments(ap)
    ap.add_argument("--no-cudnn", action="store_true", help="skip cuDNN called directly (cudnn-frontend)")
    args = ap.parse_args(argv)
    bench_ab.check_run_arguments(ap, args)

    from apa_emu.study.synth import FAMILIES, synthetic_preset

    with tempfile.TemporaryDirectory(prefix="bench_floors_") as tmp:
        work = Path(tmp)
        variants = make_variants(ROOT / "cuda", work / "variants")
        names = ["kernel", *variants]
        args.sources = [str(ROOT / "cuda"), *map(str, variants.values())]
        times = bench_ab.collect(args, work, FAMILIES, synthetic_preset)
        timed = any(t for runs in times.values() for t in runs)
        lines = bench_ab.report(args, work, times)
        if timed:
            cudnn = {} if args.no_cudnn else {f: ms for f in args.family if (ms := cudnn_ms(work, f, args.reps))}
            lines += floors(args, names, times, cudnn)
    bench_ab.emit([ln.replace(str(work / "variants") + "/", "").replace(str(ROOT) + "/", "") for ln in lines],
                  args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
