"""``apa worst``: the lowest-cosine pairs of the dumps, each with the seed's per-pair diagnosis."""

from __future__ import annotations

import numpy as np

from ...config import Config
from ..engine import CpuEngine, Engine
from ..report import emit, table
from ..scan import Job, PairDiagnostics, Pairs, Scan, check_count, engine_for, evaluate, pair_diagnostics
from . import common

HELP = "the worst pairs with hot tiles, cold mass and cold-output norm"
_COLUMNS = """columns:
  cos, rel_l2       cosine and relative L2 error of the output against float64 attention
  hot_tiles, tiles  tiles of the pair's warp recomputed exactly in pass 2, and all its tiles
  cold_mass_fp4     share of the row's softmax mass left cold, as pass 1's FP4 sums estimate it
  cold_mass_f64     the same share in float64
  cold_out_rel      |cold part of the float64 output| / |float64 output|
  max_qk, max_o16   FP16 headroom of pass 2, float64 estimates (see apa headroom --help)
  overflow          the first stage whose output went non-finite, if any (cos and rel_l2 are then NaN)
"""
EPILOG = common.study_epilog(_COLUMNS)


def worst_jobs(jobs: list[Job], cfg: Config, n: int, engine: Engine, *,
               progress=None) -> tuple[list[Scan], list[tuple[int, PairDiagnostics]]]:
    """The ``n`` lowest-cosine pairs over all jobs (non-finite first), each with its job's index."""
    check_count(n)
    scans = [s for (s,) in evaluate(jobs, [cfg], engine, progress=progress)]
    keys = np.concatenate([np.where(s.finite, s.cos, -np.inf) for s in scans])
    owner = np.concatenate([np.full(len(s.pairs), j) for j, s in enumerate(scans)])
    local = np.concatenate([np.arange(len(s.pairs)) for s in scans])
    chosen = np.argsort(keys, kind="stable")[:n]
    picked = {j: local[chosen[owner[chosen] == j]] for j in np.unique(owner[chosen]).tolist()}
    sub = [Job(jobs[j].dump, scans[j].pairs.take(idx), jobs[j].name) for j, idx in picked.items()]
    # the diagnostics read §10's trace records: the emulator's, of an engine that returns none
    tracer = engine if "trace" in engine.features else CpuEngine()
    traced = dict(zip(picked, (s for (s,) in evaluate(sub, [cfg], tracer, trace=True))))
    return scans, [(int(owner[c]), pair_diagnostics(jobs[owner[c]].dump, scans[owner[c]], int(local[c]),
                                                    traced[owner[c]].result)) for c in chosen]


def worst(dump, cfg: Config, n: int, *, pairs: Pairs | None = None, backend="auto", workers=1,
          progress=None) -> tuple[Scan, list[PairDiagnostics]]:
    jobs = [Job.of(dump, pairs)]
    scans, diags = worst_jobs(jobs, cfg, n, engine_for(jobs, [cfg], backend, workers), progress=progress)
    return scans[0], [d for _, d in diags]


def add_arguments(p) -> None:
    common.study_options(p)
    p.add_argument("-n", type=common.count, default=20, help="how many pairs to show, lowest cosine first")
    common.eps(p)
    common.selection(p)


def run(args) -> None:
    jobs, cfg, engine, (_, diags) = common.run_study(args, lambda jobs, cfg, engine, progress: worst_jobs(
        jobs, cfg, args.n, engine, progress=progress))
    many = len(jobs) > 1
    records = [dict(dump=jobs[j].name, **d.to_json()) if many else d.to_json() for j, d in diags]
    cols = ["dump"] * many + ["row", "head", "cos", "rel_l2", "hot_tiles", "tiles", "cold_mass_fp4", "cold_mass_f64",
                              "cold_out_rel", "max_qk", "max_o16", "overflow"]
    emit(args.json, common.payload(jobs, cfg, engine, worst=records),
         [table(f"{common.named(jobs, 'apa worst')}: {len(diags)} lowest-cosine pairs", cols,
                [[r[c] for c in cols] for r in records])])
