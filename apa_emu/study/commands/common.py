"""What the ``apa`` commands share: the options every study takes, the dumps and pairs they name,
the engine, the progress bar with its Ctrl-C, and the head of every JSON report.

It lives with the commands rather than in ``cli``: the commands import it, and ``cli`` imports the
commands, so the dispatcher stays the one module nothing imports (``python -m apa_emu.study.cli``
loads it as ``__main__``, where a second copy would hold a second Ctrl-C state).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import stat
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ...config import CHOICES, Config
from .. import cluster
from ..dump import builtin_dump_path, read_dump
from ..engine import backends, select_engine
from ..files import not_regular
from ..report import progress_bar, say
from ..scan import Job, Pairs

DUMP_SUFFIX = ".apadump"


def at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


count = at_least(1)


def _devices(text: str) -> tuple[int, ...]:
    try:
        devices = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU numbers like 0,1, got {text!r}") from None
    if min(devices) < 0:
        raise argparse.ArgumentTypeError(f"GPU numbers are at least 0, got {text!r}")
    return devices


def _backend(text: str) -> str:
    try:
        names = backends()
    except ValueError as e:  # a bad $APA_ENGINES: said where an engine is chosen, not in --help or synth
        raise argparse.ArgumentTypeError(str(e)) from None
    if text in names or ":" in text:
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, names))} or "
                                     f"module:callable)")


def _backend_names() -> str:
    try:
        return ",".join(backends())
    except ValueError:  # a bad $APA_ENGINES, reported by --backend's parse
        return "auto,cpu"


def study_options(p, many=True, units=True, json=True, dumps=True) -> None:
    """The options of every study: its dumps (where ``dumps``; one only where ``many`` is false),
    --config, the engine and, where ``json``, --json; and where the study's work is ``run_units``'s
    (``units``) and it takes many dumps, --cluster and --devices."""
    if dumps and many:
        p.add_argument("dumps", nargs="*", metavar="DUMP",
                       help="dump files (see docs/dumps.md) or folders of *.apadump files; several give one "
                            "row per dump and a pooled row (default: the built-in SmolLM2 dump)")
    elif dumps:
        p.add_argument("dump", nargs="?", help="dump file (see docs/dumps.md; default: the built-in SmolLM2 dump)")
    p.add_argument("--config", nargs="*", metavar="KEY=VALUE", help="Config toggles, e.g. mma=exact quant_p=off "
                   "(keys below)")
    p.add_argument("--backend", type=_backend, default="auto", metavar="{" + _backend_names() + "}|MODULE:CALLABLE",
                   help="gpu: the CUDA kernel (apa_gpu) with the float64 reference and metrics on the GPU; cpu: "
                        "the emulator; auto: the GPU when it is there and implements the config (mma=sm90, head "
                        "dim 64, 128 or 256), else the CPU, saying why in one line when a GPU is there. Both give "
                        "the same numbers. module:callable: your engine (docs/engines.md); one that returns the "
                        "output alone has no hot tile and an infinite err_bound")
    if many and units:
        p.add_argument("--cluster", type=cluster.parse, metavar="local[:N] | tcp://HOST:PORT",
                       help="run the (dump, KV head) units on Dask (the cluster extra): local starts one worker "
                            "per GPU, or N (default: one per CPU; at most the CPU count, as --workers) on the CPU; tcp://HOST:PORT uses a running "
                            "scheduler whose workers see the dumps at the same paths. Same tables; --json adds "
                            "each worker's units and seconds (default: in this process)")
        p.add_argument("--devices", type=_devices, metavar="I,J",
                       help="GPUs to share the units: --cluster local with one worker on each, e.g. 0,1 "
                            "(default: the current GPU, in this process)")
    p.add_argument("--workers", type=count, default=1, metavar="N",
                   help="CPU engine: processes that share the warps (results are bitwise the same for any N; "
                        "at most the CPU count)")
    if json:
        p.add_argument("--json", action="store_true", help="print strict JSON for scripts instead of tables "
                       "(NaN and Inf become null, listed by path under non_finite)")


def eps(p) -> None:
    p.add_argument("--eps", type=float, help="ε, the hot threshold: a tile is recomputed exactly when its share "
                   "of the running row sum exceeds ε; < 0 makes every tile exact (default: the config's, 0.005)")


def table_outputs(p) -> None:
    """--markdown, --json and --record: where a command that prints tables (compare, model) also puts them."""
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown instead of rich tables")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="also write every number as JSON to the file OUT")
    p.add_argument("--record", metavar="PAGE.md", help="append the tables to the results page PAGE.md as one dated "
                   "section with the command, the machine and the commit (created when new; nothing on it changes)")


def selection(p) -> None:
    p.add_argument("--rows", help="query rows: A:B (half-open), a,b,c or one index (default: all)")
    p.add_argument("--heads", help="query heads: A:B (half-open), a,b,c or one index (default: all)")


# What --config accepts for the keys that are neither on/off nor a fixed set of words.
_ACCEPTS = {"eps": "a number (< 0: every tile exact)", "delta": "a number >= 0", "tau": "an integer in 0..8",
            "q_terms": "1 | 2", "scale": "a number > 0 | none (1/sqrt(d))"}


def config_epilog() -> str:
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


# What the columns and metric rows shared by the study tables mean, for the commands' --help; each
# command builds its COLUMNS from these and its own (columns_epilog). A pair is a (query row, head);
# its output is compared with float64 attention.
_SHARED_COLUMNS = {
    "dump": "the dump file; pooled: the pairs of every dump together",
    "pairs": "the pairs measured",
    "hot_share": "share of the key tiles visited (by the warps holding the pairs) that the hot test sent to "
                 "pass 2, recomputed exactly in FP16: the cost of the accuracy",
    "pooled_cos": "cosine of all the pairs' outputs taken as one vector against float64 attention's",
    "mean_cos": "mean of the pairs' cosines (output against float64 attention)",
    "min_cos": "the lowest pair's cosine",
    "below_0_999": "pairs whose cosine is below 0.999",
    "below_0_99": "pairs whose cosine is below 0.99",
    "below_0_9": "pairs whose cosine is below 0.9",
    "nonfinite": "pairs whose output holds NaN or Inf (an FP16 stage overflowed, see apa headroom --help), left "
                 "out of every cosine",
    "violations": "pairs whose error |out − float64 attention| exceeds the certificate err_bound "
                  "(docs/numerics.md §9.7): anything but 0 is a bug of the bound or of the engine",
}


def shared_columns(*names: str) -> dict[str, str]:
    """The meanings of the shared columns ``names``, to splice into a command's COLUMNS."""
    return {name: _SHARED_COLUMNS[name] for name in names}


