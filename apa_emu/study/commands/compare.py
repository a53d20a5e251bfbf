"""``apa compare``: APA and its peers on the same dumps, every (row, head) pair against float64
attention, one table per dump and one pooled; the engines and the measurement are the library's
``versus``."""

from __future__ import annotations

import json
import sys

import numpy as np

from ..dump import read_dump
from ..files import write_atomically
from ..plots import pyplot, save
from ..report import emit, json_safe, say, table
from .. import record, versus
from . import common

HELP = "APA against its peers (SageAttention, torch SDPA, pure FP4) on the same dumps: accuracy and cost"
DESCRIPTION = (
    "run each engine named by --engines on every (row, head) pair of each dump and compare its FP16 output "
    "with float64 attention. One table per dump and one of all the dumps' pairs pooled. Engines that need "
    "causal attention with equal lengths (SageAttention, torch SDPA) get the dump's query padded in front "
    "with zero rows and the keys up to its last query, as apa check does for them; only the dump's own rows "
    "are compared. An engine that cannot run here (no CUDA device, torch or SageAttention missing) or cannot "
    "run a dump (head dim) is named in one line and left out; the others run. Pure FP4 (apa:eps=1e9) runs "
    "on every dump as the baseline of the gap recovered, listed or not.")
DEFAULT_ENGINES = ["apa:eps=0.005", "apa:hot_test=budget,eps=0.01", "apa:eps=1e9", "sdpa-fp16", "fp16-exact"]
ENGINES = {
    "apa:KEY=VAL,...": "APA under those --config toggles (apa alone: the default config), on --backend",
    "sageattention": "SageAttention 1.0.6's real kernels (INT8 Q·K, FP16 P·V), on a CUDA device only "
                     "(pip install -e '.[sage]'; the engine registered as sageattention)",
    "sageattention-emu": "its bit-exact recipe (docs/numerics.md §14) on the CPU",
    "sdpa-fp16": "torch's FP16 scaled_dot_product_attention on a CUDA device; where torch sees none, an FP16-in, "
                 "FP16-out attention computed in float32 by NumPy on the CPU, named so in the tables",
    "sdpa:flash|efficient|cudnn|math": "one of torch's SDPA backends in FP16, on a CUDA device only",
    "fp16-exact": "float64 attention rounded to FP16: the floor of any kernel with an FP16 output (no time)",
}
COLUMNS = {
    "engine": "the engine's spec",
    "device": "where it ran (its times are that device's)",
    "pairs": "(row, head) pairs measured; pooled: of the dumps the engine ran",
    "worst_cos": "the lowest pair's cosine (output against float64 attention), over the finite pairs",
    **common.shared_columns("below_0_999", "below_0_99", "mean_cos"),
    "rel_l2_median": "median over the pairs of |out − float64 attention| / |float64 attention|",
    "rel_l2_p99": "its 99th percentile",
    "rel_l2_max": "its largest value",
    "gap_recovered": "the share of pure FP4's error the engine removes: 1 − mean(rel L2 of the engine) / "
                     "mean(rel L2 of apa:eps=1e9), over the same pairs (those finite under both); 0 for pure "
                     "FP4, 1 for an exact output",
    "seconds": "wall time of the engine's call on its device, from the inputs already there to the FP16 output "
               "on the host, prep included; the fastest of --repeat calls, summed over the dumps when pooled. "
               "On the CPU it is the emulator's or NumPy's time, not a kernel's cost",
    "hot_share": "APA: share of the visited key tiles recomputed exactly in pass 2 (its cost in work)",
    **common.shared_columns("nonfinite"),
}
_COLS = list(COLUMNS)
EPILOG = (common.columns_epilog(ENGINES, "engines (--engines)") + "\n\n" + common.columns_epilog(COLUMNS)
          + "\n\n" + common.config_epilog())


def add_arguments(p) -> None:
    common.study_options(p, units=False, json=False)
    p.add_argument("--engines", nargs="+", metavar="E", help="the engines to compare (specs below); --config gives "
                   f"the config each apa: spec's toggles start from (default: {' '.join(DEFAULT_ENGINES)})")
    p.add_argument("--repeat", type=common.count, default=1, metavar="N",
                   help="calls of each engine per dump, the fastest one's time reported (give 2 or more on the "
                        "device: the first call compiles the kernels)")
    common.table_outputs(p)
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG of the frontier, 1 − worst cosine against "
                   "cost (time; hot share for APA), one point per engine, pooled over the dumps")


def _note(line: str) -> None:
    print(f"apa: note: {line}", file=sys.stderr)


