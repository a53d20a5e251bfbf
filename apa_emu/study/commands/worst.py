"""``apa worst``: the worst pairs of the dumps, each with the seed's per-pair diagnosis: by cosine
against float64 attention, or by the kernel's own err_est or err_bound, as a user without the
reference would rank them."""

from __future__ import annotations

import numpy as np

from ...config import Config
from ..engine import CpuEngine, Engine
from ..report import emit, table
from ..scan import Job, PairDiagnostics, Pairs, Scan, check_count, engine_for, evaluate, pair_diagnostics
from . import common

HELP = "the worst pairs with hot tiles, cold mass and cold-output norm"
BY = {"cos": "the lowest cosine against float64 attention",
      "est": "the largest err_est / |out| (§9.8), no reference needed",
      "bound": "the largest err_bound / |out| (§9.7), no reference needed"}
_COLUMNS = """columns:
  cos, rel_l2       cosine and relative L2 error of the output against float64 attention
  err_est, err_bound  the engine's estimate and bound of |out − exact| (§9.8, §9.7), over |out|
  true_worst_found  (--by est or bound) how many of the pairs shown are among as many lowest-cosine ones
  hot_tiles, tiles  tiles of the pair's warp recomputed exactly in pass 2, and all its tiles
  cold_mass_fp4     share of the row's softmax mass left cold, as pass 1's FP4 sums estimate it
  cold_mass_f64     the same share in float64
  cold_out_rel      |cold part of the float64 output| / |float64 output|
  max_qk, max_o16   FP16 headroom of pass 2, float64 estimates (see apa headroom --help)
  overflow          the first stage whose output went non-finite, if any (cos and rel_l2 are then NaN)
"""
EPILOG = common.study_epilog(_COLUMNS)


def worst_jobs(jobs: list[Job], cfg: Config, n: int, engine: Engine, *, by: str = "cos",
               progress=None, where=None) -> tuple[list[Scan], list[tuple[int, PairDiagnostics]], int]:
    """The ``n`` worst pairs over all jobs by ``by`` (``Scan.rank_key``; non-finite first), each with
    its job's index, and how many of them are among the ``n`` lowest-cosine pairs; every unit, the
    traced ones too, runs ``where`` (scan.evaluate)."""
    check_count(n)
    scans = [s for (s,) in evaluate(jobs, [cfg], engine, progress=progress, where=where)]
    if by != "cos" and not any(np.isfinite(s.predicted(by)).any() for s in scans):
        raise ValueError(f"--by {by}: engine {engine.name} gives no pair a finite err_{by} / |out| (it returns "
                         f"no err_{by}, or every |out| is 0): rank by cos")
    owner = np.concatenate([np.full(len(s.pairs), j) for j, s in enumerate(scans)])
    local = np.concatenate([np.arange(len(s.pairs)) for s in scans])
    ranked = {b: np.argsort(np.concatenate([s.rank_key(b) for s in scans]), kind="stable")[:n] for b in {by, "cos"}}
    chosen = ranked[by]
    picked = {j: local[chosen[owner[chosen] == j]] for j in np.unique(owner[chosen]).tolist()}
    sub = [Job(jobs[j].dump, scans[j].pairs.take(idx), jobs[j].name) for j, idx in picked.items()]
    # the diagnostics read §10's trace records: the emulator's, of an engine that returns none
    tracer = engine if "trace" in engine.features else CpuEngine()
    traced = dict(zip(picked, (s for (s,) in evaluate(sub, [cfg], tracer, trace=True, where=where))))
    return scans, [(int(owner[c]), pair_diagnostics(jobs[owner[c]].dump, scans[owner[c]], int(local[c]),
                                                    traced[owner[c]].result)) for c in chosen], \
        len(set(chosen.tolist()) & set(ranked["cos"].tolist()))


def worst(dump, cfg: Config, n: int, *, pairs: Pairs | None = None, backend="auto", workers=1,
          progress=None) -> tuple[Scan, list[PairDiagnostics]]:
    jobs = [Job.of(dump, pairs)]
    scans, diags, _ = worst_jobs(jobs, cfg, n, engine_for(jobs, [cfg], backend, workers), progress=progress)
    return scans[0], [d for _, d in diags]


def add_arguments(p) -> None:
    common.study_options(p)
    p.add_argument("-n", type=common.count, default=20, help="how many pairs to show, worst first")
    p.add_argument("--by", choices=tuple(BY), default="cos",
                   help="rank by: " + "; ".join(f"{k}, {v}" for k, v in BY.items()) + ". With est or bound, "
                        "pairs with none (an engine that returns none, or |out| = 0) rank last, and a run where no "
                        "pair has a finite one is refused")
    common.eps(p)
    common.selection(p)


def run(args) -> None:
    jobs, cfg, engine, (scans, diags, found) = common.run_study(
        args, lambda jobs, cfg, engine, progress, where: worst_jobs(jobs, cfg, args.n, engine, by=args.by,
                                                                    progress=progress, where=where))
    many = len(jobs) > 1
    records = [dict(dump=jobs[j].name, **d.to_json(), **_predicted(scans[j], d)) if many
               else dict(**d.to_json(), **_predicted(scans[j], d)) for j, d in diags]
    cols = ["dump"] * many + ["row", "head", "cos", "rel_l2", "err_est", "err_bound", "hot_tiles", "tiles",
                              "cold_mass_fp4", "cold_mass_f64", "cold_out_rel", "max_qk", "max_o16", "overflow"]
    extra = {} if args.by == "cos" else dict(by=args.by, true_worst_found=found)
    title = f"{common.named(jobs, 'apa worst')}: {len(diags)} pairs with {BY[args.by]}"
    if extra:
        title += f"; {found} of them among the {len(diags)} lowest-cosine pairs"
    emit(args.json, common.payload(args, jobs, cfg, engine, worst=records, **extra),
         [table(title, cols, [[r[c] for c in cols] for r in records])])


def _predicted(scan: Scan, d: PairDiagnostics) -> dict:
    """The engine's own err_est and err_bound of a pair, over its |out| (the relative errors they predict)."""
    i = np.flatnonzero((scan.pairs.rows == d.row) & (scan.pairs.heads == d.head))[0]
    return {f"err_{by}": float(scan.predicted(by)[i]) for by in ("est", "bound")}
