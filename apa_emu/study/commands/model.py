"""``apa model``: a real model run teacher-forced over a text with every full attention layer computed by
an engine of ``apa compare``, measured against the same model with float32 attention (the library's
``endtoend``)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import warnings
from pathlib import Path

import numpy as np

from ..files import write_atomically
from ..lm import text_of
from ..plots import pyplot, save
from ..report import emit, json_safe, say, table
from .. import endtoend, record, versus
from . import common
from .compare import ENGINES, markdown

HELP = "a model (SmolLM2-135M, Gemma 3 270M) with an engine's attention in every layer: KLD, same top, PPL ratio"
DESCRIPTION = (
    "run a model teacher-forced over the first --tokens tokens of a text, once with its own float32 attention "
    "(the base) and once per engine with every full-attention layer computed by that engine (SmolLM2: all 30; "
    "Gemma 3: the global layers 5, 11, 17, its windowed local layers keep float32 attention). Only attention "
    "changes: the engine gets each layer's Q, K, V rounded to FP16 and its FP16 output goes back into the float32 "
    "model. Position i's prediction of token i + 1 is compared with the base's, in float64 from the logits; the "
    "measures are pooled per context-length bucket (the tokens the position has seen: <= 2048, 2049-8192, "
    "8193-32768, only those present, then all). An engine that cannot run here or cannot run the model's head dim "
    "is named in one line and left out. docs/model.md says what each measure means.")
MODELS = {"smollm2": ("smollm2", "load_smollm2", "SmolLM2-135M-Instruct", "loading the model, about 5 s"),
          "gemma3": ("gemma3", "load_gemma3", "Gemma 3 270M", "loading the model, about 30 s")}
COLUMNS = {
    "engine": "the engine's spec (apa compare's)",
    "bucket": "the positions pooled: those that have seen that many tokens of context (i + 1 for position i)",
    "positions": "predicted positions in the bucket (each predicts the next token of the text)",
    "ppl_ratio": "perplexity with the engine over perplexity with float32 attention: exp(mean NLL_engine − mean "
                 "NLL_base), NLL = −log p(reference token)",
    "kld_mean": "mean over the positions of KL(P_base ‖ P_engine) = Σ_v P_base(v)·(log P_base(v) − log P_engine(v)), "
                "in nats, the next-token distributions from a float64 log-softmax of each run's logits",
    "kld_p99": "99th percentile of that KL divergence over the positions (linear interpolation)",
    "kld_p999": "its 99.9th percentile",
    "same_top": "% of positions where the engine's most likely next token is the base's",
    "rms_dp": "root mean square over the positions of P_engine(reference) − P_base(reference)",
    "hot_share": "APA: share of the visited key tiles recomputed exactly in pass 2, over all its layers",
    "nonfinite": "positions whose engine logits hold NaN or Inf: counted here, left out of every other measure",
}
LAYER_COLUMNS = {
    "layer": "the attention layer",
    "hot_share": "APA: share of that layer's visited key tiles recomputed in pass 2",
    "worst_cos": "the lowest cosine of a (row, head) output against float64 attention of the layer's FP16 inputs "
                 "(in the every-layer run, so the inputs carry the earlier layers' engine error)",
    "nonfinite_pairs": "(row, head) outputs of the layer holding NaN or Inf",
}
EPILOG = "\n\n".join([common.columns_epilog(ENGINES, "engines (--engines)"), common.columns_epilog(COLUMNS),
                      common.columns_epilog(LAYER_COLUMNS, "per-layer columns (APA engines)"),
                      "--per-layer: each engine in one layer at a time, the others float32; its table gives each "
                      "layer's kld_mean over all positions (that layer's contribution).",
                      common.config_epilog()])


def add_arguments(p) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                   help="smollm2 (extra models) or gemma3 (extra gemma3; torch, on CUDA when it is there)")
    p.add_argument("--text", help="a UTF-8 text file (default: the model's bundled sample)")
    p.add_argument("--tokens", type=common.at_least(2), default=1024, metavar="N",
                   help="the text's first N tokens (SmolLM2: at most 8192; Gemma 3 past 32768 warns)")
    p.add_argument("--engines", nargs="+", metavar="E", default=[],
                   help="the engines (apa compare's specs, below); --config gives the config each apa: spec's "
                        "toggles start from")
    p.add_argument("--eps-grid", nargs="+", type=float, default=[], metavar="EPS",
                   help="also run APA at each of these ε under each --hot-tests test (apa:hot_test=T,eps=EPS); "
                        "--plot-dir then draws the frontier: mean KLD against hot share")
    p.add_argument("--hot-tests", nargs="+", choices=("mass", "output", "budget"), default=["mass"], metavar="T",
                   help="the hot tests of --eps-grid: mass, output, budget (default: mass)")
    common.study_options(p, units=False, json=False, dumps=False)
    p.add_argument("--per-layer", action="store_true",
                   help="also run each engine in one layer at a time (one more pass per engine and layer)")
    common.table_outputs(p)
    p.add_argument("--plot-dir", metavar="DIR", help="write PNGs there (an existing folder; no file is replaced): "
                   "KLD against position, and with --per-layer KLD by layer")


def _plot_paths(args) -> dict[str, Path]:
    """The PNGs --plot-dir will hold, refused up front when the folder is missing or one exists."""
    if not args.plot_dir:
        return {}
    folder = Path(args.plot_dir)
    if not folder.is_dir():
        raise ValueError(f"--plot-dir {folder}: not an existing folder")
    stem = f"model_{args.model}_{args.tokens}"
    paths = {"positions": folder / f"{stem}_positions.png"}
    if sum(spec.startswith("apa") for spec in args.engines) > 1:
        paths["frontier"] = folder / f"{stem}_frontier.png"
    if args.per_layer:
        paths["per_layer"] = folder / f"{stem}_per_layer.png"
    for path in paths.values():
        if path.exists():
            raise ValueError(f"--plot-dir {folder}: {path.name} exists already; refusing to replace it")
    return paths


def _tokens(args, module, model) -> np.ndarray:
    """The text's first --tokens tokens; a text too short or a model's context too small is refused."""
    text = text_of(Path(args.text) if args.text else None, module.sample_text_path())
    tokens = model.tokenize(text)
    if tokens.size < args.tokens:
        raise ValueError(f"{args.text or 'the bundled sample'} has {tokens.size} tokens, fewer than --tokens "
                         f"{args.tokens}: give a longer text or fewer tokens")
    if hasattr(module, "warn_past_context"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.warn_past_context(args.tokens, model.hp.n_ctx)
        for w in caught:
            common.note(str(w.message))
    elif args.tokens > model.hp.n_ctx:
        raise ValueError(f"--tokens {args.tokens}: past the model's context of {model.hp.n_ctx} tokens")
    return tokens[:args.tokens]


def _contenders(args, model, makers) -> list[versus.Contender]:
    """The engines that can run here and run the model's attention; each one left out is named."""
    chosen = []
    for spec, make in makers.items():
        try:
            c = make()
        except versus.Unavailable as e:
            common.note(f"{spec} left out: {e}")
            continue
        why = endtoend.lacking(model, c)
        if why:
            common.note(f"{spec} left out: it does not run {why}")
        else:
            chosen.append(c)
    if not chosen:
        raise ValueError("no engine of --engines can run here; see the notes above")
    return chosen


