"""``apa scan``: every selected pair against float64 attention, the error certificate (§9.7) and the
error estimate (§9.8).

The study itself, ``scan_jobs`` and its ``Scan``, lives in the library's ``scan``: every other study
builds on it."""

from __future__ import annotations

from ..report import emit, table
from ..scan import Scan, scan_jobs
from . import common

HELP = "every (row, head) pair vs float64: cosines, relative L2, hot share, the error certificate and estimate"
COLUMNS = {
    **common.shared_columns("dump"),
    "pairs": "the pairs measured (in the table of one dump: the finite ones, which the cosines cover; in the "
             "histogram: those in the bin)",
    **common.shared_columns("hot_share", "pooled_cos", "mean_cos", "min_cos", "below_0_9", "below_0_99"),
    "below_0": "pairs whose cosine is negative",
    "rel_l2_mean": "mean over the pairs of |out − float64 attention| / |float64 attention|, the relative L2 error",
    "rel_l2_p99": "its 99th percentile",
    "rel_l2_max": "its largest value",
    "max_abs_err": "the largest |out − float64 attention| of one output element",
    "cold_mass_f64_mean": "mean share of a pair's softmax mass in its cold tiles (those left to pass 1's FP4), "
                          "in float64",
    "cold_mass_f64_max": "its largest value",
    "cold_out_rel_max": "largest |cold tiles' part of the float64 output| / |float64 output|",
    **common.shared_columns("nonfinite"),
    "finite pairs": "shown instead of the statistics when no pair's output is finite",
    "non-finite pairs": "as nonfinite, out of all the pairs selected",
    "first non-finite (row, head)": "the first few of those pairs",
    "bin": "a range of the pairs' cosines, [low, high); non-finite: the pairs with no cosine",
}
CERTIFICATE = {
    "coverage": "share of the pairs whose bound is at least the error: anything below 1 is a bug of the bound "
                "or of the engine",
    **common.shared_columns("violations"),
    "infinite": "pairs whose bound is +inf: pass 2's FP16 scores could overflow (§8.7)",
    "bound_over_err_min": "bound / error, the least over the pairs with an error (at least 1)",
    "bound_over_err_median": "its median (the larger, the looser the bound)",
    "bound_over_ref_median": "bound / |float64 attention|, median: the bound as a relative error",
    "first violations (row, head)": "the first few pairs of violations",
    "worst20_found": "how many of the 20 lowest-cosine pairs are among the 20 that err_bound / |out| ranks worst "
                     "(apa worst --by bound)",
}
ESTIMATE = {
    "coverage": "share of the pairs whose estimate is at least the error (§9.8 aims at about 0.999)",
    "under": "pairs whose estimate is below the error",
    "est_over_err_median": "estimate / error, median over the pairs with an error (§9.8 aims at about 2)",
    "est_over_err_max": "its largest value",
    "over_30": "pairs whose estimate is more than 30 times their error",
    "est_over_ref_median": "estimate / |float64 attention|, median: the estimate as a relative error",
    "worst20_found": "how many of the 20 lowest-cosine pairs are among the 20 that err_est / |out| ranks worst "
                     "(apa worst --by est)",
}
EPILOG = common.study_epilog(
    common.columns_epilog(COLUMNS) + "\n\n"
    + common.columns_epilog(CERTIFICATE, "certificate (docs/numerics.md §9.7), over the finite pairs: err_bound, "
                            "the engine's upper bound of |out − exact| of each pair, against its measured error "
                            "|out − float64 attention|") + "\n\n"
    + common.columns_epilog(ESTIMATE, "estimate (docs/numerics.md §9.8), over the finite pairs: err_est, the "
                            "engine's estimate of |out − exact| of each pair (two standard deviations of a model "
                            "of independent rounding errors), against the measured error"))

_CERT_TITLE = "certificate err_bound (§9.7)"
_CERT = ["coverage", "violations", "infinite", "bound_over_err_min", "bound_over_err_median", "bound_over_ref_median",
         "worst20_found"]
_EST_TITLE = "estimate err_est (§9.8)"
_EST = list(ESTIMATE)


def add_arguments(p) -> None:
    common.study_options(p)
    common.eps(p)
    common.selection(p)


def run(args) -> None:
    jobs, cfg, engine, scans = common.run_study(args, scan_jobs, pooled=True)
    title = f"{common.named(jobs, 'apa scan')} (eps={cfg.eps}, {engine.name})"
    if len(jobs) > 1:
        _pooled(args, jobs, cfg, engine, scans, title)
    else:
        _one(args, jobs, cfg, engine, scans[0], title)


def _pooled(args, jobs, cfg, engine, scans, title) -> None:
    """One row per dump and a row of all their pairs."""
    pooled = Scan.pooled(scans)
    cols = ["dump", "pairs", "hot_share", "pooled_cos", "mean_cos", "min_cos", "below_0_99", "rel_l2_max",
            "max_abs_err", "nonfinite"]
    named = [*((j.name, s) for j, s in zip(jobs, scans)), ("pooled", pooled)]
    rows = [_scan_row(name, s) for name, s in named]
    cert = [[name, *(s.certificate[c] for c in _CERT)] for name, s in named]
    est = [[name, *(s.estimate[c] for c in _EST)] for name, s in named if s.estimate]
    emit(args.json, common.payload(args, jobs, cfg, engine, per_dump=common.per_dump(jobs, (s.to_json() for s in scans)),
                                   pooled=pooled.to_json()),
         [table(title, cols, rows), table(_CERT_TITLE, ["dump", *_CERT], cert),
          *([table(_EST_TITLE, ["dump", *_EST], est)] if est else []),
          table("per-pair cosine, pooled", ["bin", "pairs"], pooled.histogram)])


def _one(args, jobs, cfg, engine, scan: Scan, title) -> None:
    """The metrics of one dump, named, and its non-finite pairs and certificate violations."""
    report = scan.to_json()
    bad = report["nonfinite"]
    rows = list(scan.summary.as_dict().items()) if scan.summary else [("finite pairs", 0)]
    rows += list(report["errors"].items())
    if bad["count"]:
        rows += [("non-finite pairs", f"{bad['count']} of {report['pairs']}"),
                 ("first non-finite (row, head)", _pair_text(bad["first"]))]
    title += ": cosines over the finite pairs" if bad["count"] else ""
    cert = report["certificate"]
    cert_rows = [(c, cert[c]) for c in _CERT]
    if cert["violations"]:
        cert_rows.append(("first violations (row, head)", _pair_text(cert["first_violations"])))
    est = report["estimate"]
    emit(args.json, common.payload(args, jobs, cfg, engine, **report),
         [table(title, ["metric", "value"], rows), table(_CERT_TITLE, ["metric", "value"], cert_rows),
          *([table(_EST_TITLE, ["metric", "value"], [(c, est[c]) for c in _EST])] if est else []),
          table("per-pair cosine", ["bin", "pairs"], scan.histogram)])


def _pair_text(pairs) -> str:
    return " ".join(f"({r}, {h})" for r, h in pairs)


def _scan_row(name, scan: Scan) -> list:
    s = scan.summary
    stats = [s.pooled_cos, s.mean_cos, s.min_cos, s.below_0_99, s.rel_l2_max] if s else [None] * 5
    return [name, len(scan.pairs), scan.hot_share, *stats, scan.errors()["max_abs_err"], int((~scan.finite).sum())]