def columns_epilog(columns: dict[str, str], title: str = "columns and metrics") -> str:
    """A --help section: each column's name and its meaning, wrapped under it."""
    width = max(map(len, columns)) + 2
    lines = [textwrap.fill(meaning, 110, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2))
             for name, meaning in columns.items()]
    return "\n".join([textwrap.fill(f"{title}:", 110), *lines])


def study_epilog(notes: str = "") -> str:
    """A study's help epilog: its notes, then the --config keys."""
    return "\n\n".join(x for x in (notes, config_epilog()) if x)


def parse_list(text: str | None, what: str):
    """'0:64', '3,5,9' or '7' -> an index array (None if not given). A repeated index is refused: the
    studies would count its pairs once per repeat in the pooled statistics."""
    if text is None:
        return None
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            return np.arange(int(a), int(b))
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected A:B, a comma list or one integer") from None
    repeated = next((x for i, x in enumerate(values) if x in values[:i]), None)
    if repeated is not None:
        raise ValueError(f"{what} {text!r}: {repeated} is repeated (give each index once)")
    return np.array(values)


def load(args):
    path = Path(args.dump) if args.dump else builtin_dump_path()
    check_outputs(args, [path])
    return read_dump(path), path


def dump_paths(args) -> list[Path]:
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


