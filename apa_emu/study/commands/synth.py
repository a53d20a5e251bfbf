"""``apa synth``: write a synthetic dump (the library's ``synth``)."""

from __future__ import annotations

from ... import api
from ..dump import HEAD_DIMS, write_dump
from ..report import say
from ..synth import synthetic, synthetic_bytes
from . import common

HELP = "write a synthetic dump"
DESCRIPTION = "write a synthetic dump with a sink, RoPE locality and diffuse heads (apa_emu/study/synth.py)"


def add_arguments(p) -> None:
    p.add_argument("out", help="dump file to write (a new path or a regular file, replaced whole)")
    p.add_argument("--n", type=common.count, default=512, help="query rows (the last n positions)")
    p.add_argument("--kv", type=common.count, default=4096, help="keys")
    p.add_argument("--heads", type=common.count, default=24, help="query heads")
    p.add_argument("--kv-heads", type=common.count, default=8, help="KV heads (query heads must be a multiple)")
    p.add_argument("--d", type=int, default=128, choices=HEAD_DIMS, help="head dim")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")


def _check_memory(args) -> None:
    """Refuse, before allocating anything, a dump whose making cannot fit in memory: NumPy would fail
    after minutes of allocation and filling, or the OOM killer end the process."""
    need, have = synthetic_bytes(args.n, args.kv, args.heads, args.kv_heads, args.d), api.available_bytes()
    if have is not None and need > have:
        raise MemoryError(f"apa synth: --n {args.n} --kv {args.kv} --heads {args.heads} --kv-heads {args.kv_heads} "
                          f"--d {args.d} needs about {need / 2**30:.1f} GiB; {have / 2**30:.1f} GiB of memory "
                          f"is available")


def run(args) -> None:
    common.check_outputs(args, [])
    _check_memory(args)
    d = synthetic(args.n, args.kv, args.heads, args.kv_heads, args.d, seed=args.seed)
    say(str(write_dump(args.out, d.q, d.k, d.v, d.q_offset)))
