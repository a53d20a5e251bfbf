"""The ``apa`` command: studies on attention dumps (scan, worst, pair, attribute, sweep) and dump makers.

Argument parsing and dispatch; ``scan`` computes, ``report`` prints tables or JSON, ``plots`` draws.
One clear line and a non-zero exit on any error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..config import CHOICES, Config
from ..trace import VISIT_FIELDS
from .check import SCHEDULES, check_dump, check_generated, require_gpu
from .chunked import chunked_study
from .dump import HEAD_DIMS, builtin_dump_path, read_dump
from .engine import BACKENDS, select_engine
from .plots import plot_heatmap, plot_pair, plot_sweep
from .report import NUMBA_WAIT, OutputError, emit, flush, progress_bar, say, table
from .scan import (ATTRIBUTE_VARIANTS, CPU_WORST, F16_MAX, Job, Pairs, Scan, attribute_jobs, headroom_jobs, pair,
                   scan_jobs, sweep_jobs, worst_jobs)

EXIT_DIVERGED = 1  # apa check: the kernel and the emulator differ
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
DUMP_SUFFIX = ".apadump"
# What the progress bar says while the first step is slow
WAITS = {"cpu": NUMBA_WAIT, "gpu": "the first run builds the kernel with nvcc, a minute or two"}


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


def _dump_paths(args) -> list[Path]:
    """The dump files named, a folder standing for its *.apadump files (the built-in dump if none)."""
    if not args.dumps:
        return [builtin_dump_path()]
    paths = []
    for text in args.dumps:
        path = Path(text)
        if path.is_dir():
            found = sorted(p for p in path.glob(f"*{DUMP_SUFFIX}") if not p.is_dir())
            if not found:
                raise ValueError(f"{path}: a folder with no {DUMP_SUFFIX} file")
            paths += found
        else:
            paths.append(path)
    return paths


def _jobs(args):
    """Each dump with its selected pairs (--rows, --heads where the command has them)."""
    paths = _dump_paths(args)
    jobs = []
    for path in paths:
        dump = read_dump(path)
        try:
            jobs.append(Job(dump, _pairs(args, dump), path.name))
        except ValueError as e:
            raise ValueError(f"{path.name}: {e}" if len(paths) > 1 else str(e)) from None
    return jobs


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
    return Pairs.select(dump.n, dump.nh, _parse_list(getattr(args, "rows", None), "--rows"),
                        _parse_list(getattr(args, "heads", None), "--heads"))


def _devices(text: str) -> tuple[int, ...]:
    try:
        devices = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU numbers like 0,1, got {text!r}") from None
    if min(devices) < 0:
        raise argparse.ArgumentTypeError(f"GPU numbers are at least 0, got {text!r}")
    return devices


def _engine(args, cfg: Config, dims):
    """The engine of the command, chosen once; a fallback of --backend auto is said in one line."""
    engine = select_engine(args.backend, [cfg], dims, workers=args.workers,
                           devices=getattr(args, "devices", None) or ())
    if engine.note:
        print(f"apa: note: {engine.note}", file=sys.stderr)
    return engine


class _CtrlC:
    """SIGINT as KeyboardInterrupt in the main process only: forked workers inherit the handler and let
    Ctrl-C pass (the pool's exit ends them; their tracebacks would bury the one line).

    Python prints and swallows an exception raised in a finalizer, and the handler may run inside
    one: the signal is remembered too, and the next progress step raises it."""

    def __init__(self):
        self.pid, self.hit = os.getpid(), False

    def arm(self):
        self.pid, self.hit = os.getpid(), False
        return signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame):
        if os.getpid() == self.pid:
            self.hit = True
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


def _payload(jobs, cfg: Config, engine, **fields) -> dict:
    paths = [str(job.dump.path) for job in jobs]
    where = dict(dump=paths[0]) if len(paths) == 1 else dict(dumps=paths)
    return dict(**where, config=dataclasses.asdict(cfg), backend=engine.name, **fields)


def _per_dump(jobs, parts) -> list[dict]:
    return [dict(dump=str(job.dump.path), **part) for job, part in zip(jobs, parts)]


def _study(args, compute):
    """The jobs, the config, the engine and ``compute(jobs, cfg, engine, progress)`` run under a
    progress bar."""
    jobs = _jobs(args)
    cfg = _config(args)
    engine = _engine(args, cfg, [job.dump.hd for job in jobs])
    label = f"{args.command} {jobs[0].name if len(jobs) == 1 else f'{len(jobs)} dumps'}"
    with _progress(not args.json, label, WAITS[engine.name]) as prog:
        return jobs, cfg, engine, compute(jobs, cfg, engine, prog)


def _what(jobs) -> str:
    return jobs[0].name if len(jobs) == 1 else f"{len(jobs)} dumps"


def _named(jobs, title: str) -> str:
    return f"{title} {_what(jobs)}"


_CERT_TITLE = "certificate err_bound (§9.7)"
_CERT = ["coverage", "violations", "infinite", "bound_over_err_min", "bound_over_err_median", "bound_over_ref_median"]


def cmd_scan(args):
    jobs, cfg, engine, scans = _study(args, lambda jobs, cfg, engine, prog: scan_jobs(jobs, cfg, engine, progress=prog))
    title = f"{_named(jobs, 'apa scan')} (eps={cfg.eps}, {engine.name})"
    if len(jobs) > 1:
        pooled = Scan.pooled(scans)
        cols = ["dump", "pairs", "hot_share", "pooled_cos", "mean_cos", "min_cos", "below_0_99", "rel_l2_max",
                "max_abs_err", "nonfinite"]
        named = [*((j.name, s) for j, s in zip(jobs, scans)), ("pooled", pooled)]
        rows = [_scan_row(name, s) for name, s in named]
        cert = [[name, *(s.certificate[c] for c in _CERT)] for name, s in named]
        emit(args.json, _payload(jobs, cfg, engine, per_dump=_per_dump(jobs, (s.to_json() for s in scans)),
                                 pooled=pooled.to_json()),
             [table(title, cols, rows), table(_CERT_TITLE, ["dump", *_CERT], cert),
              table("per-pair cosine, pooled", ["bin", "pairs"], pooled.histogram)])
        return
    scan = scans[0]
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
    emit(args.json, _payload(jobs, cfg, engine, **report),
         [table(title, ["metric", "value"], rows), table(_CERT_TITLE, ["metric", "value"], cert_rows),
          table("per-pair cosine", ["bin", "pairs"], scan.histogram)])


def _pair_text(pairs) -> str:
    return " ".join(f"({r}, {h})" for r, h in pairs)


def _scan_row(name, scan) -> list:
    s = scan.summary
    stats = [s.pooled_cos, s.mean_cos, s.min_cos, s.below_0_99, s.rel_l2_max] if s else [None] * 5
    return [name, len(scan.pairs), scan.hot_share, *stats, scan.errors()["max_abs_err"], int((~scan.finite).sum())]


def cmd_worst(args):
    jobs, cfg, engine, (_, diags) = _study(args, lambda jobs, cfg, engine, prog: worst_jobs(
        jobs, cfg, args.n, engine, progress=prog))
    many = len(jobs) > 1
    records = [dict(dump=jobs[j].name, **d.to_json()) if many else d.to_json() for j, d in diags]
    cols = ["dump"] * many + ["row", "head", "cos", "rel_l2", "hot_tiles", "tiles", "cold_mass_fp4", "cold_mass_f64",
                              "cold_out_rel", "max_qk", "max_o16", "overflow"]
    emit(args.json, _payload(jobs, cfg, engine, worst=records),
         [table(f"{_named(jobs, 'apa worst')}: {len(diags)} lowest-cosine pairs", cols,
                [[r[c] for c in cols] for r in records])])


def cmd_pair(args):
    dump, path = _load(args)
    cfg = _config(args)
    jobs = [Job(dump, Pairs.select(dump.n, dump.nh, [args.row], [args.head], names=("--row", "--head")), path.name)]
    engine = _engine(args, cfg, [dump.hd])  # after the checks: a wrong --row is the one line
    info = pair(dump, cfg, args.row, args.head, backend=engine)
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
    visit_cols = ["visit", *VISIT_FIELDS]
    png = None
    if args.plot:
        png = plot_pair(info, args.plot, f"{path.name} row {args.row} head {args.head}")
    payload = _payload(jobs, cfg, engine, row=args.row, head=args.head, **info.to_json(), plot=png)
    emit(args.json, payload, [table(f"apa pair {path.name} row {args.row} head {args.head}", ["metric", "value"], summary),
                              table("pass-1 trace of its warp (this row)", visit_cols,
                                    [[getattr(v, c) for c in visit_cols] for v in info.visits])])
    if png and not args.json:
        say(f"plot: {png}")


_STATS = ["pairs", "mean_cos", "min_cos", "below_0_999", "nonfinite"]
_SEED_STATS = ["engine", "mean_cos", "min_cos"]  # the seed column of apa attribute (its JSON has them all)


def cmd_attribute(args):
    jobs, cfg, engine, att = _study(args, lambda jobs, cfg, engine, prog: attribute_jobs(
        jobs, cfg, engine, worst=args.worst, cpu_worst=args.cpu_worst, buckets=args.buckets, workers=args.workers,
        progress=prog, seed=args.seed))
    many = len(jobs) > 1

    def seed_cells(name, s):
        if not args.seed:
            return []
        if s is None:
            return ["-"] * len(_SEED_STATS)
        return [s.engine + " (sm90)" * (name in att.seed_on_sm90), *(getattr(s, c) for c in _SEED_STATS[1:])]

    rows = []
    for name, pooled in att.pooled.items():
        for job, t in zip(jobs, att.tables):
            s = t.variants[name]
            rows.append([name, *[job.name] * many, s.engine, *(getattr(s, c) for c in _STATS),
                         *seed_cells(name, t.seed.get(name))])
        if many:
            rows.append([name, "pooled", pooled.engine, *(getattr(pooled, c) for c in _STATS),
                         *seed_cells(name, att.pooled_seed.get(name))])
    scope = "every pair" if args.worst is None else f"the {args.worst} lowest-cosine pairs{' of each dump' * many}"
    slow = any(s.engine != engine.name for s in att.pooled.values())
    note = "; the variants the kernel lacks on the CPU emulator, over the lowest-cosine pairs" if slow else ""
    seed_note = ("; seed: the variant on the seed's arithmetic (--config preset=seed; (sm90): on the sm90 MMA model, "
                 "the seed's FP4 MMA needs every operand quantized)") if args.seed else ""
    tables = [table(f"{_named(jobs, 'apa attribute')} ({engine.name}): cosines of {scope} under each variant{note}"
                    f"{seed_note}", ["variant", *["dump"] * many, "engine", *_STATS,
                                     *([f"seed {c}" for c in _SEED_STATS] if args.seed else [])], rows)]
    for job, t in zip(jobs, att.tables):
        b = t.breakdown
        tables += [table(f"{job.name}, {cfg_name(cfg)}: by query head", ["head", *_STATS],
                         [[h, *(st[c] for c in _STATS)] for h, st in b.heads]),
                   table(f"{job.name}, {cfg_name(cfg)}: by query position", ["positions", *_STATS],
                         [[lab, *(st[c] for c in _STATS)] for lab, st in b.buckets])]
    png = plot_heatmap({j.name: t.breakdown for j, t in zip(jobs, att.tables)}, args.plot,
                       _what(jobs)) if args.plot else None
    fields = dict(worst=args.worst, cpu_worst=args.cpu_worst, plot=png, seed_on_sm90=att.seed_on_sm90)
    if many:
        payload = _payload(jobs, cfg, engine, **fields, per_dump=_per_dump(jobs, (t.to_json() for t in att.tables)),
                           pooled={name: dataclasses.asdict(s) for name, s in att.pooled.items()},
                           pooled_seed={name: dataclasses.asdict(s) for name, s in att.pooled_seed.items()})
    else:
        payload = _payload(jobs, cfg, engine, **fields, **att.tables[0].to_json())
    emit(args.json, payload, tables)
    if png and not args.json:
        say(f"plot: {png}")


def cfg_name(cfg: Config) -> str:
    """The config as the toggles that differ from the defaults."""
    changed = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(Config)
               if getattr(cfg, f.name) != getattr(Config(), f.name)]
    return " ".join(changed) or "default config"


def cmd_sweep(args):
    for eps in args.eps:
        Config(eps=eps)  # each ε is checked up front, before any run
    jobs, cfg, engine, (per_dump, pooled) = _study(args, lambda jobs, cfg, engine, prog: sweep_jobs(
        jobs, cfg, args.eps, engine, progress=prog))
    many = len(jobs) > 1
    series = {job.name: rows for job, rows in zip(jobs, per_dump)} | ({"pooled": pooled} if many else {})
    png = plot_sweep(series, args.plot, _what(jobs)) if args.plot else None
    cols = ["eps", *["dump"] * many, "hot_share", "pass2_tiles", "pooled_cos", "mean_cos", "min_cos", "below_0_999",
            "below_0_9", "nonfinite"]
    rows = [[r.eps, *[name] * many, *(getattr(r, c) for c in cols[1 + many:])]
            for i in range(len(args.eps)) for name, rs in series.items() for r in [rs[i]]]
    if many:
        payload = _payload(jobs, cfg, engine, plot=png, pooled=[r.to_json() for r in pooled],
                           per_dump=_per_dump(jobs, (dict(sweep=[r.to_json() for r in rs]) for rs in per_dump)))
    else:
        payload = _payload(jobs, cfg, engine, sweep=[r.to_json() for r in per_dump[0]], plot=png)
    emit(args.json, payload, [table(f"{_named(jobs, 'apa sweep')} ({engine.name})", cols, rows)])
    if png and not args.json:
        say(f"plot: {png}")


_CHUNKED = ["hot_share", "mean_cos", "min_cos", "below_0_999", "violations"]


def cmd_chunked(args):
    jobs, cfg, engine, reports = _study(args, lambda jobs, cfg, engine, prog: [
        chunked_study(job.dump, cfg, args.chunk, engine, progress=prog) for job in jobs])
    rows = []
    for job, r in zip(jobs, reports):
        frozen = sum(x == "" for head in r.reasons for x in head)
        for side in ("whole", "chunked"):
            got = getattr(r, side)
            rows.append([job.name, side, *((1, "", "") if side == "whole" else (r.chunks, r.restats, frozen)),
                         *(got[c] for c in _CHUNKED)])
    title = (f"{_named(jobs, 'apa chunked')} ({engine.name}, eps={cfg.eps}): whole-prompt prefill against chunks of "
             f"{args.chunk} query rows through a KV state (§5.9), every pair vs float64")
    emit(args.json, _payload(jobs, cfg, engine, per_dump=_per_dump(jobs, (r.to_json() for r in reports))),
         [table(title, ["dump", "prefill", "chunks", "restats", "frozen (chunk, KV head)", *_CHUNKED], rows)])


def cmd_headroom(args):
    jobs, cfg, engine, hs = _study(args, lambda jobs, cfg, engine, prog: headroom_jobs(jobs, cfg, engine,
                                                                                       progress=prog))
    title = f"{_named(jobs, 'apa headroom')}: pass 2's FP16 accumulators, float64 estimates"
    if len(jobs) > 1:
        cols = ["dump", "pairs", "max_qk", "max_qk_at", "qk_over", "max_o16", "max_o16_at", "o16_over", "nonfinite"]
        rows = [[j.name, h.pairs, h.max_qk, h.max_qk_pair, h.qk_over, h.max_o16, h.max_o16_pair, h.o16_over,
                 h.nonfinite] for j, h in zip(jobs, hs)]
        qk, o16 = (max(range(len(hs)), key=lambda i: getattr(hs[i], f)) for f in ("max_qk", "max_o16"))
        rows.append(["pooled", sum(h.pairs for h in hs), hs[qk].max_qk, f"{jobs[qk].name} {hs[qk].max_qk_pair}",
                     sum(h.qk_over for h in hs), hs[o16].max_o16, f"{jobs[o16].name} {hs[o16].max_o16_pair}",
                     sum(h.o16_over for h in hs), sum(h.nonfinite for h in hs)])
        emit(args.json, _payload(jobs, cfg, engine, fp16_max=F16_MAX,
                                 per_dump=_per_dump(jobs, (dict(headroom=h.to_json()) for h in hs))),
             [table(title, cols, rows)])
        return
    h = hs[0]
    rows = [("pairs", h.pairs),
            ("max |q·k| partial sum", h.max_qk), ("  its share of the FP16 max", h.max_qk / F16_MAX),
            ("  at (row, head)", h.max_qk_pair), ("  pairs past the FP16 max", h.qk_over),
            ("max |running O|", h.max_o16), ("  its share of the FP16 max", h.max_o16 / F16_MAX),
            ("  at (row, head)", h.max_o16_pair), ("  pairs past the FP16 max", h.o16_over),
            ("pairs with a non-finite output", h.nonfinite)]
    emit(args.json, _payload(jobs, cfg, engine, fp16_max=F16_MAX, headroom=h.to_json()),
         [table(title, ["metric", "value"], rows)])


def _schedules(args) -> tuple[str, ...]:
    return SCHEDULES if args.schedule == "all" else (args.schedule,)


def cmd_check(args):
    cfg = _config(args)
    if args.hypothesis:
        if args.dumps or args.warps or args.config:
            raise ValueError("--hypothesis checks generated problems and configs: give it no dump, --warps or --config")
        require_gpu(Config(), ())
        seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        with _progress(True, "check, generated problems", WAITS["gpu"]) as prog:
            div, done = check_generated(args.hypothesis, seed, prog, schedules=_schedules(args))
        summary = f"{done} generated problems and configs (--seed {seed})"
    else:
        paths = _dump_paths(args)
        dumps = [read_dump(p) for p in paths]
        warps = _parse_list(args.warps, "--warps")
        require_gpu(cfg, [d.hd for d in dumps])
        div, done = None, 0
        with _progress(True, "check", WAITS["cpu"]) as prog:
            for path, dump in zip(paths, dumps):
                div, count = check_dump(dump, path.name, cfg, warps, schedules=_schedules(args), workers=args.workers,
                                        progress=prog)
                done += count
                if div:
                    break
        summary = f"{done} warps of {len(dumps)} dump{'s' * (len(dumps) > 1)} under {cfg_name(cfg)}"
    names = _schedules(args)
    summary += f", {' and '.join([', '.join(names[:-1]), names[-1]] if len(names) > 1 else names)} schedule"
    summary += "s" * (len(names) > 1)
    if div:
        for line in div.lines():
            say(line)
        return EXIT_DIVERGED
    say(f"apa check: the kernel equals the emulator bitwise (output, hot masks, every trace field) on {summary}")
    return 0


def cmd_synth(args):
    from .dump import write_dump
    from .synth import synthetic

    d = synthetic(args.n, args.kv, args.heads, args.kv_heads, args.d, seed=args.seed)
    say(str(write_dump(args.out, d.q, d.k, d.v, d.q_offset)))


def _model_dumps(module: str, label: str, wait: str):
    """The command that runs a real model (apa_emu.study.``module``) over a text and writes its dumps."""
    def command(args):
        make_dumps = importlib.import_module(f".{module}", __package__).make_dumps
        with _progress(True, label, wait) as prog:
            paths = make_dumps(Path(args.text) if args.text else None, args.layers, args.n, args.out_dir,
                               args.max_tokens, progress=prog)
        for p in paths:
            say(str(p))
    return command


cmd_smollm2 = _model_dumps("smollm2", "SmolLM2 layers", "loading the model, about 5 s")
cmd_gemma3 = _model_dumps("gemma3", "Gemma 3 layers", "loading the model, about 30 s")


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


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


_count = _at_least(1)


def _config_epilog() -> str:
    lines = []
    for f in dataclasses.fields(Config):
        default = getattr(Config(), f.name)
        if isinstance(default, bool):
            accepted, default = "on | off", "on" if default else "off"
        else:
            accepted = " | ".join(CHOICES[f.name]) if f.name in CHOICES else _ACCEPTS[f.name]
        lines.append(f"  {f.name:<12} {accepted:<40} default {'none' if default is None else default}")
    return ("--config keys (docs/numerics.md §1–§9 says what each one does; a first preset=seed starts from the "
            "seed's arithmetic, §12):\n" + "\n".join(lines))


# What --config accepts for the keys that are neither on/off nor a fixed set of words.
_ACCEPTS = {"eps": "a number (< 0: every tile exact)", "delta": "a number >= 0", "tau": "an integer in 0..8",
            "q_terms": "1 | 2", "scale": "a number > 0 | none (1/sqrt(d))"}

_SCAN_CERTIFICATE = """certificate (docs/numerics.md §9.7), over the finite pairs: err_bound, the engine's upper
bound of |out − exact| of each pair, against its measured error |out − float64 attention|:
  coverage               share of the pairs whose bound is at least the error: anything below 1 is a
                         bug of the bound or of the engine
  violations             pairs whose bound is below the error (the first few named)
  infinite               pairs whose bound is +inf: pass 2's FP16 scores could overflow (§8.7)
  bound_over_err_min     bound / error, least and median over the pairs with an error
  bound_over_err_median  (at least 1; the larger, the looser the bound)
  bound_over_ref_median  bound / |float64 attention|, median: the bound as a relative error
"""

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
  tv      hot_test=output: the tile's row sum weighted by ‖v‖/vg (P̂·ν); 0 under the mass test
  lv      hot_test=output: running sum of tv, the output test's λ; 0 under the mass test
"""


_HEADROOM_NOTES = """Pass 2 accumulates the scores q·k and the output O in FP16 (docs/numerics.md §8.1, §8.5): past
65504 they turn into Inf or NaN. Per pair, in float64 on the dump's FP16 inputs:
  max |q·k|        largest partial sum of the score chain, after each 16-channel step, over the keys
  max |running O|  largest |O| after each 16-key step of the pair's hot tiles, in pass 2's running-max
                   frame (before FP16 rounding): large V over many flat hot keys drives it up
"""


def _attribute_epilog() -> str:
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

    def study(name, helptext, func, epilog="", many=True):
        p = sub.add_parser(name, help=helptext, description=helptext, formatter_class=_Help,
                           epilog="\n\n".join(x for x in (epilog, _config_epilog()) if x))
        if many:
            p.add_argument("dumps", nargs="*", metavar="DUMP",
                           help="dump files (see docs/dumps.md) or folders of *.apadump files; several give one "
                                "row per dump and a pooled row (default: the built-in SmolLM2 dump)")
        else:
            p.add_argument("dump", nargs="?", help="dump file (see docs/dumps.md; default: the built-in SmolLM2 dump)")
        p.add_argument("--config", nargs="*", metavar="KEY=VALUE", help="Config toggles, e.g. mma=exact quant_p=off "
                       "(keys below)")
        p.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="gpu: the CUDA kernel (apa_gpu) with the float64 reference and metrics on the GPU; cpu: "
                            "the emulator; auto: the GPU when it is there and implements the config (mma=sm90, head "
                            "dim 64, 128 or 256), else the CPU, saying why in one line. Both give the same numbers")
        if many:
            p.add_argument("--devices", type=_devices, metavar="I,J",
                           help="GPUs to share the (dump, KV head) units, one process each, e.g. 0,1 (default: the "
                                "current GPU)")
        p.add_argument("--workers", type=_count, default=1, metavar="N",
                       help="CPU engine: processes that share the warps (results are bitwise the same for any N; "
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

    p = study("scan", "every (row, head) pair vs float64: cosines, relative L2, hot share, the error certificate",
              cmd_scan, _SCAN_CERTIFICATE)
    eps(p)
    selection(p)
    p = study("worst", "the worst pairs with hot tiles, cold mass and cold-output norm", cmd_worst, _WORST_COLUMNS)
    p.add_argument("-n", type=_count, default=20, help="how many pairs to show, lowest cosine first")
    eps(p)
    selection(p)
    p = study("pair", "the diagnostic table and per-tile trace of one (row, head) pair", cmd_pair, _TRACE_COLUMNS,
              many=False)
    p.add_argument("--row", type=int, required=True, help="query row (index into the dump's Q rows)")
    p.add_argument("--head", type=int, required=True, help="query head")
    eps(p)
    p.add_argument("--plot", default="apa_pair.png", help="PNG of per-tile mass and contribution ('' for none)")
    p = study("attribute", "cosines of every pair under each quantization variant and numerics toggle, and where "
              "the error sits (by head and query position)", cmd_attribute, _attribute_epilog())
    p.add_argument("--worst", type=_count, metavar="N",
                   help="rerun only the N lowest-cosine pairs of each dump (under --config) per variant "
                        "(default: every pair)")
    p.add_argument("--cpu-worst", type=_at_least(0), default=CPU_WORST, metavar="N",
                   help="how many of those pairs, lowest cosine first, the variants the GPU kernel lacks "
                        "(mma=exact, mma=sm120, the seed column) rerun on the CPU emulator; 0 leaves them out")
    p.add_argument("--buckets", type=_count, default=8, metavar="N",
                   help="query-position buckets of the breakdown and the heatmap")
    p.add_argument("--plot", default="apa_attribute.png",
                   help="PNG heatmap of min cosine by (head, position bucket) ('' for none)")
    p.add_argument("--seed", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each variant on the seed's arithmetic (Config.seed(), docs/numerics.md §12), "
                        "a column beside ours; the kernel lacks it, so with the GPU it runs on the CPU emulator "
                        "over --cpu-worst pairs")
    eps(p)
    p = study("headroom", "how close pass 2's FP16 scores and output come to overflow (65504)", cmd_headroom,
              _HEADROOM_NOTES)
    eps(p)
    selection(p)
    p = study("sweep", "hot share and cosines per ε", cmd_sweep)
    p.add_argument("--eps", type=float, nargs="+", default=[-1, 0.001, 0.002, 0.005, 0.01, 0.05, 1e9],
                   help="ε values, one run each (< 0: every tile exact; 1e9: pure FP4)")
    selection(p)
    p.add_argument("--plot", default="apa_sweep.png",
                   help="PNG of min cosine against hot share, the accuracy-cost frontier ('' for none)")

    p = study("chunked", "chunked prefill through a KV state against whole-prompt prefill: hot share and cosines",
              cmd_chunked, "Each chunk sees the keys up to its last row; later chunks reuse the first chunk's K "
              "mean and head scales until the context grows 1.125x (numerics.md §5.9).")
    p.add_argument("--chunk", type=_count, default=512, metavar="C", help="query rows per chunk")
    eps(p)

    p = sub.add_parser("check", help="the GPU kernel against the emulator, bitwise (for edits to cuda/)",
                       formatter_class=_Help, epilog=_config_epilog(),
                       description="run the kernel and the emulator on a dump (every warp, or --warps) or on "
                                   "generated problems (--hypothesis N) and compare output, hot masks and every "
                                   "trace field bit for bit. Exit 0 when equal; on a divergence print the first one "
                                   "(stage, warp, tile, field, both values), save a reproducer for "
                                   "python -m apa_gpu.replay, and exit 1")
    p.add_argument("dumps", nargs="*", metavar="DUMP",
                   help="dump files or folders of *.apadump files (default: the built-in SmolLM2 dump)")
    p.add_argument("--warps", help="warps of each KV head to compare: A:B (half-open), a,b,c or one index "
                                   "(default: all; the emulator runs each on the CPU)")
    p.add_argument("--config", nargs="*", metavar="KEY=VALUE", help="Config toggles of the dump check (keys below)")
    p.add_argument("--hypothesis", type=_count, metavar="N",
                   help="check N problems and configs drawn by Hypothesis (apa_gpu/strategies.py) instead of dumps")
    p.add_argument("--seed", type=int, help="Hypothesis seed of --hypothesis (default: a random one, printed)")
    p.add_argument("--schedule", choices=[*SCHEDULES, "all"], default="all",
                   help="kernel launch schedule: one launch per stage (separate), one persistent launch for both "
                        "passes (fused), pass 1 one segment of tiles at a time (bounded, numerics.md §6.7), or all")
    p.add_argument("--workers", type=_count, default=1, metavar="N", help="emulator processes over the warps")
    p.set_defaults(func=cmd_check)

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

    p = sub.add_parser("gemma3", help="run Gemma 3 270M on a text and write dumps of chosen layers (extra: gemma3)",
                       formatter_class=_Help,
                       description="run Gemma 3 270M (PyTorch float32, on CUDA when available) over a text and write "
                                   "one dump per layer; 32768 tokens take about 8 CPU-minutes (4.5 min on 2 idle cores)")
    p.add_argument("out_dir", help="folder for the dumps (created if missing)")
    p.add_argument("--text", help="a UTF-8 text file (default: the bundled sample, all of Alice in Wonderland)")
    p.add_argument("--layers", type=int, nargs="+",
                   help="layers to dump, 0..17 (default: the global layers 5 11 17; the others attend to a 512-key "
                        "window, which the dump does not record)")
    p.add_argument("--n", type=_count, default=512, help="query rows per dump (the last n positions)")
    p.add_argument("--max-tokens", type=_count, default=32768,
                   help="keys per dump: the text's first N tokens (the model was trained to 32768; past it, a warning)")
    p.set_defaults(func=cmd_gemma3)
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
        status = args.func(args) or 0
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
    return status


if __name__ == "__main__":
    sys.exit(main())
