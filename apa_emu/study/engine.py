"""The engines the studies run on: the CPU emulator or the GPU kernel, chosen once per command.

Both run a study as units of one dump's KV head (a head's prep is all its warps read, numerics.md
§5, so a unit is a whole problem of its own): the kernel or the emulator, then the float64
reference and the per-pair sums of ``fp64`` where the engine's arrays live (NumPy or CuPy). The
kernel's outputs and hot masks are bitwise the emulator's, so the two engines give the same tables.
Several GPUs split the units statically, one process per GPU.
"""

from __future__ import annotations

import signal
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np

from ..api import Result, attention, worker_pool
from ..config import Config
from ..geometry import ROWS, TILE, cdiv
from . import fp64

BACKENDS = ("auto", "cpu", "gpu")


class BackendError(ValueError):
    """The backend asked for cannot run here; the message says what is missing."""


def gpu_missing() -> str | None:
    """What the GPU engine lacks on this machine, in a few words (None: nothing)."""
    import apa_gpu

    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install -e '.[gpu]')"
    if apa_gpu.available():
        return None
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy raises its own error types when there is no driver
        devices = 0
    if devices < 1:
        return "no CUDA device is visible"
    return "nvcc is not found (set APA_NVCC or put the CUDA toolkit's bin/ on PATH)"


def kernel_lacks(cfg: Config, d: int) -> str | None:
    """Why the kernel cannot run ``cfg`` at head dim ``d`` (None: it can)."""
    import apa_gpu

    try:
        apa_gpu.check_config(cfg, d)
    except NotImplementedError as e:
        return str(e).removeprefix("apa_gpu: ")
    return None


class Engine:
    """Where a study's units run. ``xp`` is the array module of the reference and the metrics,
    ``block_elements`` bounds a block of float64 scores, ``note`` says why ``auto`` chose it."""

    name = ""
    xp = np
    block_elements = 1 << 20
    devices: tuple[int, ...] = ()

    def __init__(self, note: str | None = None):
        self.note = note

    def put(self, x):
        return x

    def attention(self, q, k, v, q_offset, cfg: Config, *, warps, trace, progress) -> Result:
        """The emulator's or the kernel's Result of one unit (``put`` arrays); ``warps`` must be run,
        others may be."""
        raise NotImplementedError

    def reference(self, q, k, v, q_offset: int, rows, heads, scale: float, hot=None) -> fp64.Reference:
        """Float64 attention of a unit's pairs, kept where the engine computes (``fp64.reference``)."""
        return fp64.reference(self.xp, q, k, v, q_offset, rows, heads, scale,
                              hot=None if hot is None else self.xp.asarray(hot), block_elements=self.block_elements)

    def metrics(self, out, ref) -> fp64.PairSums:
        """The per-pair sums of FP16 outputs against a reference, reduced where it lives."""
        return fp64.pair_sums(self.xp, out, ref)

    def lacks(self, cfg: Config, d: int) -> str | None:
        """Why this engine cannot run ``cfg`` (None: it can)."""
        return None

    def steps(self, warps: int) -> int:
        """Progress steps of one attention call over ``warps`` warps."""
        return 1

    def check_fits(self, dumps) -> None:
        """Refuse, before any work, a dump whose unit cannot fit the engine's memory."""

    def release(self) -> None:
        """Give back the memory a dump's units held."""

    def context(self):
        return nullcontext()


class CpuEngine(Engine):
    """The emulator, ``workers`` processes over the warps of each unit."""

    name = "cpu"

    def __init__(self, workers: int = 1, note: str | None = None):
        super().__init__(note)
        self.workers = workers

    def attention(self, q, k, v, q_offset, cfg, *, warps, trace, progress):
        return attention(q, k, v, q_offset, cfg, warps=warps, trace=trace, workers=self.workers, progress=progress)

    def steps(self, warps):
        return warps


class GpuEngine(Engine):
    """The kernel through ``apa_gpu``, the reference and the sums in CuPy on the same device.

    ``devices``: the GPUs to use (empty: the current one); more than one runs a process on each."""

    name = "gpu"
    block_elements = 1 << 24

    def __init__(self, devices=(), note: str | None = None):
        import cupy

        super().__init__(note)
        self.xp = cupy
        self.devices = tuple(devices)

    def put(self, x):
        return self.xp.asarray(np.ascontiguousarray(x))

    def attention(self, q, k, v, q_offset, cfg, *, warps, trace, progress):
        import apa_gpu

        res = apa_gpu.attention(q, k, v, q_offset, cfg, trace=trace)  # every warp: cheaper than choosing
        if progress:
            progress(1, 1)
        return res

    def lacks(self, cfg, d):
        return kernel_lacks(cfg, d)

    def context(self):
        return self.xp.cuda.Device(self.devices[0]) if len(self.devices) == 1 else nullcontext()

    def check_fits(self, dumps):
        cp = self.xp
        for device in self.devices or (cp.cuda.runtime.getDevice(),):
            with cp.cuda.Device(device):
                free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
            for dump in dumps:
                need = unit_bytes(dump.n, dump.group, dump.kv, dump.hd, self.block_elements)
                if need > free:
                    name = f"{dump.path.name}: " if dump.path else ""
                    raise ValueError(f"{name}the {dump.nbytes / 2**30:.2f} GiB dump ({dump.kv} keys, d = {dump.hd}) "
                                     f"needs about {need / 2**30:.1f} GiB of GPU memory per KV head, more than the "
                                     f"{free / 2**30:.1f} GiB free on GPU {device}")

    def release(self):
        self.xp.get_default_memory_pool().free_all_blocks()
        self.xp.get_default_pinned_memory_pool().free_all_blocks()