# The options that name a file a command writes: how its messages name it (apa synth's dump is a
# positional argument, named by its path alone) and the suffix its name must end in, if any: a plot is
# PNG bytes whatever its name (plots.save), so a .pdf or .svg name would hold a PNG.
OUTPUT_OPTIONS = {"plot": ("--plot ", ".png"), "json_out": ("--json ", None), "out": ("", None),
                  "record": ("--record ", ".md")}


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # both exist: a link or a second name is the same file too
    except OSError:
        return a.resolve() == b.resolve()


def _unwritable(path: Path) -> str | None:
    """Why files.write_atomically could not write ``path`` (None: it can): it writes through a link,
    into the folder of the link's target, and replaces only a regular file."""
    target = Path(os.path.realpath(path))
    try:
        if not stat.S_ISDIR(os.stat(target.parent).st_mode):
            return f"{target.parent} is not a folder"
    except (FileNotFoundError, NotADirectoryError):
        return f"folder {target.parent} does not exist"
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        return not_regular(mode, path, "replace").strerror
    if not os.access(target.parent, os.W_OK | os.X_OK):
        return f"folder {target.parent} is not writable"
    return None


def check_outputs(args, inputs) -> None:
    """Every file the command writes can be written there, and none is one it reads (``apa pair X
    --plot X`` replaced the dump with a PNG): refused before any work, so that no run ends in a
    failed write with its tables lost. An existing regular file is replaced: naming it asked for that."""
    for option, (flag, suffix) in OUTPUT_OPTIONS.items():
        text = getattr(args, option, None)
        if not text:
            continue
        for path in inputs:
            if _same_file(Path(text), Path(path)):
                raise ValueError(f"{flag}{text}: is also an input of this command ({path}); "
                                 f"refusing to overwrite it")
        why = _unwritable(Path(text))
        if why:
            raise ValueError(f"{flag}{text}: {why}")
        if suffix and Path(text).suffix.lower() != suffix:
            raise ValueError(f"{flag}{text}: the file is written as {suffix[1:].upper()}; give a name ending in "
                             f"{suffix}")


def _pairs(args, dump):
    return Pairs.select(dump.n, dump.nh, parse_list(getattr(args, "rows", None), "--rows"),
                        parse_list(getattr(args, "heads", None), "--heads"))


def _jobs(args):
    """Each dump with its selected pairs (--rows, --heads where the command has them)."""
    paths = dump_paths(args)
    jobs = []
    for path in paths:
        dump = read_dump(path)
        try:
            jobs.append(Job(dump, _pairs(args, dump), path.name))
        except ValueError as e:
            raise ValueError(f"{path.name}: {e}" if len(paths) > 1 else str(e)) from None
    return jobs


def note(line: str) -> None:
    """A line on the standard error that the command goes on past (an engine left out, a warning)."""
    print(f"apa: note: {line}", file=sys.stderr)


def config(args) -> Config:
    cfg = Config.from_overrides(args.config or [])
    value = getattr(args, "eps", None)
    return cfg.replace(eps=value) if isinstance(value, float) else cfg  # sweep's --eps is a list, applied per run


def engine(args, cfg: Config, dims, variants=()):
    """The engine of the command, chosen once for ``cfg`` and the ``variants`` it also runs; a fallback
    of --backend auto is said in one line."""
    chosen = select_engine(args.backend, [cfg, *variants], dims, workers=args.workers,
                           devices=getattr(args, "devices", None) or ())
    if chosen.note:
        print(f"apa: note: {chosen.note}", file=sys.stderr)
    return chosen


class CtrlC:
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


CTRL_C = CtrlC()


@contextmanager
def progress(enabled: bool, label: str, *wait: str):
    with progress_bar(enabled, label, *wait) as bar:
        yield CTRL_C.watch(bar)


def _one_head_dim(jobs, command: str) -> None:
    """A pooled row concatenates the outputs of every dump: refuse a mix of head dims up front,
    before any work, rather than in NumPy's words after all of it."""
    first = jobs[0].dump
    for job in jobs[1:]:
        if job.dump.hd != first.hd:
            raise ValueError(f"{first.path} has head dim {first.hd} and {job.dump.path} has {job.dump.hd}: "
                             f"apa {command} pools their pairs, which needs dumps of one head dim (run them separately)")


