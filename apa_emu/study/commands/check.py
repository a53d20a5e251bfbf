"""``apa check``: the GPU kernel against the emulator, bit for bit, on dumps or generated problems;
the comparison itself is the library's ``check``."""

from __future__ import annotations

import numpy as np

from ...config import Config
from ...engines import CpuEngine
from ..check import check_dump, check_generated, kernel_schedules, require_gpu
from ..dump import read_dump
from ..report import cfg_name, say
from . import common

EXIT_DIVERGED = 1  # the kernel and the emulator differ
HELP = "the GPU kernel against the emulator, bitwise (for edits to cuda/)"
DESCRIPTION = ("run the kernel and the emulator on a dump (every warp, or --warps) or on generated problems "
               "(--hypothesis N) and compare output, hot masks and every trace field bit for bit. Exit 0 when "
               "equal; on a divergence print the first one (stage, warp, tile, field, both values), save a "
               "reproducer for python -m apa_gpu.replay, and exit 1")
EPILOG = common.config_epilog()


def add_arguments(p) -> None:
    p.add_argument("dumps", nargs="*", metavar="DUMP",
                   help="dump files or folders of *.apadump files (default: the built-in SmolLM2 dump)")
    p.add_argument("--warps", help="warps of each KV head to compare: A:B (half-open), a,b,c or one index "
                                   "(default: all; the emulator runs each on the CPU)")
    p.add_argument("--config", nargs="*", metavar="KEY=VALUE", help="Config toggles of the dump check (keys below)")
    p.add_argument("--hypothesis", type=common.count, metavar="N",
                   help="check N problems and configs drawn by Hypothesis (apa_emu/strategies.py) instead of dumps")
    p.add_argument("--seed", type=int, help="Hypothesis seed of --hypothesis (default: a random one, printed)")
    p.add_argument("--schedule", choices=[*kernel_schedules(), "all"], default="all",
                   help="kernel launch schedule: one launch per stage (separate), one persistent launch for both "
                        "passes (fused), pass 1 one segment of tiles at a time (bounded, numerics.md §6.7), or all")
    p.add_argument("--workers", type=common.count, default=1, metavar="N", help="emulator processes over the warps")


def _schedules(args) -> tuple[str, ...]:
    return kernel_schedules() if args.schedule == "all" else (args.schedule,)


def run(args) -> int:
    cfg = common.config(args)
    div, summary = _generated(args) if args.hypothesis else _dumps(args, cfg)
    names = _schedules(args)
    summary += f", {' and '.join([', '.join(names[:-1]), names[-1]] if len(names) > 1 else names)} schedule"
    summary += "s" * (len(names) > 1)
    if div:
        for line in div.lines():
            say(line)
        return EXIT_DIVERGED
    say(f"apa check: the kernel equals the emulator bitwise (output, hot masks, every trace field) on {summary}")
    return 0


def _generated(args):
    """The first divergence on --hypothesis problems (None if none), and what was checked."""
    if args.dumps or args.warps or args.config:
        raise ValueError("--hypothesis checks generated problems and configs: give it no dump, --warps or --config")
    kernel = require_gpu(Config(), ())
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    with common.progress(True, "check, generated problems", kernel.wait) as prog:
        div, done = check_generated(args.hypothesis, seed, prog, schedules=_schedules(args))
    return div, f"{done} generated problems and configs (--seed {seed})"


def _dumps(args, cfg: Config):
    """The first divergence on the dumps (None if none), and what was checked."""
    paths = common.dump_paths(args)
    dumps = [read_dump(p) for p in paths]
    warps = common.parse_list(args.warps, "--warps")
    require_gpu(cfg, [d.hd for d in dumps])
    div, done = None, 0
    with common.progress(True, "check", CpuEngine.wait) as prog:
        for path, dump in zip(paths, dumps):
            div, count = check_dump(dump, path.name, cfg, warps, schedules=_schedules(args), workers=args.workers,
                                    progress=prog)
            done += count
            if div:
                break
    return div, f"{done} warps of {len(dumps)} dump{'s' * (len(dumps) > 1)} under {cfg_name(cfg)}"
