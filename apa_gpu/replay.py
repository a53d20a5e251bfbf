"""Replay a reproducer: ``python -m apa_gpu.replay FILE.npz``.

Runs the emulator and the kernel on the saved inputs and config, compares the prep outputs stage
by stage (numerics.md §5), then the whole run (visits, hot masks, rows, output), and prints the
first divergence. Exit status 0 when everything is bitwise equal.
"""

from __future__ import annotations

import argparse
import sys

import apa_emu
from apa_emu.call import logical_kv, resolve_call

from .api import attention
from .compare import describe, first_divergence, load_reproducer, prep_divergence
from .plan import SCHEDULES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--workers", type=int, default=1, help="emulator worker processes")
    ap.add_argument("--schedule", choices=SCHEDULES,
                    help="kernel launch schedule (default: the one the reproducer was saved under)")
    args = ap.parse_args(argv)
    r = load_reproducer(args.file)
    q, k, v, off, cfg, trace = r["q"], r["k"], r["v"], r["q_offset"], r["config"], r["trace"]
    schedule = args.schedule or r["schedule"]
    paging = dict(block_table=r["block_table"], seqlen_k=r["seqlen_k"])
    print(f"q {q.shape} k {k.shape} q_offset {off} window {r['window']} paged {r['block_table'] is not None}\n"
          f"config {cfg}\nschedule {schedule}")
    call = resolve_call(q, k, v, off, **paging)
    prep = prep_divergence(call.q, *logical_kv(call), off, cfg)  # prep of the contiguous layout (§5.0)
    print("prep: " + (prep or "bitwise equal"))
    emu = apa_emu.attention(q, k, v, off, cfg, window=r["window"], trace=trace, workers=args.workers, **paging)
    segment = dict(segment_tiles=r["segment_tiles"]) if schedule == "bounded" and r["segment_tiles"] else {}
    gpu = attention(q, k, v, off, cfg, window=r["window"], trace=trace, schedule=schedule, **segment, **paging)
    div = first_divergence(emu, gpu)
    print("run: " + ("bitwise equal" if div is None else "first divergence: " + describe(div)))
    return 0 if div is None and prep is None else 1


if __name__ == "__main__":
    sys.exit(main())