def run(args) -> None:
    base = common.config(args)
    paths = common.dump_paths(args)
    common.check_outputs(args, paths)
    chosen = versus.contenders(args.engines or DEFAULT_ENGINES, _note, base)  # every spec is checked before any dump is read
    dumps = [read_dump(p) for p in paths]
    names = [p.name for p in paths]
    apa = [c.cfg for c in chosen if isinstance(c, versus.Apa)]
    engine = common.engine(args, apa[0], [d.hd for d in dumps], apa[1:])
    what = names[0] if len(names) == 1 else f"{len(names)} dumps"
    with common.progress(True, f"compare {what}", engine.wait) as prog:
        results = versus.compare(dumps, names, chosen, engine, repeat=args.repeat, note=_note, progress=prog)
    pooled = versus.pooled(results) if len(dumps) > 1 else []
    payload = _payload(args, paths, engine, results, pooled, chosen)
    png = plot(pooled or results[0], args.plot, what) if args.plot else None
    if args.json_out:
        text = json.dumps(json_safe(dict(payload, plot=png)), indent=1, allow_nan=False) + "\n"
        write_atomically(args.json_out, lambda f: f.write(text.encode()))
    _print(args, names, results, pooled, chosen)
    if args.record:
        record.append(args.record, _markdown(names, results, pooled, chosen)
                      + "".join(f"\n\n{what}: `{path}`" for what, path in (("JSON", args.json_out), ("Plot", png)) if path),
                      [c.device for c in chosen])
    for path in filter(None, (args.json_out, png, args.record)):
        say(f"wrote {path}")


def _payload(args, paths, engine, results, pooled, chosen) -> dict:
    per_dump = [dict(dump=str(p), engines=[m.stats() for m in ms]) for p, ms in zip(paths, results)]
    return dict(dumps=per_dump, **(dict(pooled=[m.stats() for m in pooled]) if pooled else {}),
                backend=engine.name, repeat=args.repeat, baseline=versus.baseline(chosen).spec,
                engines={c.spec: c.label for c in chosen}, columns=COLUMNS)


def _rows(measures) -> list[list]:
    return [[_cosine(v) if c in ("worst_cos", "mean_cos") else v for c, v in ((c, m.stats()[c]) for c in _COLS)]
            for m in measures]


def _cosine(x: float) -> str:
    """A cosine with the digits that show how far it is from 1 (1 − 2e-8 is 0.9999999800, not 1)."""
    if not np.isfinite(x):
        return "-"
    digits = min(12, max(6, int(np.ceil(-np.log10(max(1.0 - x, 1e-12)))) + 2))
    return f"{x:.{digits}f}"


def _titled(names, results, pooled) -> list[tuple[str, list]]:
    titled = [(f"apa compare {name}", _rows(ms)) for name, ms in zip(names, results)]
    if pooled:
        titled.append((f"apa compare, {len(names)} dumps pooled", _rows(pooled)))
    return titled


def _legend(chosen) -> list[str]:
    return [f"{c.spec}: {c.label}" for c in chosen if c.label]


def _markdown(names, results, pooled, chosen) -> str:
    """The tables as Markdown, then what each engine is."""
    legend = _legend(chosen)
    return "\n\n".join([*(markdown(title, _COLS, rows) for title, rows in _titled(names, results, pooled)),
                         *(["Engines:\n\n" + "\n".join(f"- {line}" for line in legend)] if legend else [])])


def _print(args, names, results, pooled, chosen) -> None:
    """The tables, and what each engine is (its spec names it in the tables)."""
    if args.markdown:
        say(_markdown(names, results, pooled, chosen))
        return
    emit(False, {}, [table(title, _COLS, rows) for title, rows in _titled(names, results, pooled)])
    for line in _legend(chosen):
        say(line)


def markdown(title: str, columns, rows) -> str:
    """A table as GitHub Markdown under its title; numbers as the rich tables show them."""
    right = [c not in ("engine", "device") for c in columns]
    lines = [f"### {title}", "", "| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(_cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(x) -> str:
    if x is None or isinstance(x, float) and np.isnan(x):
        return "-"
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def plot(measures, out, title: str) -> str:
    """The frontier: 1 − worst cosine (log) against time for every timed engine, and against hot share
    for the APA engines, one labelled point per engine."""
    plt = pyplot()
    stats = [m.stats() for m in measures]
    fig, (by_time, by_share) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for axis, key, label in ((by_time, "seconds", "wall time (s, log), prep included"),
                             (by_share, "hot_share", "hot share (APA: tiles recomputed in pass 2)")):
        for i, s in enumerate(stats):
            if not np.isfinite(s["worst_cos"]):
                continue
            gap = max(1.0 - s["worst_cos"], 1e-12)  # an exact output would sit at 0, off a log axis
            if s["seconds"] is None:  # not a kernel (fp16-exact): a floor across the panel
                axis.axhline(gap, color=f"C{i}", ls="--", lw=0.8, label=s["engine"])
            elif s[key] is not None:
                axis.plot([s[key]], [gap], "o", color=f"C{i}")
                axis.annotate(s["engine"], (s[key], gap), textcoords="offset points", xytext=(4, 4), fontsize=7)
        axis.set_xlabel(label)
    if any(s["seconds"] is None for s in stats):
        by_time.legend(fontsize=7)
    by_time.set_xscale("log")
    by_time.set_yscale("log")
    by_time.set_ylabel("1 − worst cosine (clipped at 1e-12)")
    fig.suptitle(f"apa compare {title}: worst pair against cost (times on: "
                 f"{', '.join(sorted({s['device'] for s in stats if s['seconds'] is not None}))})", fontsize=9)
    fig.tight_layout()
    return save(fig, out)
