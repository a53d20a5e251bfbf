"""The ``apa`` command: studies on attention dumps (scan, worst, pair, attribute, sweep) and dump makers.

Argument parsing and dispatch; ``scan`` computes, ``report`` prints tables or JSON, ``plots`` draws.
One clear line and a non-zero exit on any error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..config import CHOICES, Config
from .dump import HEAD_DIMS, builtin_dump_path, read_dump
from .report import OutputError, emit, flush, progress_bar, say, table

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def _parse_list(text: str | None, what: str):
    """'0:64', '3,5,9' or '7' -> an index array (None if not given)."""
    if text is None:
        return None
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            return np.arange(int(a), int(b))
        return np.array([int(x) for x in text.split(",") if x.strip()])
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected A:B, a comma list or one integer") from None


def _load(args):
    path = Path(args.dump) if args.dump else builtin_dump_path()
    return read_dump(path), path


def _config(args) -> Config:
    cfg = Config.from_overrides(args.config or [])
    eps = getattr(args, "eps", None)
    return cfg.replace(eps=eps) if isinstance(eps, float) else cfg  # sweep's --eps is a list, applied per run


def _workers(requested: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if requested <= cpus:
        return requested
    print(f"apa: note: --workers {requested} is more than the {cpus} CPUs available: using {cpus}", file=sys.stderr)
    return cpus


def _pairs(args, dump):
    from .scan import Pairs

    return Pairs.select(dump.q.shape[0], dump.q.shape[1], _parse_list(args.rows, "--rows"),
                        _parse_list(args.heads, "--heads"))


class _CtrlC:
    """SIGINT as KeyboardInterrupt in the main process only: forked workers inherit the handler and let
    Ctrl-C pass (the pool's exit ends them; their tracebacks would bury the one line).

    Python prints and swallows an exception raised in a fork hook, and a Ctrl-C that lands while the
    pool forks its workers runs the handler inside one: then the signal is only remembered, and the
    next progress step raises it."""

    def __init__(self):
        self.pid, self.hit, self.forking = os.getpid(), False, False
        os.register_at_fork(before=lambda: self._fork(True), after_in_parent=lambda: self._fork(False),
                            after_in_child=lambda: self._fork(False))

    def _fork(self, begins: bool):
        self.forking = begins

    def arm(self):
        self.pid, self.hit = os.getpid(), False
        return signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame):
        if os.getpid() == self.pid:
            self.hit = True
            if not self.forking:
                raise KeyboardInterrupt

    def watch(self, progress):
        def update(done, total):
            if self.hit:
                raise KeyboardInterrupt
            if progress:
                progress(done, total)

        return update


_CTRL_C = _CtrlC()


@contextmanager
def _progress(enabled: bool, label: str, *wait: str):
    with progress_bar(enabled, label, *wait) as bar:
        yield _CTRL_C.watch(bar)


def _payload(path, cfg: Config, **fields) -> dict:
    return dict(dump=str(path), config=dataclasses.asdict(cfg), **fields)


def _study(args, compute):
    """The dump, its path, the config and ``compute(dump, cfg, progress)`` run under a progress bar."""
    dump, path = _load(args)
    cfg = _config(args)
    with _progress(not args.json, f"{args.command} {path.name}") as prog:
        return dump, path, cfg, compute(dump, cfg, prog)


def cmd_scan(args):
    from .scan import run_pairs

    _, path, cfg, scan = _study(args, lambda dump, cfg, prog: run_pairs(
        dump, cfg, _pairs(args, dump), workers=args.workers, progress=prog))
    report = scan.to_json()
    bad = report["nonfinite"]
    rows = list(scan.summary.as_dict().items()) if scan.summary else [("finite pairs", 0)]
    if bad["count"]:
        rows += [("non-finite pairs", f"{bad['count']} of {report['pairs']}"),
                 ("first non-finite (row, head)", " ".join(f"({r}, {h})" for r, h in bad["first"]))]
    title = f"apa scan {path.name} (eps={cfg.eps})" + (": cosines over the finite pairs" if bad["count"] else "")
    emit(args.json, _payload(path, cfg, **report),
         [table(title, ["metric", "value"], rows), table("per-pair cosine", ["bin", "pairs"], scan.histogram)])


def cmd_worst(args):
    from .scan import worst

    _, path, cfg, (_, diags) = _study(args, lambda dump, cfg, prog: worst(
        dump, cfg, args.n, pairs=_pairs(args, dump), workers=args.workers, progress=prog))
    records = [d.to_json() for d in diags]
    cols = ["row", "head", "cos", "rel_l2", "hot_tiles", "tiles", "cold_mass_fp4", "cold_mass_f64", "cold_out_rel",
            "max_qk", "max_o16", "overflow"]
    emit(args.json, _payload(path, cfg, worst=records),
         [table(f"apa worst {path.name}: {len(diags)} lowest-cosine pairs", cols, [[r[c] for c in cols] for r in records])])


def cmd_pair(args):
    from .plots import plot_pair
    from .scan import pair

    dump, path = _load(args)
    cfg = _config(args)
    info = pair(dump, cfg, args.row, args.head)
    d = info.diag
    summary = [
        ("cosine", d.cos), ("relative L2", d.rel_l2), ("overflow", d.overflow or "none"),
        ("top tile / its mass", f"{info.top_tile} / {info.top_tile_mass:.6f}"),
        ("hot tiles / tiles", f"{d.hot_tiles} / {d.tiles}"), ("hot mass (float64)", info.hot_mass),
        ("cold mass FP4 estimate / float64", f"{d.cold_mass_fp4:.6f} / {d.cold_mass_f64:.6f}"),
        ("|ref|", info.ref_norm), ("|hot part of ref|", info.hot_norm), ("|cold part of ref|", info.cold_norm),
        ("|out|", info.out_norm),
        ("max |q·k| partial sum, float64 estimate (FP16 max 65504)", d.max_qk),
        ("max |running O| of pass 2, float64 estimate", d.max_o16),
    ]
    visit_cols = ["visit", "tile", "hot", "c", "m", "tl", "la", "lc"]
    png = None
    if args.plot:
        png = plot_pair(info, args.plot, f"{path.name} row {args.row} head {args.head}")
    payload = _payload(path, cfg, row=args.row, head=args.head, **info.to_json(), plot=png)
    emit(args.json, payload, [table(f"apa pair {path.name} row {args.row} head {args.head}", ["metric", "value"], summary),
                              table("pass-1 trace of its warp (this row)", visit_cols,
                                    [[getattr(v, c) for c in visit_cols] for v in info.visits])])
    if png and not args.json:
        say(f"plot: {png}")


def cmd_attribute(args):
    from .scan import attribute

    _, path, cfg, result = _study(args, lambda dump, cfg, prog: attribute(
        dump, cfg, args.worst, workers=args.workers, progress=prog))
    rows = [(name, r.mean_cos, r.min_cos, r.nonfinite) for name, r in result.variants.items()]
    emit(args.json, _payload(path, cfg, worst=args.worst, **result.to_json()),
         [table(f"apa attribute {path.name}: mean cosine of the {args.worst} worst pairs",
                ["variant", "mean_cos", "min_cos", "nonfinite"], rows)])


def cmd_sweep(args):
    from .plots import plot_sweep
    from .scan import sweep

    for eps in args.eps:
        Config(eps=eps)  # each ε is checked up front, before any run
    _, path, cfg, rows = _study(args, lambda dump, cfg, prog: sweep(
        dump, cfg, args.eps, pairs=_pairs(args, dump), workers=args.workers, progress=prog))
    png = plot_sweep(rows, args.plot, path.name) if args.plot else None
    records = [r.to_json() for r in rows]
    cols = ["eps", "hot_share", "pooled_cos", "mean_cos", "min_cos", "below_0_9", "nonfinite"]
    emit(args.json, _payload(path, cfg, sweep=records, plot=png),
         [table(f"apa sweep {path.name}", cols, [[r[c] for c in cols] for r in records])])
    if png and not args.json:
        say(f"plot: {png}")


def cmd_headroom(args):
    from .scan import F16_MAX, headroom

    _, path, cfg, h = _study(args, lambda dump, cfg, prog: headroom(
        dump, cfg, _pairs(args, dump), workers=args.workers, progress=prog))
    rows = [("pairs", h.pairs),
            ("max |q·k| partial sum", h.max_qk), ("  its share of the FP16 max", h.max_qk / F16_MAX),
            ("  at (row, head)", h.max_qk_pair), ("  pairs past the FP16 max", h.qk_over),
            ("max |running O|", h.max_o16), ("  its share of the FP16 max", h.max_o16 / F16_MAX),
            ("  at (row, head)", h.max_o16_pair), ("  pairs past the FP16 max", h.o16_over),
            ("pairs with a non-finite output", h.nonfinite)]
    emit(args.json, _payload(path, cfg, fp16_max=F16_MAX, headroom=h.to_json()),
         [table(f"apa headroom {path.name}: pass 2's FP16 accumulators, float64 estimates", ["metric", "value"], rows)])


def cmd_synth(args):
    from .dump import write_dump
    from .synth import synthetic

    d = synthetic(args.n, args.kv, args.heads, args.kv_heads, args.d, seed=args.seed)
    say(str(write_dump(args.out, d.q, d.k, d.v, d.q_offset)))


def cmd_smollm2(args):
    from .smollm2 import make_dumps

    with _progress(True, "SmolLM2 layers", "loading the model, about 5 s") as prog:
        paths = make_dumps(Path(args.text) if args.text else None, args.layers, args.n, args.out_dir,
                           args.max_tokens, progress=prog)
    for p in paths:
        say(str(p))


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Bad arguments end in one line, like every other error of the command."""

    def error(self, message):
        command = self.prog.removeprefix("apa").strip()
        self.exit(EXIT_ERROR, f"apa: error: {command + ': ' if command else ''}{message}\n")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _config_epilog() -> str:
    lines = []
    for f in dataclasses.fields(Config):
        default = getattr(Config(), f.name)
        if isinstance(default, bool):
            accepted, default = "on | off", "on" if default else "off"
        else:
            accepted = " | ".join(CHOICES[f.name]) if f.name in CHOICES else _ACCEPTS[f.name]
        lines.append(f"  {f.name:<12} {accepted:<40} default {'none' if default is None else default}")
    return "--config keys (docs/numerics.md §2–§9 says what each one does):\n" + "\n".join(lines)


# What --config accepts for the keys that are neither on/off nor a fixed set of words.
_ACCEPTS = {"eps": "a number (< 0: every tile exact)", "delta": "a number >= 0", "tau": "an integer in 0..8",
            "q_terms": "1 | 2", "scale": "a number > 0 | none (1/sqrt(d))"}

_WORST_COLUMNS = """columns:
  cos, rel_l2       cosine and relative L2 error of the output against float64 attention
  hot_tiles, tiles  tiles of the pair's warp recomputed exactly in pass 2, and all its tiles
  cold_mass_fp4     share of the row's softmax mass left cold, as pass 1's FP4 sums estimate it
  cold_mass_f64     the same share in float64
  cold_out_rel      |cold part of the float64 output| / |float64 output|
  max_qk, max_o16   FP16 headroom of pass 2, float64 estimates (see apa headroom --help)
  overflow          the first stage whose output went non-finite, if any (cos and rel_l2 are then NaN)
"""

_TRACE_COLUMNS = """pass-1 trace columns (docs/numerics.md §7 and §10), this row's lane of its warp:
  visit   visit order: tile 0 first, then from the diagonal tile down
  tile    key tile (64 keys)
  hot     the warp voted the tile hot: pass 2 recomputes it in FP16
  c       candidate frame (log2 units) from this tile's scores
  m       frame after the visit
  tl      the tile's FP4 row sum P̂·1, in units of 2^m
  la      λ after the visit: running row sum of every tile so far
  lc      running row sum of the cold tiles so far
"""


_HEADROOM_NOTES = """Pass 2 accumulates the scores q·k and the output O in FP16 (docs/numerics.md §8.1, §8.5): past
65504 they turn into Inf or NaN. Per pair, in float64 on the dump's FP16 inputs:
  max |q·k|        largest partial sum of the score chain, after each 16-channel step, over the keys
  max |running O|  largest |O| after each 16-key step of the pair's hot tiles, in pass 2's running-max
                   frame (before FP16 rounding): large V over many flat hot keys drives it up
"""


def _attribute_epilog() -> str:
    from .scan import ATTRIBUTE_VARIANTS

    ops = ("quant_q", "quant_k", "quant_p", "quant_v")
    lines = []
    for name, change in ATTRIBUTE_VARIANTS.items():
        quantized = [op[-1].upper() for op in ops if change.get(op, True)]
        other = ", ".join(f"{k}={v}" for k, v in change.items() if k not in ops)
        what = f"quantized in pass 1: {' '.join(quantized) or 'nothing (FP16 operands)'}" + (f"; {other}" if other else "")
        lines.append(f"  {name:<18} {what}")
    return "variants (every other toggle as --config sets it):\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="apa", formatter_class=_Help,
                 description="APA emulator studies on attention dumps. Every study compares the emulator with "
                             "float64 attention, pair by pair (query row, head).",
                 epilog="The first run compiles the emulator with Numba (about 30 s); later runs reuse the cache.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def study(name, helptext, func, epilog=""):
        p = sub.add_parser(name, help=helptext, description=helptext, formatter_class=_Help,
                           epilog="\n\n".join(x for x in (epilog, _config_epilog()) if x))
        p.add_argument("dump", nargs="?", help="dump file (see docs/dumps.md; default: the built-in SmolLM2 dump)")
        p.add_argument("--config", nargs="*", metavar="KEY=VALUE", help="Config toggles, e.g. mma=exact quant_p=off "
                       "(keys below)")
        p.add_argument("--workers", type=_count, default=1, metavar="N",
                       help="processes that share the warps (results are bitwise the same for any N; "
                            "at most the CPU count)")
        p.add_argument("--json", action="store_true", help="print strict JSON for scripts instead of tables "
                       "(NaN and Inf become null, listed by path under non_finite)")
        p.set_defaults(func=func)
        return p

    def eps(p):
        p.add_argument("--eps", type=float, help="ε, the hot threshold: a tile is recomputed exactly when its share "
                       "of the running row sum exceeds ε; < 0 makes every tile exact (default: the config's, 0.005)")

    def selection(p):
        p.add_argument("--rows", help="query rows: A:B (half-open), a,b,c or one index (default: all)")
        p.add_argument("--heads", help="query heads: A:B (half-open), a,b,c or one index (default: all)")

    p = study("scan", "every (row, head) pair vs float64: cosines, relative L2, hot share", cmd_scan)
    eps(p)
    selection(p)
    p = study("worst", "the worst pairs with hot tiles, cold mass and cold-output norm", cmd_worst, _WORST_COLUMNS)
    p.add_argument("-n", type=_count, default=20, help="how many pairs to show, lowest cosine first")
    eps(p)
    selection(p)
    p = study("pair", "the diagnostic table and per-tile trace of one (row, head) pair", cmd_pair, _TRACE_COLUMNS)
    p.add_argument("--row", type=int, required=True, help="query row (index into the dump's Q rows)")
    p.add_argument("--head", type=int, required=True, help="query head")
    eps(p)
    p.add_argument("--plot", default="apa_pair.png", help="PNG of per-tile mass and contribution ('' for none)")
    p = study("attribute", "mean cosine of the worst pairs with one quantization at a time", cmd_attribute,
              _attribute_epilog())
    p.add_argument("--worst", type=_count, default=20, metavar="N",
                   help="how many lowest-cosine pairs (under --config) to rerun per variant")
    eps(p)
    p = study("headroom", "how close pass 2's FP16 scores and output come to overflow (65504)", cmd_headroom,
              _HEADROOM_NOTES)
    eps(p)
    selection(p)
    p = study("sweep", "hot share and cosines per ε", cmd_sweep)
    p.add_argument("--eps", type=float, nargs="+", default=[-1, 0.001, 0.002, 0.005, 0.01, 0.05, 1e9],
                   help="ε values, one run each (< 0: every tile exact; 1e9: pure FP4)")
    selection(p)
    p.add_argument("--plot", default="apa_sweep.png", help="PNG of hot share and min cosine per ε ('' for none)")

    p = sub.add_parser("synth", help="write a synthetic dump", formatter_class=_Help,
                       description="write a synthetic dump with a sink, RoPE locality and diffuse heads "
                                   "(apa_emu/study/synth.py)")
    p.add_argument("out", help="dump file to write (a new path or a regular file, replaced whole)")
    p.add_argument("--n", type=_count, default=512, help="query rows (the last n positions)")
    p.add_argument("--kv", type=_count, default=4096, help="keys")
    p.add_argument("--heads", type=_count, default=24, help="query heads")
    p.add_argument("--kv-heads", type=_count, default=8, help="KV heads (query heads must be a multiple)")
    p.add_argument("--d", type=int, default=128, choices=HEAD_DIMS, help="head dim")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("smollm2", help="run SmolLM2-135M on a text and write dumps of chosen layers (extra: models)",
                       formatter_class=_Help,
                       description="run SmolLM2-135M-Instruct (float32 NumPy on the CPU) over a text and write "
                                   "one dump per layer; 8192 tokens take about 3 CPU-minutes")
    p.add_argument("out_dir", help="folder for the dumps (created if missing)")
    p.add_argument("--text", help="a UTF-8 text file (default: the bundled sample, Alice in Wonderland I–IV)")
    p.add_argument("--layers", type=int, nargs="+", default=[14], help="layers to dump (0..29)")
    p.add_argument("--n", type=_count, default=512, help="query rows per dump (the last n positions)")
    p.add_argument("--max-tokens", type=_count, default=2048,
                   help="keys per dump: the text's first N tokens (at most 8192, the model's context)")
    p.set_defaults(func=cmd_smollm2)
    return ap


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def _detach_stdout() -> None:
    """Point a failed standard output at /dev/null, so that the interpreter's last flush at exit does
    not print a second error."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already reported in one line
        return int(done.code or 0)
    previous = _CTRL_C.arm()
    try:
        if "workers" in args:
            args.workers = _workers(args.workers)
        args.func(args)
        flush()
        if _CTRL_C.hit:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("apa: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OutputError as exc:
        _detach_stdout()
        print(f"apa: error: cannot write the output: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (ValueError, OSError, ImportError, OverflowError) as exc:
        print(f"apa: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