def unit_bytes(n: int, G: int, S: int, d: int, block_elements: int) -> int:
    """Device bytes of one unit, about: its FP16 inputs, the kernel's buffers (four tile images of the
    keys, the packed rows' prep, partials and output) and the float64 reference (a few blocks of
    scores and the pairs' accumulators)."""
    rows = ROWS * cdiv(n * G, ROWS)
    inputs = 2 * (n * G * d + 2 * S * d)
    kernel = 4 * 2 * cdiv(S, TILE) * TILE * d + rows * d * (2 + 4 + 2) + 16 * rows
    reference = 6 * 8 * block_elements + 4 * 8 * n * G * d
    return inputs + kernel + reference


def select_engine(backend, configs, dims, *, workers: int = 1, devices=()) -> Engine:
    """The engine for a study of ``configs`` on dumps of head dims ``dims``: ``backend`` "cpu", "gpu"
    (BackendError naming what is missing when it cannot run) or "auto" (the GPU when it can run
    every config, else the CPU with a ``note`` saying why). An Engine passes through."""
    if isinstance(backend, Engine):
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "cpu":
        if devices:
            raise ValueError("--devices chooses GPUs: it needs the GPU backend, not --backend cpu")
        return CpuEngine(workers)
    why = gpu_missing() or next((r for c in configs for d in sorted(set(dims)) if (r := kernel_lacks(c, d))), None)
    if why is None:
        return GpuEngine(devices)
    if backend == "gpu":
        raise BackendError(f"--backend gpu: {why}")
    return CpuEngine(workers, note=f"running on the CPU emulator: {why}")


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
    pairs' FP16 outputs and certificates, and the hot masks of the unit's selected warps (others zero)."""

    out: np.ndarray  # [p, d] FP16
    bound: np.ndarray  # [p] binary32 err_bound (numerics.md §9.7)
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
    for cfg in configs:
        res = engine.attention(q, k, v, dump.q_offset, cfg, warps=warps, trace=warps if trace else None,
                               progress=step(engine.steps(len(unit.warps))) if step else None)
        hot = res.hot[0, 0] * keep
        scale = float(cfg.softmax_scale(dump.hd))
        if split or scale not in refs:
            refs[scale] = engine.reference(q, k, v, dump.q_offset, unit.rows, unit.heads, scale,
                                           hot=hot if split else None)
        ref = refs[scale]
        out = res.out[unit.rows, unit.heads]
        parts = (ref.hot_norm, ref.cold_norm, ref.cold_mass)
        runs.append(UnitRun(out, res.err_bound[unit.rows, unit.heads], hot, engine.metrics(out, ref.out),
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
              progress=None) -> list[list[UnitRun]]:
    """Every unit under every config ([unit][config]), in the order of ``units`` whatever the devices.
    ``dumps`` maps each unit's ``dump`` index to its Dump."""
    engine.check_fits([dumps[i] for i in sorted({u.dump for u in units})])
    if len(engine.devices) > 1:
        return _on_devices(engine, dumps, units, configs, split, trace, progress)
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


def _on_devices(engine: Engine, dumps, units, configs, split, trace, progress):
    """The units split statically over the devices, round robin, one spawned process per device
    (CUDA does not survive a fork); each process opens the dumps of its units again."""
    shares = [list(range(i, len(units), len(engine.devices))) for i in range(len(engine.devices))]
    tasks = [(device, share, {units[u].dump: _source(dumps[units[u].dump]) for u in share},
              [units[u] for u in share], configs, split, trace)
             for device, share in zip(engine.devices, shares) if share]
    runs = [None] * len(units)
    with worker_pool("spawn", len(tasks), _ignore_ctrl_c) as pool:
        for done, (share, result) in enumerate(pool.imap_unordered(_device_task, tasks), 1):
            for u, r in zip(share, result):
                runs[u] = r
            if progress:
                progress(done, len(tasks))
    return runs


def _source(dump):
    """What a spawned process needs to open a dump: its file, or the arrays of one made in memory."""
    return dump.path if dump.path is not None else dump


def _ignore_ctrl_c():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports Ctrl-C and ends the pool


def _device_task(task):
    from .dump import read_dump

    device, share, sources, units, configs, split, trace = task
    dumps = {j: read_dump(s, check_finite=False) if not hasattr(s, "q") else s for j, s in sources.items()}
    return share, run_units(GpuEngine((device,)), dumps, units, configs, split=split, trace=trace)
