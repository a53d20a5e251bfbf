"""``apa check``: an engine against the emulator (by default the GPU kernel, bitwise) on dumps, on
generated problems, or on one replayed problem; the comparison itself is the library's ``check``."""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

from ...compare import MAX_REL_L2, MODES, rel_l2_bound, resolve_mode
from ... import peers
from ...engines import CpuEngine
from ...peers import APA
from .. import peer_check
from ..check import KERNEL, check_dump, check_generated, kernel_schedules, replay, require
from ..dump import read_dump
from ..report import cfg_name, say
from . import common

EXIT_DIVERGED = 1  # the engine and the emulator differ (beyond the tolerance, in tolerance mode)
HELP = "an engine against the emulator: the GPU kernel bitwise (for edits to cuda/), or your own (--engine)"
DESCRIPTION = ("run an engine and the emulator on a dump (every warp, or --warps), on generated problems "
               "(--hypothesis N) or on one problem a failure printed (--repro) and compare them: bitwise (output, "
               "hot masks, every trace field the engine returns) when the engine claims bit-exactness, else in "
               "tolerance (ULP distances, relative L2 and cosine per pair, and where they concentrate). Exit 0 when "
               "they agree; else print the first divergence or the report, and the one command that replays it, "
               "and exit 1. The last line is the verdict: PASS or FAIL, with how many passed and failed. An engine "
               "that raises or exits (SystemExit included) is an error of one line, exit 2. docs/engines.md says "
               "how to wrap a kernel as an engine. An engine of a peer kernel, such as sageattention, is compared with its "
               "own recipe (apa_emu.peers) instead of the emulator, bitwise, on its output: a divergence names the "
               "first differing (row, head), the kernel's query and key blocks there, and both values")
EPILOG = common.config_epilog()


def add_arguments(p) -> None:
    p.add_argument("dumps", nargs="*", metavar="DUMP",
                   help="dump files or folders of *.apadump files (default: the built-in SmolLM2 dump). An engine "
                        "of a peer kernel (--engine sageattention: causal, equal lengths) gets each dump's query "
                        "padded in front with q_offset rows of zeros and the keys up to the last query, and only "
                        "the dump's own rows are compared")
    p.add_argument("--engine", default=KERNEL, metavar="NAME",
                   help="the engine to check: a registered name or module:callable (a function with "
                        "apa_emu.attention's signature, or an Engine class)")
    p.add_argument("--mode", choices=MODES, default="auto",
                   help="bitwise, tolerance, or auto: bitwise when the engine claims bit-exactness")
    p.add_argument("--max-rel-l2", type=_bound, default=MAX_REL_L2, metavar="X",
                   help="tolerance mode: the largest relative L2 distance of a pair's output to the emulator's "
                        "(a finite number >= 0)")
    p.add_argument("--warps", help="warps of each KV head to compare: A:B (half-open), a,b,c or one index "
                                   "(default: all; the emulator runs each on the CPU)")
    p.add_argument("--config", nargs="*", metavar="KEY=VALUE",
                   help="Config toggles of the dump check, on top of the config the engine claims (keys below)")
    p.add_argument("--hypothesis", type=common.count, metavar="N",
                   help="check N problems and configs drawn by Hypothesis (apa_emu/strategies.py) instead of dumps; "
                        "Hypothesis keeps no example database and its caches in a temporary folder, removed "
                        "after the run, or in $HYPOTHESIS_STORAGE_DIRECTORY where that is set")
    p.add_argument("--seed", type=int, help="Hypothesis seed of --hypothesis (default: a random one, printed)")
    p.add_argument("--repro", metavar="JSON", help="replay the one check a failure printed")
    p.add_argument("--schedule", choices=[*kernel_schedules(), "all"], default="all",
                   help="kernel launch schedule: one launch per stage (separate), one persistent launch for both "
                        "passes (fused), pass 1 one segment of tiles at a time (bounded, numerics.md §6.7), or all")
    p.add_argument("--workers", type=common.count, default=1, metavar="N", help="emulator processes over the warps")


