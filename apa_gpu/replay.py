"""Replay a reproducer: ``python -m apa_gpu.replay FILE.npz``.

Runs the emulator and the kernel on the saved inputs and config, compares the prep outputs stage
by stage (numerics.md §5), then the whole run (visits, hot masks, rows, output), and prints the
first divergence (apa_emu.compare.replay). Exit status 0 when everything is bitwise equal.
"""

from __future__ import annotations

import argparse
import sys

from apa_emu.compare import load_reproducer, replay

from .engine import GpuEngine
from .plan import SCHEDULES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--workers", type=int, default=1, help="emulator worker processes")
    ap.add_argument("--schedule", choices=SCHEDULES,
                    help="kernel launch schedule (default: the one the reproducer was saved under)")
    args = ap.parse_args(argv)
    saved = load_reproducer(args.file)
    schedule = args.schedule or saved["schedule"]
    segment = dict(segment_tiles=saved["segment_tiles"]) if schedule == "bounded" and saved["segment_tiles"] else {}
    return replay(saved, GpuEngine(), options=dict(schedule=schedule, **segment), workers=args.workers)


if __name__ == "__main__":
    sys.exit(main())
