"""``apa check``: the kernel against the emulator, bitwise, for anyone who edits ``cuda/``.

The kernel is the engine registered as "gpu" (apa_emu/engines.py). Each comparison runs it under
every chosen launch schedule, the engine's "schedule" option (``separate``: pass 1, pass 2 and the
merge as three launches; ``fused``: one persistent launch; ``bounded``), since each is its own code
path. It runs on the device, or on the kernel simulator under ``APA_GPU_BACKEND=sim`` (cuda/sim).

On a dump, one KV head at a time (a head is a whole problem of its own, numerics.md §5): the chosen
warps of the emulator against the kernel's, output, hot masks and every trace field. Or on problems
and configs that Hypothesis generates (``apa_emu.strategies``). The first divergence is named by
stage, warp, tile and field with both values (``apa_emu.compare``), and saved as a reproducer for
``python -m apa_gpu.replay``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import engines
from ..api import attention, run
from ..call import resolve_call
from ..compare import describe, first_divergence, save_reproducer
from ..config import Config
from ..engines import Engine
from .. import trace as tr
from ..geometry import ROWS
from .engine import BackendError, ready

KERNEL = "gpu"  # the engine apa check compares with the emulator


def kernel_class() -> type[Engine] | None:
    """The engine apa check compares with the emulator; None when none is registered (apa check
    says so when it runs)."""
    try:
        return engines.load(KERNEL)
    except KeyError:
        return None


def kernel_schedules() -> tuple[str, ...]:
    """The kernel's launch schedules, each of which apa check runs."""
    cls = kernel_class()
    return tuple(cls.options.get("schedule", ())) if cls else ()

_RECORD_STAGES = {
    "visits": "pass 1 (visit records: frames, tile sums, hot votes)",
    "hot": "pass 1 (hot-tile masks)",
    "out": "the merge (FP16 output)",
    "err_bound": "the certificate (err_bound)",
    "err_est": "the error estimate (err_est)",
}


def stage_of(div: dict) -> str:
    """The stage of the kernel that wrote the first divergent value (§7–§10)."""
    if div["where"] == "rows":
        return next((stage for stage, fields in tr.STAGES if div.get("field") in fields), "row records")
    return _RECORD_STAGES.get(div["where"], div["where"])


@dataclass(frozen=True)
class Divergence:
    """The first difference between kernel and emulator: where it was found, its stage, the
    difference as ``apa_emu.compare.describe`` words it, and the reproducer's path."""

    where: str
    stage: str
    detail: str
    reproducer: Path

    def lines(self) -> list[str]:
        return [f"apa check: the kernel differs from the emulator in {self.where}, stage {self.stage}",
                f"  {self.detail}", f"  reproducer: python -m apa_gpu.replay {self.reproducer}"]


def require_gpu(cfg: Config, dims) -> Engine:
    """The kernel's engine, when it can run ``cfg`` at head dims ``dims`` here (else BackendError)."""
    cls = kernel_class()
    engine, why = (ready(cls, [cfg], dims) if cls else
                   (None, f"no engine {KERNEL!r} is registered (pip install -e '.[gpu]')"))
    if why:
        raise BackendError(f"apa check runs the kernel: {why}")
    return engine


def _diverged(emu, gpu, where: str, q, k, v, q_offset, cfg, trace, schedule, place=None) -> Divergence | None:
    div = first_divergence(emu, gpu, KERNEL)
    if div is None:
        return None
    if div["where"] == "visits" and "visit" in div:  # name the visit's tile beside it
        keys = list(div)
        at = keys.index("visit") + 1
        div = {k: div[k] for k in keys[:at]} | {"tile": int(emu.visits[div["record"]]["tile"])} | \
            {k: div[k] for k in keys[at:]}
    if place:
        div = place(div)
    path = save_reproducer(q, k, v, q_offset, cfg, trace, note=where, schedule=schedule)
    return Divergence(where, stage_of(div), describe(div), path)


