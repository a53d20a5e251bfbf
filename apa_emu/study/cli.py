"""The ``apa`` command: studies on attention dumps (scan, worst, pair, attribute, sweep) and dump makers.

Argument parsing and dispatch; ``scan`` computes, ``report`` prints tables or JSON, ``plots`` draws.
One clear line and a non-zero exit on any error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ..config import Config
from .dump import DumpError, builtin_dump_path, read_dump
from .report import emit, progress_bar, table

EXIT_ERROR = 2


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
    if isinstance(eps, float):  # sweep's --eps is a list, applied per run
        cfg = cfg.replace(eps=eps)
    return cfg


def _pairs(args, dump):
    from .scan import Pairs

    return Pairs.select(dump.q.shape[0], dump.q.shape[1], _parse_list(args.rows, "--rows"),
                        _parse_list(args.heads, "--heads"))


def cmd_scan(args):
    from .scan import run_pairs

    dump, path = _load(args)
    cfg = _config(args)
    pairs = _pairs(args, dump)
    with progress_bar(not args.json, f"scan {path.name}") as prog:
        scan = run_pairs(dump, cfg, pairs, workers=args.workers, progress=prog)
    s = scan.summary.as_dict()
    payload = dict(dump=str(path), config=cfg.__dict__, summary=s, histogram=scan.histogram)
    rows = [(k, v) for k, v in s.items()]
    emit(args.json, payload, [table(f"apa scan {path.name} (eps={cfg.eps})", ["metric", "value"], rows),
                              table("per-pair cosine", ["bin", "pairs"], scan.histogram)])


def cmd_worst(args):
    from .scan import worst

    dump, path = _load(args)
    cfg = _config(args)
    with progress_bar(not args.json, f"worst {path.name}") as prog:
        scan, diags = worst(dump, cfg, args.n, pairs=_pairs(args, dump), workers=args.workers, progress=prog)
    records = [d.to_json() for d in diags]
    cols = ["row", "head", "cos", "rel_l2", "hot_tiles", "tiles", "cold_mass_fp4", "cold_mass_f64", "cold_out_rel"]
    emit(args.json, dict(dump=str(path), config=cfg.__dict__, worst=records),
         [table(f"apa worst {path.name}: {len(diags)} lowest-cosine pairs", cols, [[r[c] for c in cols] for r in records])])


def cmd_pair(args):
    from .plots import plot_pair
    from .scan import pair

    dump, path = _load(args)
    cfg = _config(args)
    info = pair(dump, cfg, args.row, args.head)
    d = info.diag
    summary = [
        ("cosine", d.cos), ("relative L2", d.rel_l2),
        ("top tile / its mass", f"{info.top_tile} / {info.top_tile_mass:.6f}"),
        ("hot tiles / tiles", f"{d.hot_tiles} / {d.tiles}"), ("hot mass (float64)", info.hot_mass),
        ("cold mass FP4 estimate / float64", f"{d.cold_mass_fp4:.6f} / {d.cold_mass_f64:.6f}"),
        ("|ref|", info.ref_norm), ("|hot part of ref|", info.hot_norm), ("|cold part of ref|", info.cold_norm),
        ("|out|", info.out_norm),
    ]
    visit_cols = ["visit", "tile", "hot", "c", "m", "tl", "la", "lc"]
    png = None
    if args.plot:
        png = plot_pair(info, args.plot, f"{path.name} row {args.row} head {args.head}")
    payload = dict(dump=str(path), row=args.row, head=args.head, **info.to_json(), plot=png)
    emit(args.json, payload, [table(f"apa pair {path.name} row {args.row} head {args.head}", ["metric", "value"], summary),
                              table("pass-1 trace of its warp (this row)", visit_cols,
                                    [[getattr(v, c) for c in visit_cols] for v in info.visits])])
    if png and not args.json:
        print(f"plot: {png}")


def cmd_attribute(args):
    from .scan import attribute

    dump, path = _load(args)
    cfg = _config(args)
    with progress_bar(not args.json, f"attribute {path.name}") as prog:
        result = attribute(dump, cfg, args.worst, workers=args.workers, progress=prog)
    rows = [(name, r.mean_cos, r.min_cos) for name, r in result.variants.items()]
    emit(args.json, dict(dump=str(path), config=cfg.__dict__, worst=args.worst, **result.to_json()),
         [table(f"apa attribute {path.name}: mean cosine of the {args.worst} worst pairs",
                ["variant", "mean_cos", "min_cos"], rows)])


def cmd_sweep(args):
    from .plots import plot_sweep
    from .scan import sweep

    dump, path = _load(args)
    cfg = _config(args)
    with progress_bar(not args.json, f"sweep {path.name}") as prog:
        rows = sweep(dump, cfg, args.eps, pairs=_pairs(args, dump), workers=args.workers, progress=prog)
    png = plot_sweep(rows, args.plot, path.name) if args.plot else None
    records = [r.to_json() for r in rows]
    cols = ["eps", "hot_share", "pooled_cos", "mean_cos", "min_cos", "below_0_9"]
    emit(args.json, dict(dump=str(path), sweep=records, plot=png),
         [table(f"apa sweep {path.name}", cols, [[r[c] for c in cols] for r in records])])
    if png and not args.json:
        print(f"plot: {png}")


def cmd_synth(args):
    from .dump import write_dump
    from .synth import synthetic

    d = synthetic(args.n, args.kv, args.heads, args.kv_heads, args.d, seed=args.seed)
    path = write_dump(args.out, d.q, d.k, d.v, d.q_offset)
    print(path)


def cmd_smollm2(args):
    from .smollm2 import make_dumps

    text = Path(args.text).read_text() if args.text else None
    for p in make_dumps(text, args.layers, args.n, args.out_dir, args.max_tokens):
        print(p)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="apa", description="APA emulator studies on attention dumps.")
    sub = ap.add_subparsers(dest="command", required=True)

    def study(name, helptext, func, dump_optional=False):
        p = sub.add_parser(name, help=helptext, description=helptext)
        if dump_optional:
            p.add_argument("dump", nargs="?", help="dump file (default: the built-in SmolLM2 dump)")
        else:
            p.add_argument("dump", help="dump file (the seed's format; see docs/dumps.md)")
        p.add_argument("--config", nargs="*", metavar="KEY=VALUE", help="Config toggles, e.g. mma=exact quant_p=off")
        p.add_argument("--workers", type=int, default=1, help="processes over warps (results do not change)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    p = study("scan", "every (row, head) pair vs float64: cosines, relative L2, hot share", cmd_scan, True)
    p.add_argument("--eps", type=float)
    p.add_argument("--rows", help="query rows, A:B or a,b,c")
    p.add_argument("--heads", help="query heads, A:B or a,b,c")
    p = study("worst", "the worst pairs with hot tiles, cold mass and cold-output norm", cmd_worst, True)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("--eps", type=float)
    p.add_argument("--rows")
    p.add_argument("--heads")
    p = study("pair", "the diagnostic table and per-tile trace of one (row, head) pair", cmd_pair, True)
    p.add_argument("--row", type=int, required=True)
    p.add_argument("--head", type=int, required=True)
    p.add_argument("--eps", type=float)
    p.add_argument("--plot", default="apa_pair.png", help="PNG of per-tile mass and contribution ('' for none)")
    p = study("attribute", "mean cosine of the worst pairs with one quantization at a time", cmd_attribute, True)
    p.add_argument("--worst", type=int, default=20)
    p.add_argument("--eps", type=float)
    p = study("sweep", "hot share and cosines per ε", cmd_sweep, True)
    p.add_argument("--eps", type=float, nargs="+", default=[-1, 0.001, 0.002, 0.005, 0.01, 0.05, 1e9])
    p.add_argument("--rows")
    p.add_argument("--heads")
    p.add_argument("--plot", default="apa_sweep.png", help="PNG of hot share and min cosine per ε ('' for none)")

    p = sub.add_parser("synth", help="write a synthetic dump")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--kv", type=int, default=4096)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("smollm2", help="run SmolLM2-135M on a text and write dumps of chosen layers (extra: models)")
    p.add_argument("out_dir")
    p.add_argument("--text", help="a UTF-8 text file (default: the bundled sample)")
    p.add_argument("--layers", type=int, nargs="+", default=[14])
    p.add_argument("--n", type=int, default=512, help="query rows per dump (the last n positions)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.set_defaults(func=cmd_smollm2)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (DumpError, ValueError, FileNotFoundError, ImportError) as exc:
        print(f"apa {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
