"""The sm_90a kernel as an apa_emu engine (apa_emu/engines.py), registered as "gpu" through the
entry point group ``apa_emu.engines`` (pyproject.toml), so that apa_emu finds it without importing it.

It runs on the selected backend (``APA_GPU_BACKEND``, apa_gpu/device.py): on a CUDA device the
studies keep their arrays, reference and metrics in CuPy on the same device, and free its memory
pools between dumps; on the CPU simulator they stay in NumPy.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from apa_emu.engines import Engine

from . import api
from .build import SUPPORTED_D, backend_name
from .plan import SCHEDULES, check_config


def kernel_missing() -> str | None:
    """What running the kernel lacks here, in a few words (None: nothing): g++ for the simulator, else
    CuPy, a device and nvcc."""
    if backend_name() == "sim":
        return None if api.available() else "the kernel simulator (APA_GPU_BACKEND=sim) needs g++ on PATH or $CXX"
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install -e '.[gpu]')"
    if api.available():
        return None
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy raises its own error types when there is no driver
        devices = 0
    if devices < 1:
        return "no CUDA device is visible"
    return "nvcc is not found (set APA_NVCC or put the CUDA toolkit's bin/ on PATH)"


class GpuEngine(Engine):
    """The kernel through ``apa_gpu.api.run``, every warp of a call (cheaper than choosing).

    ``devices``: the GPUs to use (empty: the current one)."""

    name = "gpu"
    features = frozenset({"window", "paging", "varlen", "kv_state", "trace"})
    head_dims = SUPPORTED_D
    options = {"schedule": SCHEDULES}
    block_elements = 1 << 24
    wait = "the first run builds the kernel with nvcc, a minute or two"

    def __init__(self, devices=(), note: str | None = None):
        super().__init__(devices=devices, note=note)
        self.cupy = None
        if backend_name() == "cuda":
            import cupy

            self.xp = self.cupy = cupy
        else:
            self.block_elements = Engine.block_elements  # host memory, as the emulator's

    def __reduce__(self):
        # Sent to a cluster's worker (apa_emu.study.cluster): CuPy's module does not pickle, and the
        # worker must bind its own CuPy to the GPU it sees.
        return type(self), (self.devices, self.note)

    @classmethod
    def missing(cls):
        return kernel_missing()

    @classmethod
    def lacks(cls, config, d):
        try:
            check_config(config, d)
        except NotImplementedError as e:
            return str(e).removeprefix("apa_gpu: ")
        return None

    def run(self, call, config, *, progress=None, schedule=None, segment_tiles=None):
        res = api.run(call, config, schedule=schedule, segment_tiles=segment_tiles)
        if progress:
            progress(1, 1)
        return res

    def prep_arrays(self, q, k, v, q_offset, config):
        return api.prep_arrays(q, k, v, q_offset, config)

    def put(self, x):
        return self.xp.asarray(np.ascontiguousarray(x))

    def free_memory(self):
        cp = self.cupy
        if cp is None:
            return []
        free = []
        for device in self.devices or (cp.cuda.runtime.getDevice(),):
            with cp.cuda.Device(device):
                free.append((device, cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()))
        return free

    def release(self):
        if self.cupy is not None:
            self.cupy.get_default_memory_pool().free_all_blocks()
            self.cupy.get_default_pinned_memory_pool().free_all_blocks()

    def context(self):
        return self.cupy.cuda.Device(self.devices[0]) if self.cupy and len(self.devices) == 1 else nullcontext()
