"""The engines the studies run on (apa_emu/engines.py): the CPU emulator or a registered one, such as
the GPU kernel, chosen once per command.

Every engine runs a study as units of one dump's KV head (a head's prep is all its warps read,
numerics.md §5, so a unit is a whole problem of its own): the engine's call, then the float64
reference and the per-pair sums of ``fp64`` where the engine keeps its arrays (``xp``: NumPy or
CuPy). An exact engine's outputs and hot masks are bitwise the emulator's, so all engines give the
same tables. The units run in this process, or where a study is told to run them: a Dask cluster's
runner (``run_units``'s ``where``, apa_emu.study.cluster).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import engines
from ..call import resolve_call
from ..engines import CpuEngine, Engine
from ..geometry import ROWS, TILE, cdiv
from . import fp64



def backends() -> tuple[str, ...]:
    """What ``--backend`` takes: "auto", "cpu" and the engines registered now."""
    return ("auto", "cpu", *engines.registered())


class BackendError(ValueError):
    """The backend asked for cannot run here; the message says what is missing."""


def reference(engine: Engine, q, k, v, q_offset: int, rows, heads, scale: float, hot=None) -> fp64.Reference:
    """Float64 attention of a unit's pairs, kept where the engine computes (``fp64.reference``)."""
    return fp64.reference(engine.xp, q, k, v, q_offset, rows, heads, scale,
                          hot=None if hot is None else engine.xp.asarray(hot), block_elements=engine.block_elements)


def metrics(engine: Engine, out, ref) -> fp64.PairSums:
    """The per-pair sums of FP16 outputs against a reference, reduced where it lives."""
    return fp64.pair_sums(engine.xp, out, ref)


def check_fits(engine: Engine, dumps) -> None:
    """Refuse, before any work, a dump whose unit cannot fit the engine's device memory."""
    for device, free in engine.free_memory():
        for dump in dumps:
            need = unit_bytes(dump.n, dump.group, dump.kv, dump.hd, engine.block_elements)
            if need > free:
                name = f"{dump.path.name}: " if dump.path else ""
                raise ValueError(f"{name}the {dump.nbytes / 2**30:.2f} GiB dump ({dump.kv} keys, d = {dump.hd}) "
                                 f"needs about {need / 2**30:.1f} GiB of GPU memory per KV head, more than the "
                                 f"{free / 2**30:.1f} GiB free on GPU {device}")


def unit_bytes(n: int, G: int, S: int, d: int, block_elements: int) -> int:
    """Device bytes of one unit, about: its FP16 inputs, the kernel's buffers (four tile images of the
    keys, the packed rows' prep, partials and output) and the float64 reference (a few blocks of
    scores and the pairs' accumulators)."""
    rows = ROWS * cdiv(n * G, ROWS)
    inputs = 2 * (n * G * d + 2 * S * d)
    kernel = 4 * 2 * cdiv(S, TILE) * TILE * d + rows * d * (2 + 4 + 2) + 16 * rows
    reference = 6 * 8 * block_elements + 4 * 8 * n * G * d
    return inputs + kernel + reference


def ready(cls: type[Engine], configs, dims) -> tuple[Engine | None, str | None]:
    """An engine of class ``cls`` when it can run every config at every head dim here, else None and
    why not."""
    name = getattr(cls, 'name', '') or cls.__name__
    with engines.guarded(f"engine {name} raised"):
        why = cls.missing() or next((f"engine {name} does not run head dim {d} (it declares head dims "
                                     f"{', '.join(map(str, cls.head_dims))})" for d in sorted(set(dims))
                                     if d not in cls.head_dims), None) \
            or next((r for c in configs for d in sorted(set(dims)) if (r := cls.lacks(c, d))), None)
        return (None, why) if why else (cls(), None)


def select_engine(backend, configs, dims, *, workers: int = 1, devices=()) -> Engine:
    """The engine for a study of ``configs`` on dumps of head dims ``dims``: ``backend`` "cpu", a
    registered engine's name such as "gpu" or a ``module:callable`` (docs/engines.md; BackendError
    naming what is missing when it cannot run)
    or "auto": the first registered engine that can run every config, else the CPU, with a ``note``
    saying why when an engine is there but lacks a config or head dim, or ``devices`` asked for one.
    ``devices`` (--devices) only steer the choice: the engine runs on the GPU its process sees, each
    listed GPU being a cluster worker's (apa_emu.study.cluster). An Engine passes through."""
    if isinstance(backend, Engine):
        return backend
    if backend not in (names := backends()) and not engines.is_spec(backend):
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(names)} or module:callable")
    if backend == "cpu":
        if devices:
            raise ValueError("--devices chooses GPUs: it needs the GPU backend, not --backend cpu")
        return CpuEngine(workers)
    if backend != "auto":
        cls = engines.load(backend)
        if cls.recipe != "apa":
            raise BackendError(f"--backend {backend}: engine {cls.name} implements the {cls.recipe} recipe, not "
                               f"numerics.md; apa check --engine {backend} checks it against that recipe")
        engine, why = ready(cls, configs, dims)
        if why:
            raise BackendError(f"--backend {backend}: {why}")
        return engine
    whys = []
    for name in engines.registered():
        cls = engines.load(name)
        if cls.recipe != "apa":  # a peer kernel's engine computes another attention: never a study's backend
            continue
        # Not on this machine (no CuPy, no device) and no --devices asked for it: the CPU is the plain
        # choice, and a note saying so on every command of a CPU-only machine would be noise.
        if cls.missing() and not devices:
            continue
        engine, why = ready(cls, configs, dims)
        if engine:
            return engine
        whys.append(why)
    return CpuEngine(workers, note=f"running on the CPU emulator: {whys[0]}" if whys else None)


