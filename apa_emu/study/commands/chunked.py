"""``apa chunked``: chunked prefill through a KV state against whole-prompt prefill (numerics.md §5.9);
the study itself is the library's ``chunked``."""

from __future__ import annotations

from ..chunked import chunked_study
from ..report import emit, table
from . import common

HELP = "chunked prefill through a KV state against whole-prompt prefill: hot share and cosines"
COLUMNS = {
    "dump": "the dump file, two rows each",
    "prefill": "whole: the dump's query rows in one call; chunked: in chunks of --chunk rows through a KV state",
    "chunks": "calls per KV head",
    "restats": "chunks that computed the K statistics afresh, summed over the KV heads (the first chunk always "
               "does; later ones when the context outgrew them)",
    "frozen (chunk, KV head)": "chunks that reused an earlier chunk's statistics, summed over the KV heads",
    **common.shared_columns("hot_share", "mean_cos", "min_cos", "below_0_999", "nonfinite", "violations"),
}
EPILOG = common.study_epilog("Each chunk sees the keys up to its last row; later chunks reuse the first chunk's K "
                             "mean and head scales until the context grows 1.125x (numerics.md §5.9).\n\n"
                             + common.columns_epilog(COLUMNS, "columns (every pair of the dump against float64 "
                                                              "attention)"))

_CHUNKED = ["hot_share", "mean_cos", "min_cos", "below_0_999", "nonfinite", "violations"]


def add_arguments(p) -> None:
    common.study_options(p, units=False)  # a chunked prefill is one call per chunk in order, no units to spread
    p.add_argument("--chunk", type=common.count, default=512, metavar="C", help="query rows per chunk")
    common.eps(p)


def run(args) -> None:
    # where is None: chunked takes no --cluster (a chunked prefill is one call per chunk, in order)
    jobs, cfg, engine, reports = common.run_study(args, lambda jobs, cfg, engine, progress, where: [
        chunked_study(job.dump, cfg, args.chunk, engine, progress=progress) for job in jobs])
    rows = []
    for job, r in zip(jobs, reports):
        frozen = sum(x == "" for head in r.reasons for x in head)
        for side in ("whole", "chunked"):
            got = getattr(r, side)
            rows.append([job.name, side, *((1, "", "") if side == "whole" else (r.chunks, r.restats, frozen)),
                         *(got[c] for c in _CHUNKED)])
    title = (f"{common.named(jobs, 'apa chunked')} ({engine.name}, eps={cfg.eps}): whole-prompt prefill against "
             f"chunks of {args.chunk} query rows through a KV state (§5.9), every pair vs float64")
    emit(args.json, common.payload(args, jobs, cfg, engine, per_dump=common.per_dump(jobs, (r.to_json() for r in reports))),
         [table(title, ["dump", "prefill", "chunks", "restats", "frozen (chunk, KV head)", *_CHUNKED], rows)])
