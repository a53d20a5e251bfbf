"""``apa sweep``: the accuracy-cost frontier, one run per ε (and per hot test, --hot-tests): hot share
and pass-2 tiles beside the cosines."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ...config import CHOICES, Config
from ..engine import Engine
from ..plots import pyplot, save
from ..report import emit, say, table
from ..scan import Job, Pairs, Scan, cos_stats, engine_for, evaluate
from . import common

HELP = "hot share and cosines per ε"
COLUMNS = {
    "eps": "the run's ε (< 0: every tile exact; 1e9: pure FP4)",
    "hot_test": "the run's hot test (docs/numerics.md §7.7; shown with several --hot-tests)",
    **common.shared_columns("dump", "hot_share"),
    "pass2_tiles": "key tiles pass 2 recomputed, over the warps holding the pairs (hot_share's numerator)",
    **common.shared_columns("pairs", "pooled_cos", "mean_cos", "min_cos", "below_0_999", "below_0_9", "nonfinite"),
}
EPILOG = common.study_epilog(common.columns_epilog(COLUMNS, "columns (pairs: in --json only)"))


@dataclass(frozen=True)
class SweepRow:
    """One ε: its cost (hot share, pass-2 tiles: the tiles pass 2 recomputes) beside the accuracy."""

    eps: float
    hot_test: str
    hot_share: float
    pass2_tiles: int
    pairs: int
    pooled_cos: float
    mean_cos: float
    min_cos: float
    below_0_999: int
    below_0_9: int
    nonfinite: int  # pairs left out of the cosines: their output is not finite

    @classmethod
    def of(cls, scan: Scan) -> "SweepRow":
        s = scan.summary
        return cls(eps=scan.config.eps, hot_test=scan.config.hot_test, hot_share=scan.hot_share, pass2_tiles=scan.hot_tiles,
                   pooled_cos=s.pooled_cos if s else np.nan, below_0_9=s.below_0_9 if s else 0, **cos_stats(scan.cos))

    def to_json(self) -> dict:
        return asdict(self)


def sweep_configs(cfg: Config, eps_list, hot_tests=None) -> list[Config]:
    """The runs of a sweep: each hot test (None: the config's own) over every ε, tests outer."""
    return [cfg.replace(hot_test=t, eps=float(e)) for t in (hot_tests or [cfg.hot_test]) for e in eps_list]


def sweep_jobs(jobs: list[Job], cfg: Config, eps_list, engine: Engine, *, hot_tests=None,
               progress=None, where=None) -> tuple[list[list[SweepRow]], list[SweepRow]]:
    """One row per (hot test, ε) for each job, in ``sweep_configs``'s order, and the rows of all jobs'
    pairs pooled. The configs run as one evaluation: each unit's inputs are read once for all, in this
    process or ``where`` (scan.evaluate)."""
    runs = evaluate(jobs, sweep_configs(cfg, eps_list, hot_tests), engine, progress=progress, where=where)
    return ([[SweepRow.of(s) for s in r] for r in runs],
            [SweepRow.of(Scan.pooled(list(per_eps))) for per_eps in zip(*runs)])


def sweep(dump, cfg: Config, eps_list, *, pairs: Pairs | None = None, backend="auto", workers=1,
          progress=None) -> list[SweepRow]:
    jobs = [Job.of(dump, pairs)]
    return sweep_jobs(jobs, cfg, eps_list, engine_for(jobs, [cfg], backend, workers), progress=progress)[0][0]


def plot_sweep(series: dict[str, list[SweepRow]], out, title) -> str:
    """The accuracy-cost frontier: 1 − min cosine (the worst pair's) against hot share, one line per
    series (a dump, the pooled pairs, or either under one hot test), each point labelled with its ε."""
    plt = pyplot()
    fig, a = plt.subplots(figsize=(7, 4.5))
    for name, rows in series.items():
        share = [r.hot_share for r in rows]
        gap = [max(1.0 - r.min_cos, 1e-17) if np.isfinite(r.min_cos) else np.nan for r in rows]
        a.plot(share, gap, "o-", label=name)
        for r, x, y in zip(rows, share, gap):
            a.annotate(f"ε={r.eps:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    a.set_yscale("log")
    a.set_xlabel("hot share (tiles recomputed in pass 2)")
    a.set_ylabel("1 − min cosine")
    a.set_title(f"apa sweep {title}: min cosine against cost")
    a.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, out)


def add_arguments(p) -> None:
    common.study_options(p)
    p.add_argument("--eps", type=float, nargs="+", default=[-1, 0.001, 0.002, 0.005, 0.01, 0.05, 1e9],
                   help="ε values, one run each (< 0: every tile exact; 1e9: pure FP4)")
    p.add_argument("--hot-tests", nargs="+", choices=CHOICES["hot_test"], metavar="TEST",
                   help=f"hot tests ({', '.join(CHOICES['hot_test'])}; docs/numerics.md §7.7) to sweep the ε "
                        "grid under, one line each in the plot and a hot_test column in the table (default: the "
                        "config's); they override --config hot_test, and the JSON's config then holds null "
                        "for hot_test as for eps, which each row gives, listed under swept")
    common.selection(p)
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG of min cosine against hot share, the "
                   "accuracy-cost frontier, there (default: no plot)")


def run(args) -> None:
    for eps in args.eps:
        Config(eps=eps)  # each ε is checked up front, before any run
    tests = list(dict.fromkeys(args.hot_tests or []))  # a test named twice runs once
    jobs, cfg, engine, (per_dump, pooled) = common.run_study(
        args, lambda jobs, cfg, engine, progress, where: sweep_jobs(jobs, cfg, args.eps, engine, hot_tests=tests,
                                                                    progress=progress, where=where),
        pooled=True, variants=lambda cfg: sweep_configs(cfg, args.eps, tests))
    many, several = len(jobs) > 1, len(tests) > 1
    named = {job.name: rows for job, rows in zip(jobs, per_dump)} | ({"pooled": pooled} if many else {})
    n = len(args.eps)
    series = {f"{name} {t}" if many and several else t if several else name: rs[i * n:(i + 1) * n]
              for name, rs in named.items() for i, t in enumerate(tests or [cfg.hot_test])}
    png = plot_sweep(series, args.plot, common.what(jobs)) if args.plot else None
    cols = ["eps", *["hot_test"] * several, *["dump"] * many, "hot_share", "pass2_tiles", "pooled_cos", "mean_cos",
            "min_cos", "below_0_999", "below_0_9", "nonfinite"]
    lead = 1 + several + many
    rows = [[r.eps, *[r.hot_test] * several, *[name] * many, *(getattr(r, c) for c in cols[lead:])]
            for i in range(len(per_dump[0])) for name, rs in named.items() for r in [rs[i]]]
    if many:
        payload = common.payload(args, jobs, cfg, engine, plot=png, pooled=[r.to_json() for r in pooled],
                                 per_dump=common.per_dump(jobs, (dict(sweep=[r.to_json() for r in rs])
                                                                 for rs in per_dump)))
    else:
        payload = common.payload(args, jobs, cfg, engine, sweep=[r.to_json() for r in per_dump[0]], plot=png)
    # what ran: each row's eps (and hot test, under --hot-tests) overrides the config's
    payload["swept"] = ["eps", *["hot_test"] * bool(tests)]
    payload["config"].update(dict.fromkeys(payload["swept"]))
    emit(args.json, payload, [table(f"{common.named(jobs, 'apa sweep')} ({engine.name})", cols, rows)])
    if png and not args.json:
        say(f"plot: {png}")