class Unit(NamedTuple):
    """The selected pairs of one KV head of one dump: their places in the dump's pair list, query rows,
    query heads within the KV head, and the warps holding them."""

    dump: int
    hk: int
    index: np.ndarray
    rows: np.ndarray
    heads: np.ndarray
    warps: np.ndarray


class UnitRun(NamedTuple):
    """One unit under one config, as the engine hands it back: only per-pair arrays, the unit's
    pairs' FP16 outputs, certificates and estimates, and the hot masks of the unit's selected warps (others zero)."""

    out: np.ndarray  # [p, d] FP16
    bound: np.ndarray  # [p] binary32 err_bound (numerics.md §9.7)
    est: np.ndarray  # [p] binary32 err_est (§9.8), NaN from an engine that gives none
    hot: np.ndarray  # [warps, W] uint32
    sums: fp64.PairSums
    split: tuple | None  # (|hot part|, |cold part|, cold mass) of each pair's reference
    visits: np.ndarray | None
    rows: np.ndarray | None


def run_unit(engine: Engine, dump, unit: Unit, configs, *, split: bool, trace: bool, step=None) -> list[UnitRun]:
    """Every config on one unit; the reference is computed once (per softmax scale) unless ``split``
    asks for each config's hot and cold parts. ``step(n)`` gives the progress callback of a call of
    ``n`` steps."""
    G, hk = dump.group, unit.hk
    q = engine.put(dump.q[:, hk * G:(hk + 1) * G])
    k, v = engine.put(dump.k[:, hk:hk + 1]), engine.put(dump.v[:, hk:hk + 1])
    warps = {(0, 0, int(w)) for w in unit.warps}
    keep = np.zeros((cdiv(dump.n * G, ROWS), 1), np.uint32)
    keep[unit.warps] = 1
    refs, runs = {}, []
    call = resolve_call(q, k, v, dump.q_offset, warps=warps, trace=warps if trace else None)
    for cfg in configs:
        # the emulator's and the kernel's errors reach the command as they are, which words them
        with engines.guarded(f"engine {engine.name} raised", errors=False):
            res = engine.run(call, cfg, progress=step(engine.steps(len(unit.warps))) if step else None)
        res = engines.as_result(engine.name, res, call, cfg)
        # an engine that returns the output alone (docs/engines.md) has no hot tile and gives up its bound
        hot = (np.zeros_like(keep) if res.hot is None else res.hot[0, 0]) * keep
        bound = np.full(res.out.shape[:-1], np.inf, np.float32) if res.err_bound is None else res.err_bound
        scale = float(cfg.softmax_scale(dump.hd))
        if split or scale not in refs:
            refs[scale] = reference(engine, q, k, v, dump.q_offset, unit.rows, unit.heads, scale,
                                    hot=hot if split else None)
        ref = refs[scale]
        out = res.out[unit.rows, unit.heads]
        parts = (ref.hot_norm, ref.cold_norm, ref.cold_mass)
        est = (np.full(len(unit.rows), np.nan, np.float32) if res.err_est is None
               else res.err_est[unit.rows, unit.heads])
        runs.append(UnitRun(out, bound[unit.rows, unit.heads], est, hot, metrics(engine, out, ref.out),
                            tuple(fp64.host(a) for a in parts) if split else None,
                            _in_dump(res.visits, hk), _in_dump(res.rows, hk)))
    return runs


def _in_dump(records, hk: int):
    """Trace records of a unit with the KV head of the dump they belong to."""
    if records is not None:
        records["hk"] = hk
    return records


class _Steps:
    """Per-call progress callbacks summed into one ``progress(done, total)`` over a whole study."""

    def __init__(self, progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, steps: int):
        base = self.done
        self.done += steps
        return lambda done, total: self.progress(base + done, self.total)


def run_units(engine: Engine, dumps, units: list[Unit], configs, *, split=False, trace=False,
              progress=None, where=None) -> list[list[UnitRun] | None]:
    """Every unit under every config ([unit][config]), in the order of ``units`` wherever they run:
    in this process, or through ``where.run_units`` (a cluster's Runner, apa_emu.study.cluster);
    None for a unit that failed twice on a cluster (its runner names it). ``dumps`` maps each unit's
    ``dump`` index to its Dump."""
    check_fits(engine, [dumps[i] for i in sorted({u.dump for u in units})])
    if where is not None:
        return where.run_units(engine, dumps, units, configs, split, trace, progress)
    step = _Steps(progress, sum(len(configs) * engine.steps(len(u.warps)) for u in units)) if progress else None
    runs, current = [], None
    with engine.context():
        for unit in units:
            if unit.dump != current:
                engine.release()  # a dump's device memory goes back before the next dump's
                current = unit.dump
            runs.append(run_unit(engine, dumps[unit.dump], unit, configs, split=split, trace=trace, step=step))
        engine.release()
    return runs