def _bound(text: str) -> float:
    try:
        return rel_l2_bound(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None


def _schedules(args) -> tuple[str, ...] | None:
    return None if args.schedule == "all" else (args.schedule,)


def run(args) -> int:
    if args.repro is not None:
        if args.dumps or args.warps or args.config or args.hypothesis:
            raise ValueError("--repro replays the check it names: give it no dump, --warps, --config or --hypothesis")
        engine, _ = require(args.engine, ())
        div, report = replay(engine, args.engine, args.repro)
        return _finish(div, report, engine, "the problem replayed", (0 if div else 1, "replayed checks"))
    if args.hypothesis:
        div, summary, report, engine, count = _generated(args)
    else:
        div, summary, report, engine, count = _dumps(args)
    return _finish(div, report, engine, summary, count)


def _finish(div, report, engine, summary: str, count: tuple[int, str]) -> int:
    """Print the divergence or the agreement, then the verdict; the exit status."""
    if div:
        for line in div.lines():
            say(line)
    elif engine.recipe != APA:
        rec = peers.recipe(engine.recipe)
        say(f"apa check: engine {engine.name} equals the {rec.title} recipe ({rec.module}) on {summary}")
    elif report is not None:
        say(f"apa check: engine {engine.name} is within relative L2 {report.bound:g} of the emulator on {summary}")
        for line in report.lines():
            say(f"  {line}")
    else:
        subject = "the kernel" if engine.name == KERNEL else f"engine {engine.name}"
        say(f"apa check: {subject} equals the emulator bitwise (output, hot masks, every trace field) on {summary}")
    say(verdict(div, report, *count))
    return EXIT_DIVERGED if div else 0


def verdict(div, report, passed: int, unit: str) -> str:
    """The last line of every check: how many checks passed and how many failed. ``unit`` names what
    ``passed`` counts; a tolerance check of dumps or of one replayed problem counts its pairs, and
    a dump's KV head that diverges bitwise fails all its chosen warps."""
    failed = (div.failed if unit == "warps" else 1) if div else 0
    if report is not None and unit != "generated problems":  # a generated check's report is its worst problem's
        failed = int(np.sum(~(report.rel_l2 <= report.bound)))  # ok: counts booleans
        passed, unit = report.pairs - failed, "pairs"
    return f"apa check: {'FAIL' if failed else 'PASS'}: {passed} {unit} passed, {failed} failed"


def _schedule_words(engine, args) -> str:
    if "schedule" not in engine.options:
        return ""
    names = _schedules(args) or tuple(engine.options["schedule"])
    words = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    return f", {words} schedule" + "s" * (len(names) > 1)


def _generated(args):
    """The first divergence on --hypothesis problems (None if none), what was checked, the report."""
    if args.dumps or args.warps or args.config:
        raise ValueError("--hypothesis checks generated problems and configs: give it no dump, --warps or --config")
    engine, _ = require(args.engine, ())
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    if engine.recipe != APA:
        with common.progress(True, "check, generated problems", engine.wait) as prog:
            div, done = peer_check.check_generated(engine, args.engine, args.hypothesis, seed, mode=args.mode,
                                                   max_rel_l2=args.max_rel_l2, progress=prog)
        return (div, f"{done} generated problems ({resolve_mode(engine, args.mode)}, --seed {seed})", None, engine,
                (done - 1 if div else done, "generated problems"))
    tally = Counter()
    with common.progress(True, "check, generated problems", engine.wait) as prog:
        div, done, report = check_generated(engine, args.engine, args.hypothesis, seed, mode=args.mode,
                                            schedules=_schedules(args), max_rel_l2=args.max_rel_l2, progress=prog,
                                            tally=tally)
    what = f"problems under the config it claims, {' '.join(engine.config)}," if engine.config else \
        "problems and configs"
    passed = done - 1 if div else done
    return (div, f"{done} generated {what} (--seed {seed}; {_drawn(tally)}){_schedule_words(engine, args)}", report,
            engine, (passed, "generated problems"))


def _drawn(tally: Counter) -> str:
    """The drawn modes, e.g. "exp2 soft 48 / fast 24, hot_test mass 36 / budget 36"."""
    by_field: dict[str, list[str]] = {}
    for (field, value), n in tally.items():
        by_field.setdefault(field, []).append(f"{value} {n}")
    return ", ".join(f"{field} " + " / ".join(counts) for field, counts in by_field.items())


def _dumps(args):
    """The first divergence on the dumps (None if none), what was checked, the report."""
    paths = common.dump_paths(args)
    dumps = [read_dump(p) for p in paths]
    warps = common.parse_list(args.warps, "--warps")
    engine, cfg = require(args.engine, [d.hd for d in dumps], args.config)
    if engine.recipe != APA:
        return _peer_dumps(args, engine, paths, dumps)
    div, done, report = None, 0, None
    with common.progress(True, "check", CpuEngine.wait) as prog:
        for path, dump in zip(paths, dumps):
            div, count, report = check_dump(engine, args.engine, dump, path, cfg, warps, mode=args.mode,
                                            schedules=_schedules(args), max_rel_l2=args.max_rel_l2, workers=args.workers,
                                            progress=prog)
            done += count
            if div:
                break
    claim = f"the config it claims, {' '.join(engine.config)}, and " if engine.config else ""
    summary = (f"{done} warps of {len(dumps)} dump{'s' * (len(dumps) > 1)} under {claim}{cfg_name(cfg)}"
               f"{_schedule_words(engine, args)}")
    return div, summary, report, engine, (done, "warps")


def _peer_dumps(args, engine, paths, dumps):
    """The first divergence of a peer kernel's engine from its recipe on the dumps (None if none)."""
    if args.warps or args.config:
        raise ValueError(f"--engine {args.engine} runs the {engine.recipe} recipe on whole dumps: give it no "
                         f"--warps or --config")
    div, pairs, passed = None, 0, 0
    with common.progress(True, "check", engine.wait) as prog:
        for i, (path, dump) in enumerate(zip(paths, dumps)):
            div, count = peer_check.check_dump(engine, args.engine, dump, path, mode=args.mode,
                                               max_rel_l2=args.max_rel_l2)
            if div:
                break
            pairs, passed = pairs + count, passed + 1
            prog(i + 1, len(dumps))
    summary = f"{pairs} (row, head) pairs of {passed} dump{'s' * (passed != 1)}, each padded in front to causal " \
              f"equal lengths"
    return div, summary, None, engine, (passed, "dumps")