def _engine(args, base, chosen, model):
    """The study engine: it runs the APA specs and the float64 references."""
    apa = [c.cfg for c in chosen if isinstance(c, versus.Apa)] or [base]
    engine = common.engine(args, apa[0], [model.hp.head_dim], apa[1:])
    for c in chosen:
        if isinstance(c, versus.Apa):
            c.attach(engine)
    return engine


def _grid(args) -> list[str]:
    """--engines, then the --eps-grid × --hot-tests APA specs; an empty list is refused."""
    grid = [f"apa:hot_test={t},eps={e:g}" for t in dict.fromkeys(args.hot_tests) for e in dict.fromkeys(args.eps_grid)]
    specs = list(dict.fromkeys([*args.engines, *grid]))
    if not specs:
        raise ValueError("no engine: give --engines, --eps-grid, or both")
    return specs


def run(args) -> None:
    base = common.config(args)
    args.engines = _grid(args)
    makers = {spec: versus.parse_spec(spec, base) for spec in dict.fromkeys(args.engines)}
    common.check_outputs(args, [args.text] if args.text else [])
    plots = _plot_paths(args)
    name, loader, title, wait = MODELS[args.model]
    module = importlib.import_module(f"..{name}", __package__)
    with common.progress(True, f"{title}, loading", wait):
        model = getattr(module, loader)()
    tokens = _tokens(args, module, model)
    chosen = _contenders(args, model, makers)
    engine = _engine(args, base, chosen, model)
    layers = endtoend.full_layers(model)
    passes = 1 + len(chosen) * (1 + len(layers) * args.per_layer)
    with common.progress(True, f"apa model {args.model}, {tokens.size} tokens, {passes} passes", engine.wait) as prog, \
            engine.context():
        done = endtoend.Passes(model, tokens, passes, prog)
        runs = endtoend.every_layer(done, chosen, engine)
        layered = endtoend.per_layer(done, chosen, engine) if args.per_layer else {}
    payload = _payload(args, title, tokens, engine, base, runs, layered)
    written = _plots(args, title, runs, layered, plots, {c.spec: c.cfg for c in chosen if isinstance(c, versus.Apa)})
    if args.json_out:
        text = json.dumps(json_safe(dict(payload, plots=written)), indent=1, allow_nan=False) + "\n"
        write_atomically(args.json_out, lambda f: f.write(text.encode()))
    _print(args, title, tokens.size, runs, layered)
    if args.record:
        tables = _markdown(_tables(title, tokens.size, runs, layered))
        record.append(args.record, tables + "".join(f"\n\nPlot: `{path}`" for path in written), [r.device for r in runs])
    for path in [*written, *filter(None, [args.json_out, args.record])]:
        say(f"wrote {path}")


