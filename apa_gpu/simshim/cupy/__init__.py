"""A NumPy-backed stand-in for the part of CuPy that apa_gpu uses, running the kernels through the
CPU simulator (cuda/sim; apa_gpu/build.py builds it when APA_GPU_SIM=1).

Only for machines without a GPU. Put this folder first on the path and set APA_GPU_SIM=1::

    APA_GPU_SIM=1 PYTHONPATH=.:apa_gpu/simshim python -m pytest -m gpu tests/test_gpu_kernel.py

Arrays are NumPy arrays (a subclass with CuPy's ``get()``); a kernel launch calls the simulator
library's ``apa_sim_launch`` with the arguments' addresses. It is not CuPy: nothing else works.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

__version__ = "0+apa-sim"

if os.environ.get("APA_GPU_SIM", "") in ("", "0"):
    raise ImportError("apa_gpu/simshim/cupy is the simulator's stand-in for CuPy: set APA_GPU_SIM=1 to use it")


class ndarray(np.ndarray):
    def __new__(cls, shape, dtype=float, memptr=None):
        if memptr is not None:
            return np.asarray(memptr).view(np.dtype(dtype))[: int(np.prod(shape))].reshape(shape).view(cls)
        return np.zeros(shape, dtype).view(cls)

    def get(self):
        return np.array(self, copy=True).view(np.ndarray)


def _wrap(a):
    return np.asarray(a).view(ndarray)


def asarray(a, dtype=None):
    return _wrap(np.asarray(a, dtype=dtype))


def ascontiguousarray(a, dtype=None):
    return _wrap(np.ascontiguousarray(a, dtype=dtype))


def zeros(shape, dtype=float):
    return _wrap(np.zeros(shape, dtype))


def empty(shape, dtype=float):
    # poisoned like uninitialised device memory, so a kernel that reads before writing shows up
    a = np.empty(shape, dtype)
    a.view(np.uint8)[...] = 0xA5
    return _wrap(a)


def empty_like(a):
    return empty(a.shape, a.dtype)


def zeros_like(a):
    return zeros(a.shape, a.dtype)


def isfinite(a):
    return _wrap(np.isfinite(np.asarray(a)))


def asnumpy(a):
    return np.array(a, copy=True).view(np.ndarray)


class _Kernel:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name
        self.shared_size_bytes = 0
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        vals = []
        for a in args:
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ValueError(f"{self.name}: non-contiguous array argument")
                vals.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int32):
                vals.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.int64):
                vals.append(ctypes.c_int64(int(a)))
            elif isinstance(a, np.float32):
                vals.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"{self.name}: unsupported kernel argument {type(a).__name__} (pass np.int32/np.float32)")
        argv = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if block[1] != 1 or block[2] != 1:
            raise ValueError("simulator: 1-D blocks only")
        if shared_mem > self.max_dynamic_shared_size_bytes and shared_mem > 48 * 1024:
            raise RuntimeError(f"{self.name}: {shared_mem} bytes of dynamic shared memory exceed the limit")
        rc = self.lib.apa_sim_launch(self.name.encode(), *map(int, grid), int(block[0]), int(shared_mem), argv,
                                     len(vals))
        if rc:
            raise RuntimeError(f"simulator launch of {self.name} failed ({rc})")


class RawModule:
    def __init__(self, *, path=None, code=None, **kw):
        if path is None or not str(path).endswith(".so"):
            raise ValueError("simulator RawModule loads the simulator library (path=...so) only")
        self.lib = ctypes.CDLL(str(path))
        self.lib.apa_sim_launch.restype = ctypes.c_int
        self.lib.apa_sim_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_int]

    def get_function(self, name):
        return _Kernel(self.lib, name)

    def get_global(self, name):
        arr = (ctypes.c_int32 * 5).in_dll(self.lib, name)
        return np.ctypeslib.as_array(arr).copy()


class _Stream:
    def synchronize(self):
        pass


class _Runtime:
    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def runtimeGetVersion():
        return 0

    @staticmethod
    def getDeviceProperties(dev):
        return {"sharedMemPerBlockOptin": 232448, "name": b"apa_gpu CPU simulator", "multiProcessorCount": 4}


class _Device:
    def __init__(self, dev=0):
        self.attributes = {"MultiProcessorCount": 4, "MaxSharedMemoryPerBlockOptin": 232448}


class _Cuda:
    runtime = _Runtime
    Device = _Device

    @staticmethod
    def get_current_stream():
        return _Stream()


cuda = _Cuda()