def check_dump(dump, name: str, cfg: Config, warps=None, *, schedules=None, workers=1,
               progress=None) -> tuple[Divergence | None, int]:
    """Kernel (under each of ``schedules``) against emulator on ``warps`` (indices within each KV
    head; None: all) of every KV head; returns the first divergence (None) and the number of warps
    compared."""
    kernel = require_gpu(cfg, [dump.hd])
    schedules = kernel_schedules() if schedules is None else schedules
    G, R = dump.group, dump.n * dump.group
    nw = -(-R // ROWS)
    chosen = np.arange(nw) if warps is None else np.asarray(warps)
    if chosen.size == 0 or chosen.min() < 0 or chosen.max() >= nw:
        raise ValueError(f"--warps: {name} has warps 0..{nw - 1} per KV head")
    trace = [(0, 0, int(w)) for w in chosen]
    packed = np.arange(R)
    others = ~np.isin(packed // ROWS, chosen)
    rest = np.setdiff1d(np.arange(nw), chosen)
    for hk in range(dump.nkv):
        q, k, v = (np.ascontiguousarray(x) for x in (dump.q[:, hk * G:(hk + 1) * G], dump.k[:, hk:hk + 1],
                                                      dump.v[:, hk:hk + 1]))
        emu = attention(q, k, v, dump.q_offset, cfg, warps=trace, trace=trace, workers=workers, progress=progress)
        call = resolve_call(q, k, v, dump.q_offset, trace=trace)
        for schedule in schedules:
            gpu = kernel.run(call, cfg, schedule=schedule)
            # The emulator ran the chosen warps only: elsewhere its output, bounds and masks are the kernel's.
            elsewhere = (packed[others] // G, packed[others] % G)
            emu.out[elsewhere] = gpu.out[elsewhere]
            emu.err_bound[elsewhere] = gpu.err_bound[elsewhere]
            emu.err_est[elsewhere] = gpu.err_est[elsewhere]
            emu.hot[:, :, rest] = gpu.hot[:, :, rest]
            found = _diverged(emu, gpu, f"{name} (KV head {hk}, {schedule} schedule)", q, k, v, dump.q_offset,
                              cfg, trace, schedule, place=lambda div, hk=hk: _in_dump(div, hk, G))
            if found:
                return found, hk * chosen.size
    return None, dump.nkv * chosen.size


def _in_dump(div: dict, hk: int, G: int) -> dict:
    """A divergence of a KV head's problem, located in the whole dump."""
    div = dict(div)
    if "hk" in div:
        div["hk"] = hk
    if div["where"] == "hot" and "index (b, hk, warp, word)" in div:
        b, _, w, word = div["index (b, hk, warp, word)"]
        div["index (b, hk, warp, word)"] = (b, hk, w, word)
    if div["where"] in ("out", "err_bound", "err_est") and "index" in div:
        row, head, *ch = div["index"]
        div["index"] = (row, hk * G + head, *ch)
    return div


class _Found(Exception):
    pass


def check_generated(n: int, seed: int, progress=None, schedules=None) -> tuple[Divergence | None, int]:
    """Kernel (under each of ``schedules``) against emulator on ``n`` problems and configs drawn by
    Hypothesis from ``seed``."""
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as seeded

        from ..strategies import configs, make_inputs, problems
    except ImportError as e:
        raise ImportError(f"apa check --hypothesis needs Hypothesis ({e}); pip install -e '.[test]'") from None
    kernel = require_gpu(Config(), ())
    schedules = kernel_schedules() if schedules is None else schedules

    found: list[Divergence] = []
    done = [0]

    # Generate only: no shrinking (each example costs a kernel build at worst), the first divergence
    # is the one reported, and Hypothesis prints nothing of its own.
    @seeded(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate], verbosity=Verbosity.quiet,
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @given(problems(kernel.head_dims), configs())
    def example(problem, cfg):
        if found:  # Hypothesis replays the failing example once more
            raise _Found
        shape, q_offset = problem
        q, k, v = make_inputs(**shape)
        call = resolve_call(q, k, v, q_offset, trace="all")
        emu = run(call, cfg)
        done[0] += 1
        for schedule in schedules:
            gpu = kernel.run(call, cfg, schedule=schedule)
            where = (f"generated problem {done[0]} (q {q.shape}, k {k.shape}, q_offset {q_offset}, {cfg}, "
                     f"{schedule} schedule)")
            div = _diverged(emu, gpu, where, q, k, v, q_offset, cfg, "all", schedule)
            if div:
                found.append(div)
                raise _Found
        if progress:
            progress(done[0], n)

    try:
        example()
    except _Found:
        pass
    return (found[0] if found else None), done[0]