def _layer_rows(run: endtoend.Run) -> list[dict]:
    return [dict(layer=layer, hot_share=s.hot[0] / s.hot[1] if s.hot and s.hot[1] else None,
                 worst_cos=s.worst_cos, nonfinite_pairs=s.nonfinite) for layer, s in sorted(run.layers.items())]


def _payload(args, title, tokens, engine, base, runs, layered) -> dict:
    return dict(model=title, text=args.text or "bundled sample", tokens=int(tokens.size), backend=engine.name,
                config=dataclasses.asdict(base), swapped_layers=sorted(runs[0].layers),
                engines=[dict(engine=r.spec, label=r.label, device=r.device, hot_share=r.hot_share(),
                              buckets=endtoend.buckets(r.positions), layers=_layer_rows(r),
                              kld_by_position=r.positions.kld.tolist(),
                              finite_by_position=r.positions.finite.tolist()) for r in runs],
                per_layer={spec: [dict(layer=layer, **s) for layer, s in by.items()] for spec, by in layered.items()},
                columns=COLUMNS, layer_columns=LAYER_COLUMNS)


_COLS = list(COLUMNS)


def _tables(title: str, n: int, runs, layered) -> list[tuple[str, list, list]]:
    """(title, columns, rows) of each table: the buckets, the APA engines' layers, the per-layer swap."""
    main = [[r.spec, *(b[c] for c in _COLS[1:-2]), r.hot_share(), b["nonfinite"]]
            for r in runs for b in endtoend.buckets(r.positions)]
    out = [(f"apa model: {title}, {n} tokens, each engine in every layer against float32 attention", _COLS, main)]
    for r in runs:
        if any(s.hot is not None for s in r.layers.values()):
            rows = [list(row.values()) for row in _layer_rows(r)]
            out.append((f"{r.spec}: by layer", list(LAYER_COLUMNS), rows))
    if layered:
        specs = list(layered)
        rows = [[layer, *(layered[s][layer]["kld_mean"] for s in specs)] for layer in layered[specs[0]]]
        out.append((f"kld_mean with one layer at a time on the engine, {n} tokens", ["layer", *specs], rows))
    return out


