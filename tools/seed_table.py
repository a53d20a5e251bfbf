"""What each difference from the seed (docs/numerics.md §12) does to accuracy: numerics.md §12's measured
column.

For each dump and ε it runs every pair under our default config, under each §12 toggle set the seed's way
alone, under the whole seed preset (``Config.seed()``) and, as a stand-in for the residue no model here
reproduces, under the preset with ``mma="exact"`` (#1: MMA internals of the RTX 5090 that the ``sm120``
model may miss; exact arithmetic has none of the MMA's roundings, so the gap shows how much those roundings
move at all). It
prints one markdown table per ε: hot share, mean and min cosine against float64 attention, and how many
pairs' cosines moved from ours (an output that changes by even one FP16 bit moves its cosine almost surely).

    python tools/seed_table.py                                  # the built-in dump, ε = 0.005 and pure FP4
    python tools/seed_table.py DUMP ... --eps 0.005 1e9 --workers 2 --backend cpu
"""

from __future__ import annotations

import argparse
import sys

from apa_emu.config import SEED_TOGGLES, Config
from apa_emu.study import scan
from apa_emu.study.commands import sweep
from apa_emu.study.dump import builtin_dump_path, read_dump
from apa_emu.study.engine import select_engine
from apa_emu.study.report import progress_bar

ROWS = {
    "ours (default)": {},
    "#1–2 FP4 MMA, two chained Q MMAs (`mma=sm120`)": dict(mma="sm120"),
    "#3 FMA sites (`fma`)": dict(fma=True),
    "#4 MUFU ex2 (`exp2=fast`, §13's models)": dict(exp2="fast"),
    "#5 sampled K statistics (`k_stats=sampled`)": dict(k_stats="sampled"),
    "#6 f16(v/vg) (`v_f16`)": dict(v_f16=True),
    "#7 padding rows vote (`pad_vote`)": dict(pad_vote=True),
    "#8 interleaved P groups (`p_groups=interleaved`)": dict(p_groups="interleaved"),
    "#9 per-lane pass-2 shift (`p2_shift=lanes`)": dict(p2_shift="lanes"),
    "#11 direct store (`direct_store`)": dict(direct_store=True),
    "the seed preset (all of the above)": SEED_TOGGLES,
    "the preset, `mma=exact` (#1 stand-in)": {**SEED_TOGGLES, "mma": "exact"},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dumps", nargs="*", help="dump files (default: the built-in SmolLM2 dump)")
    ap.add_argument("--eps", type=float, nargs="+", default=[0.005, 1e9])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "auto"))
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args(argv)
    jobs = [scan.Job.of(read_dump(path)) for path in args.dumps or [builtin_dump_path()]]
    configs = [Config(eps=eps).replace(**change) for eps in args.eps for change in ROWS.values()]
    engine = select_engine(args.backend, configs, [job.dump.hd for job in jobs], workers=args.workers)
    with progress_bar(True, "seed table") as bar:
        runs = scan.evaluate(jobs, configs, engine, progress=bar)
    for i, eps in enumerate(args.eps):
        print(f"\n### ε = {eps:g} ({engine.name} engine)\n")
        print("| §12 difference, the seed's way | dump | hot share | mean cos | min cos | pairs moved |")
        print("|---|---|---:|---:|---:|---:|")
        for j, name in enumerate(ROWS):
            for job, per_job in zip(jobs, runs):
                base, s = per_job[i * len(ROWS)], per_job[i * len(ROWS) + j]
                row = sweep.SweepRow.of(s)
                moved = int((s.cos != base.cos).sum())
                print(f"| {name} | {job.name} | {row.hot_share:.4f} | {row.mean_cos:.7f} | {row.min_cos:.6f} | "
                      f"{moved} of {len(s.cos)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
