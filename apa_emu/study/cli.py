"""The ``apa`` command: studies on attention dumps (scan, worst, pair, attribute, sweep) and dump makers.

The dispatcher: each command is a module of ``commands`` with its options (``add_arguments``), its
``run`` and its help; this builds the parser from them, runs the one asked for and turns every error
into one clear line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from ..engines import EngineInterrupt
from .commands import (attribute, check, chunked, compare, gemma3, headroom, model, pair, scan, smollm2, sweep, synth,
                       worst)
from . import cluster
from .commands.common import CTRL_C
from .report import OutputError, flush

EXIT_FAILED = 1  # units failed twice on a cluster: the tables hold every other unit's pairs
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
# The commands in the order ``apa --help`` lists them; each is named after its module.
COMMANDS = (scan, worst, pair, attribute, headroom, sweep, compare, model, chunked, check, synth, smollm2, gemma3)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Bad arguments end in one line, like every other error of the command."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a value that starts with '-' and a digit, '.', inf or nan (--heads -1:2, --eps -inf) is a
        # value, to be judged by its option, not an unknown option (no option name starts so)
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d|inf$|infinity$|nan$)", re.IGNORECASE)

    def error(self, message):
        command = self.prog.removeprefix("apa").strip()
        self.exit(EXIT_ERROR, f"apa: error: {command + ': ' if command else ''}{message}\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="apa", formatter_class=_Help,
                 description="APA emulator studies on attention dumps. Every study compares the emulator with "
                             "float64 attention, pair by pair (query row, head).",
                 epilog="The first run compiles the emulator with Numba (about 30 s); later runs reuse the cache.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.__name__.rpartition(".")[2], help=command.HELP, formatter_class=_Help,
                           description=getattr(command, "DESCRIPTION", command.HELP),
                           epilog=getattr(command, "EPILOG", None))
        command.add_arguments(p)
        p.set_defaults(func=command.run)
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
    if sys.stdout is None:  # started with standard output closed: no result could reach anyone
        print("apa: error: standard output is closed; nothing could be written", file=sys.stderr)
        return EXIT_ERROR
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already reported in one line
        return int(done.code or 0)
    except ValueError as exc:  # the options' choices could not be formed (a bad $APA_ENGINES)
        print(f"apa: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    previous = CTRL_C.arm()
    try:
        if "workers" in args:
            args.workers = cluster.within_cpus(args.workers, f"--workers {args.workers}")
        status = args.func(args) or 0
        flush()
        if CTRL_C.hit:
            raise KeyboardInterrupt
        if failed := getattr(args, "failed", None):
            print(f"apa: error: {len(failed)} unit{'s' * (len(failed) > 1)} failed twice, their pairs left out of "
                  f"the report:\n" + "\n".join(f"  {line}" for line in failed), file=sys.stderr)
            return EXIT_FAILED
    except KeyboardInterrupt as exc:
        # the user's Ctrl-C went through CTRL_C's handler; an engine's own raise did not
        if isinstance(exc, EngineInterrupt) and not CTRL_C.hit:
            print(f"apa: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        print("apa: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # a library's sys.exit mid-command: never an exit without a word
        print(f"apa: error: stopped before a verdict: SystemExit({exc.code!r})", file=sys.stderr)
        return exc.code if isinstance(exc.code, int) and exc.code else EXIT_ERROR
    except OutputError as exc:
        _detach_stdout()
        print(f"apa: error: cannot write the output: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except MemoryError as exc:  # a size refused up front, or an allocation NumPy could not make
        print(f"apa: error: out of memory: {_one_line(exc) or 'an allocation failed'}", file=sys.stderr)
        return EXIT_ERROR
    except (ValueError, OSError, ImportError, OverflowError) as exc:
        print(f"apa: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        cluster.closed()  # a local cluster closes while the tables are written; its workers end here
        signal.signal(signal.SIGINT, previous)
    return status


if __name__ == "__main__":
    sys.exit(main())