def _markdown(tables) -> str:
    return "\n\n".join(markdown(t, cols, rows) for t, cols, rows in tables)


def _print(args, title: str, n: int, runs, layered) -> None:
    tables = _tables(title, n, runs, layered)
    if args.markdown:
        say(_markdown(tables))
    else:
        emit(False, {}, [table(t, cols, rows) for t, cols, rows in tables])
    for r in runs:
        if r.label:
            say(f"{r.spec}: {r.label}")


def _smoothed(x: np.ndarray, keep: np.ndarray, width: int) -> np.ndarray:
    """The running mean of x over the last ``width`` positions where ``keep`` (fewer at the start)."""
    sums, counts = (np.concatenate([[0.0], np.cumsum(a)]) for a in (np.where(keep, x, 0.0), keep))
    i = np.arange(1, x.size + 1)
    j = np.maximum(i - width, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums[i] - sums[j]) / (counts[i] - counts[j])


def _plots(args, title: str, runs, layered, paths, cfgs) -> list[str]:
    """KLD against position (a running mean), the frontier of the APA engines and, with --per-layer, each
    layer's KLD contribution."""
    written = []
    plt = pyplot()
    if "positions" in paths:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        n = runs[0].positions.kld.size
        width = max(1, n // 64)
        for r in runs:
            p = r.positions
            ax.plot(p.context, _smoothed(p.kld, p.finite, width), label=r.spec, lw=1)
        ax.set(yscale="log", xlabel="tokens of context", ylabel=f"KLD (nats), running mean over {width} positions",
               title=f"{title}: KLD against float32 attention by position")
        ax.legend(fontsize=7)
        written.append(save(fig, paths["positions"]))
    if "frontier" in paths:
        written.append(save(_frontier(plt, title, runs, cfgs), paths["frontier"]))
    if "per_layer" in paths:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for spec, by in layered.items():
            ax.plot(list(by), [s["kld_mean"] for s in by.values()], "o-", label=spec, ms=3)
        ax.set(yscale="log", xlabel="layer on the engine (the others float32)", ylabel="mean KLD (nats)",
               title=f"{title}: each layer's KLD contribution")
        ax.legend(fontsize=7)
        written.append(save(fig, paths["per_layer"]))
    return written


def _frontier(plt, title: str, runs, cfgs: dict):
    """Mean KLD against hot share, the APA engines joined by hot test in order of hot share; every other
    engine a dashed level."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mean = {r.spec: endtoend.buckets(r.positions)[-1]["kld_mean"] for r in runs}
    for test in dict.fromkeys(cfg.hot_test for cfg in cfgs.values()):
        points = sorted((r.hot_share(), mean[r.spec], cfgs[r.spec].eps) for r in runs
                        if r.spec in cfgs and cfgs[r.spec].hot_test == test and r.hot_share() is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=4, label=f"APA, {test} test")
        for share, kld, eps in points:
            ax.annotate(f"ε {eps:g}", (share, kld), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for r in runs:
        if r.spec not in cfgs:
            ax.axhline(mean[r.spec], ls="--", lw=1, color="gray")
            ax.annotate(r.spec, (0, mean[r.spec]), fontsize=7, xytext=(2, 2), textcoords="offset points")
    ax.set(yscale="log", xlabel="hot share (key tiles recomputed in pass 2)", ylabel="mean KLD (nats)",
           title=f"{title}: accuracy against cost")
    ax.legend(fontsize=7)
    return fig
