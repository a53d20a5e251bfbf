"""``apa headroom``: how close pass 2's FP16 scores and output come to overflow (numerics.md §8)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ...config import Config
from ..engine import Engine
from ..report import emit, table
from ..scan import F16_MAX, Job, Pairs, engine_for, evaluate, fp16_headroom, pair_hot
from . import common

HELP = "how close pass 2's FP16 scores and output come to overflow (65504)"
_NOTES = """Pass 2 accumulates the scores q·k and the output O in FP16 (docs/numerics.md §8.1, §8.5): past
65504 they turn into Inf or NaN. Per pair, in float64 on the dump's FP16 inputs:
  max |q·k|        largest partial sum of the score chain, after each 16-channel step, over the keys
  max |running O|  largest |O| after each 16-key step of the pair's hot tiles, in pass 2's running-max
                   frame (before FP16 rounding): large V over many flat hot keys drives it up
"""
EPILOG = common.study_epilog(_NOTES)


@dataclass(frozen=True)
class Headroom:
    """FP16 headroom of pass 2 over a set of pairs: the largest ``fp16_headroom`` estimates, the pairs
    that reach them, and how many pairs pass the FP16 maximum."""

    pairs: int
    max_qk: float
    max_qk_pair: tuple[int, int]
    qk_over: int
    max_o16: float
    max_o16_pair: tuple[int, int]
    o16_over: int
    nonfinite: int  # pairs whose emulated output is not finite

    def to_json(self) -> dict:
        return asdict(self)


def headroom_jobs(jobs: list[Job], cfg: Config, engine: Engine, *, progress=None, where=None) -> list[Headroom]:
    """How close each job's pairs bring pass 2's FP16 scores and output to overflow (numerics.md §8);
    the units run ``where`` (scan.evaluate)."""
    out = []
    for job, (scan,) in zip(jobs, evaluate(jobs, [cfg], engine, progress=progress, where=where)):
        pairs, dump = scan.pairs, job.dump  # the scan's: a unit that failed on a cluster has none
        est = np.array([fp16_headroom(dump, r, h, pair_hot(dump, scan.result, r, h), cfg.softmax_scale(dump.hd))
                        for r, h in zip(pairs.rows.tolist(), pairs.heads.tolist())])
        qk, o16 = int(np.argmax(est[:, 0])), int(np.argmax(est[:, 1]))
        at = lambda i: (int(pairs.rows[i]), int(pairs.heads[i]))  # noqa: E731
        out.append(Headroom(pairs=len(pairs), max_qk=float(est[qk, 0]), max_qk_pair=at(qk),
                            qk_over=int((est[:, 0] > F16_MAX).sum()), max_o16=float(est[o16, 1]),
                            max_o16_pair=at(o16), o16_over=int((est[:, 1] > F16_MAX).sum()),
                            nonfinite=int((~scan.finite).sum())))
    return out


def headroom(dump, cfg: Config, pairs: Pairs | None = None, *, backend="auto", workers=1, progress=None) -> Headroom:
    jobs = [Job.of(dump, pairs)]
    return headroom_jobs(jobs, cfg, engine_for(jobs, [cfg], backend, workers), progress=progress)[0]


def add_arguments(p) -> None:
    common.study_options(p)
    common.eps(p)
    common.selection(p)


def run(args) -> None:
    jobs, cfg, engine, hs = common.run_study(args, headroom_jobs)
    title = f"{common.named(jobs, 'apa headroom')}: pass 2's FP16 accumulators, float64 estimates"
    if len(jobs) > 1:
        emit(args.json, common.payload(args, jobs, cfg, engine, fp16_max=F16_MAX,
                                       per_dump=common.per_dump(jobs, (dict(headroom=h.to_json()) for h in hs))),
             [table(title, ["dump", "pairs", "max_qk", "max_qk_at", "qk_over", "max_o16", "max_o16_at", "o16_over",
                            "nonfinite"], _pooled_rows(jobs, hs))])
        return
    h = hs[0]
    rows = [("pairs", h.pairs),
            ("max |q·k| partial sum", h.max_qk), ("  its share of the FP16 max", h.max_qk / F16_MAX),
            ("  at (row, head)", h.max_qk_pair), ("  pairs past the FP16 max", h.qk_over),
            ("max |running O|", h.max_o16), ("  its share of the FP16 max", h.max_o16 / F16_MAX),
            ("  at (row, head)", h.max_o16_pair), ("  pairs past the FP16 max", h.o16_over),
            ("pairs with a non-finite output", h.nonfinite)]
    emit(args.json, common.payload(args, jobs, cfg, engine, fp16_max=F16_MAX, headroom=h.to_json()),
         [table(title, ["metric", "value"], rows)])


def _pooled_rows(jobs, hs: list[Headroom]) -> list[list]:
    """A row per dump, then the largest estimates over all of them and the dump that reaches each."""
    rows = [[j.name, h.pairs, h.max_qk, h.max_qk_pair, h.qk_over, h.max_o16, h.max_o16_pair, h.o16_over,
             h.nonfinite] for j, h in zip(jobs, hs)]
    qk, o16 = (max(range(len(hs)), key=lambda i: getattr(hs[i], f)) for f in ("max_qk", "max_o16"))
    rows.append(["pooled", sum(h.pairs for h in hs), hs[qk].max_qk, f"{jobs[qk].name} {hs[qk].max_qk_pair}",
                 sum(h.qk_over for h in hs), hs[o16].max_o16, f"{jobs[o16].name} {hs[o16].max_o16_pair}",
                 sum(h.o16_over for h in hs), sum(h.nonfinite for h in hs)])
    return rows