def _cluster_spec(args) -> cluster.Spec | None:
    """The cluster --cluster or --devices names (None: the units run in this process)."""
    spec, devices = getattr(args, "cluster", None), getattr(args, "devices", None)
    if spec and devices:
        raise ValueError("--devices is --cluster local on those GPUs: give one of them")
    spec = spec or (cluster.on_devices(devices) if devices else None)
    if spec and args.workers > 1:
        raise ValueError(f"--workers shares a unit's warps between processes of this one; with "
                         f"{'--devices' if devices else '--cluster'} the units go to the cluster's workers "
                         f"(leave --workers out)")
    return spec


def run_study(args, compute, *, pooled: bool = False, variants=None):
    """The jobs, the config, the engine and ``compute(jobs, cfg, engine, progress=..., where=...)`` run
    under a progress bar, its units ``where``: None, in this process, or the Runner of the cluster of
    --cluster (its per-worker timing then in ``args.timing``, for ``payload``, and the units that
    failed twice, whose pairs the tables leave out, in ``args.failed``). ``pooled``: the command pools
    the pairs of all dumps, which needs one head dim. ``variants(cfg)``: the configs the command runs
    besides cfg, which the engine must implement too."""
    check_outputs(args, dump_paths(args))
    spec = _cluster_spec(args)
    jobs = _jobs(args)
    if pooled:
        _one_head_dim(jobs, args.command)
    cfg = config(args)
    chosen = engine(args, cfg, [job.dump.hd for job in jobs], variants(cfg) if variants else ())
    label = f"{args.command} {jobs[0].name if len(jobs) == 1 else f'{len(jobs)} dumps'}"
    with progress(not args.json, label, chosen.wait) as prog:
        if spec is None:
            return jobs, cfg, chosen, compute(jobs, cfg, chosen, progress=prog, where=None)
        with cluster.cluster(spec, chosen, warm=(jobs[0].dump.hd, cfg), close_later=True) as where:
            result = compute(jobs, cfg, chosen, progress=prog, where=where)
    args.timing, args.failed = where.report(), where.failed
    return jobs, cfg, chosen, result


def payload(args, jobs, cfg: Config, engine, **fields) -> dict:
    """The head of a study's JSON; on a cluster, its name and each worker's units and seconds too."""
    paths = [str(job.dump.path) for job in jobs]
    where = dict(dump=paths[0]) if len(paths) == 1 else dict(dumps=paths)
    timing = getattr(args, "timing", None)
    return dict(**where, config=dataclasses.asdict(cfg), backend=engine.name, **fields,
                **(dict(cluster=timing) if timing else {}))


def per_dump(jobs, parts) -> list[dict]:
    return [dict(dump=str(job.dump.path), **part) for job, part in zip(jobs, parts)]


def what(jobs) -> str:
    return jobs[0].name if len(jobs) == 1 else f"{len(jobs)} dumps"


def named(jobs, title: str) -> str:
    return f"{title} {what(jobs)}"


def model_options(p, sample: str, layers_help: str, layers, max_tokens: int, context: str) -> None:
    """The options of a command that runs a real model over a text: where its dumps go, the text
    (default: the ``sample`` it ships), which layers, how many query rows and keys."""
    p.add_argument("out_dir", help="folder for the dumps (created if missing)")
    p.add_argument("--text", help=f"a UTF-8 text file (default: the bundled sample, {sample})")
    p.add_argument("--layers", type=int, nargs="+", default=layers, help=layers_help)
    p.add_argument("--n", type=count, default=512, help="query rows per dump (the last n positions)")
    p.add_argument("--max-tokens", type=count, default=max_tokens,
                   help=f"keys per dump: the text's first N tokens ({context})")


def model_dumps(args, module: str, label: str, wait: str) -> None:
    """Run a real model (apa_emu.study.``module``, imported only now: it needs the models extra) over
    a text and name the dumps it writes."""
    make_dumps = importlib.import_module(f"..{module}", __package__).make_dumps
    with progress(True, label, wait) as prog:
        paths = make_dumps(Path(args.text) if args.text else None, args.layers, args.n, args.out_dir,
                           args.max_tokens, progress=prog)
    for p in paths:
        say(str(p))
