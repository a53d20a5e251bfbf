"""The backend that runs the kernels: its array module, build products, launches and limits.

``APA_GPU_BACKEND`` (apa_gpu/build.py ``backend_name``) chooses one, once per process:

- ``cuda`` (default): CuPy arrays; the nvcc cubins loaded with ``cupy.RawModule(path=)``.
- ``sim``: the CPU simulator (cuda/sim), for machines without a GPU: NumPy-backed device arrays and
  the same kernel sources compiled by g++ into a library called through ctypes. It checks
  everything but the tensor cores, ``ex2.approx`` and real concurrency (tests marked ``hardware``).

Every kernel takes one parameter struct (apa_gpu/params.py). ``kernel()`` checks the struct's dtype
against the layout the module exports before handing the kernel out; ``launch()`` packs named values
into it. Launch errors raise at the launch; asynchronous faults raise at the next synchronisation
(``APA_GPU_SYNC=1`` synchronises after every kernel, so that a fault names its kernel).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from apa_emu import trace as tr
from apa_emu.call import KV_STATS, TILE

KV_MEANS = KV_STATS[KV_STATS.index("km"):]  # §5.7's means, kvstat's last columns, each summed per tile

from .build import backend_name, build, find_nvcc
from . import params
from .params import Struct


# Tensor maps of K and V for pass 2's loads (cuda/pipeline.cuh load_tensors): a box is 64 channels
# (128 bytes, the swizzle's span) x 1 KV head x 64 keys (a tile).
TENSOR_MAP_BYTES = 128
TMA_BOX = (64, 1, 64)
_CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
_SIM_TENSOR_MAP = np.dtype([("base", np.uint64), ("dim", np.uint64, 3), ("stride", np.uint64, 2),
                            ("box", np.uint32, 3)], align=True)


class _Cuda:
    """CuPy on the current CUDA device."""

    name = "cuda"

    def __init__(self):
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - exercised only without CuPy
            raise RuntimeError("apa_gpu needs CuPy (pip install cupy-cuda13x), or APA_GPU_BACKEND=sim") from e
        self.xp = cupy
        dev = cupy.cuda.runtime.getDevice()
        attributes = cupy.cuda.Device(dev).attributes
        props = cupy.cuda.runtime.getDeviceProperties(dev)
        optin = props.get("sharedMemPerBlockOptin", props.get(b"sharedMemPerBlockOptin"))
        self.smem_optin = int(attributes["MaxSharedMemoryPerBlockOptin"] if optin is None else optin)
        self.num_sms = int(attributes["MultiProcessorCount"])

    @staticmethod
    def usable() -> bool:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                return False
            find_nvcc()
            return True
        except Exception:
            return False

    def load(self, path):
        return self.xp.RawModule(path=str(path))

    def function(self, module, name: str):
        """The kernel, allowed the device's whole opt-in shared memory (so that every launch's
        dynamic size, whatever the shape, stays under the function's limit), and that limit."""
        k = module.get_function(name)
        k.max_dynamic_shared_size_bytes = self.smem_optin - k.shared_size_bytes
        return k, k.max_dynamic_shared_size_bytes

    def read_ints(self, module, symbol: str, count: int) -> tuple[int, ...]:
        ptr = module.get_global(symbol)
        return tuple(int(x) for x in self.xp.ndarray((count,), np.int32, memptr=ptr).get())

    def launch(self, function, grid: tuple, block: int, params: np.ndarray, smem: int) -> None:
        # CuPy passes a one-element NumPy array by value: its bytes are the struct. As a plain void
        # element, not the structured one: CuPy reads the array's interface, whose field list NumPy
        # builds anew for every nested field (~90 µs of host time per launch, measured on the H200's host).
        function(grid, (block,), (params.view(np.dtype((np.void, params.itemsize))),), shared_mem=smem)

    def address(self, a) -> int:
        if not isinstance(a, self.xp.ndarray) or not a.flags.c_contiguous:
            raise TypeError(f"apa_gpu: kernels take C-contiguous CuPy arrays, got {type(a).__name__}")
        return a.data.ptr

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    @staticmethod
    @lru_cache(maxsize=None)
    def _encode():
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        u32, u64 = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64, u64, u32, u32,
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        return f

    def tensor_map(self, x, rows: int, heads: int, d: int) -> np.ndarray:
        """The CUtensorMap (TENSOR_MAP_BYTES) of the 16-bit tensor x [rows, heads, d] in boxes of 64
        channels x 1 head x 64 rows with the 128-byte swizzle (cuda/pipeline.cuh tma_load_3d)."""
        buf = np.zeros(TENSOR_MAP_BYTES + 64, np.uint8)
        out = buf[-buf.ctypes.data % 64:][:TENSOR_MAP_BYTES]  # 64-byte aligned, as the driver wants
        arr = lambda t, *v: (t * len(v))(*v)  # noqa: E731
        rc = self._encode()(out.ctypes.data, _CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, self.address(x),
                            arr(ctypes.c_uint64, d, heads, rows), arr(ctypes.c_uint64, 2 * d, 2 * d * heads),
                            arr(ctypes.c_uint32, *TMA_BOX), arr(ctypes.c_uint32, 1, 1, 1), 0,
                            _CU_TENSOR_MAP_SWIZZLE_128B, _CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 0)
        if rc:
            raise RuntimeError(f"apa_gpu: cuTensorMapEncodeTiled failed ({rc}) for a tensor {(rows, heads, d)}")
        return out.copy()


class _SimArray(np.ndarray):
    """Device memory of the simulator: a NumPy array, told apart from the caller's host arrays."""


class _SimArrays:
    """The simulator's array module: the part of CuPy's API that apa_gpu uses, on NumPy."""

    ndarray = _SimArray

    @staticmethod
    def asarray(a, dtype=None):
        # like CuPy: a host array is copied to the device, a device array only converted
        return (np.asarray(a, dtype) if isinstance(a, _SimArray) else np.array(a, dtype)).view(_SimArray)

    @staticmethod
    def ascontiguousarray(a, dtype=None):
        return np.ascontiguousarray(_SimArrays.asarray(a, dtype)).view(_SimArray)

    @staticmethod
    def zeros(shape, dtype=float):
        return np.zeros(shape, dtype).view(_SimArray)

    @staticmethod
    def empty(shape, dtype=float):
        # poisoned like uninitialised device memory, so that a kernel reading before writing shows
        a = np.empty(shape, dtype)
        a.view(np.uint8)[...] = 0xA5
        return a.view(_SimArray)

    isfinite = staticmethod(np.isfinite)
    abs = staticmethod(np.abs)

    @staticmethod
    def asnumpy(a):
        return np.array(a, copy=True).view(np.ndarray)


class _Sim:
    """The CPU simulator library (cuda/sim/sim_runtime.h ``apa_sim_launch``)."""

    name = "sim"
    smem_optin = 232448  # an H200's, so that shared-memory limits behave as on the device
    num_sms = 4  # few persistent CTAs, so that the fused launch reuses each one's tile ring

    def __init__(self):
        self.xp = _SimArrays()

    @staticmethod
    def usable() -> bool:
        return shutil.which(os.environ.get("CXX") or "g++") is not None

    def load(self, path):
        lib = ctypes.CDLL(str(path))
        lib.apa_sim_launch.restype = ctypes.c_int
        lib.apa_sim_launch.argtypes = [ctypes.c_char_p, *[ctypes.c_int] * 5, ctypes.c_void_p, ctypes.c_size_t]
        return lib

    def function(self, lib, name: str):
        return (lib, name.encode()), self.smem_optin

    def read_ints(self, lib, symbol: str, count: int) -> tuple[int, ...]:
        return tuple((ctypes.c_int32 * count).in_dll(lib, symbol))

    def launch(self, function, grid: tuple, block: int, params: np.ndarray, smem: int) -> None:
        lib, name = function
        rc = lib.apa_sim_launch(name, *grid, *(1,) * (3 - len(grid)), block, smem, params.ctypes.data, params.nbytes)
        if rc:
            raise RuntimeError(f"simulator launch of {name.decode()} failed ({rc})")

    def address(self, a) -> int:
        if not isinstance(a, _SimArray) or not a.flags.c_contiguous:
            raise TypeError(f"apa_gpu: kernels take C-contiguous device arrays, got {type(a).__name__}")
        return a.ctypes.data

    def synchronize(self) -> None:
        pass

    def tensor_map(self, x, rows: int, heads: int, d: int) -> np.ndarray:
        """cuda/sim/cuda_sim.h TensorMap: what the simulator's tma_load_3d reads in place of a CUtensorMap."""
        m = np.zeros(1, _SIM_TENSOR_MAP)
        m["base"], m["dim"], m["stride"], m["box"] = self.address(x), (d, heads, rows), (2 * d, 2 * d * heads), TMA_BOX
        out = np.zeros(TENSOR_MAP_BYTES, np.uint8)
        out[: m.nbytes] = m.view(np.uint8)
        return out


_BACKENDS = {"cuda": _Cuda, "sim": _Sim}


def usable() -> bool:
    """Whether the selected backend can run: a CUDA device with CuPy and nvcc, or g++ for the simulator."""
    return _BACKENDS[backend_name()].usable()


@lru_cache(maxsize=None)
def backend():
    """The selected backend (``xp``, ``synchronize()``, ``smem_optin``, ``num_sms``, ...)."""
    return _BACKENDS[backend_name()]()


class Layout(NamedTuple):
    """cuda/apa.cu ``apa_layout``: what the host reads from the kernel instead of repeating it."""

    warps: int  # per CTA (§6.2)
    tile: int  # keys per tile (§6.3), checked against apa_emu.geometry.TILE
    stats_threads: int  # block of apa_prep_stats
    keys_per_chunk: int  # keys per apa_prep_stats block
    p1_smem: int  # dynamic shared memory of pass 1
    p2_smem: int  # of pass 2, without its hot-mask words
    p2_mask_words: int  # pass 2's hot-mask words per mask word W
    visit_bytes: int  # trace records, checked against apa_emu.trace
    row_bytes: int
    kv_stats: int  # per-head certificate statistics, checked against apa_emu.prep (§5.7)
    k_threads: int  # block of apa_prep_k: one thread per slot of a tile
    v_threads: int  # block of apa_prep_v: one tile
    v_smem: int  # its dynamic shared memory
    p1_carry: int  # pass 1's per-row state between the bounded schedule's launches (§6.7), binary32s
    tensor_map_bytes: int  # checked against TENSOR_MAP_BYTES
    kv_sums: int  # per tile, the integer sums of §5.7's means
    mean_threads: int  # block of apa_prep_means
    p1_ml: int  # pass 1's export per row besides part (§7.10), binary32s


@dataclass(frozen=True)
class Kernel:
    name: str
    struct: Struct
    function: object
    max_smem: int  # the dynamic shared memory a launch may take


@lru_cache(maxsize=None)
def _module(variant):
    return backend().load(build(variant))


def _read_table(variant, symbol: str) -> tuple[int, ...]:
    """The values of an int table the module exports (cuda/params.cuh APA_EXPORT_INTS)."""
    module, be = _module(variant), backend()
    (n,) = be.read_ints(module, symbol, 1)
    return be.read_ints(module, symbol, 1 + n)[1:]


def check_layout(values, variant) -> Layout:
    """The ``apa_layout`` values of ``variant``, checked against the host's TILE and trace records."""
    if len(values) != len(Layout._fields):
        raise RuntimeError(f"apa_gpu: {variant.name}'s apa_layout has {len(values)} values, device.Layout "
                           f"{len(Layout._fields)}")
    lay = Layout(*values)
    want = dict(tile=TILE, visit_bytes=tr.VISIT_DTYPE.itemsize, row_bytes=tr.row_dtype(variant.d).itemsize,
                kv_stats=len(KV_STATS), kv_sums=len(KV_MEANS), tensor_map_bytes=TENSOR_MAP_BYTES)
    bad = {k: (getattr(lay, k), v) for k, v in want.items() if getattr(lay, k) != v}
    if bad:
        raise RuntimeError(f"apa_gpu: {variant.name} disagrees with apa_emu (kernel, host): {bad}")
    return lay


def check_struct(read_table, struct: Struct) -> None:
    """Refuse a module whose struct (``read_table(symbol)`` reads its exported table) differs from
    the host's description (params.Struct.layout), nested structs included."""
    got, want = list(read_table(f"apa_params_{struct.name}")), struct.layout()
    if got != want:
        names = {params.name_hash(f): f for f, _ in struct.fields}
        kernel_fields = [f"{names.get(h, '?')}@{o}:{n}" for o, n, h in zip(got[1::3], got[2::3], got[3::3])]
        host_fields = [f"{f}@{o}:{n}" for (f, _), o, n in zip(struct.fields, want[1::3], want[2::3])]
        raise RuntimeError(f"apa_gpu: the kernels' {struct.name} (size {got[0]}: {', '.join(kernel_fields)}) "
                           f"differs from apa_gpu.params (size {want[0]}: {', '.join(host_fields)})")
    for sub in struct.nested():
        check_struct(read_table, sub)


@lru_cache(maxsize=None)
def layout(variant) -> Layout:
    return check_layout(_read_table(variant, "apa_layout"), variant)


@lru_cache(maxsize=None)
def _checked(variant, struct: Struct) -> None:
    check_struct(lambda symbol: _read_table(variant, symbol), struct)


@lru_cache(maxsize=None)
def kernel(variant, name: str, struct: Struct) -> Kernel:
    """Kernel ``name`` of ``variant`` (a build.Variant or PROBE), which takes ``struct``."""
    _checked(variant, struct)
    function, max_smem = backend().function(_module(variant), name)
    return Kernel(name, struct, function, max_smem)


def launch(k: Kernel, grid, block, params: dict, smem: int = 0) -> None:
    """Launch ``k`` on a grid of 1-D blocks with its struct filled from ``params`` (every field
    named: see params.Struct.pack)."""
    be = backend()
    if smem > k.max_smem:
        raise ValueError(f"apa_gpu: {k.name} needs {smem} bytes of shared memory, more than the device's {k.max_smem}")
    be.launch(k.function, tuple(grid), block, k.struct.pack(params, be.address), smem)
    if os.environ.get("APA_GPU_SYNC"):
        try:
            be.synchronize()
        except Exception as e:
            raise RuntimeError(f"apa_gpu: kernel {k.name} failed: {e}") from e


__all__ = ["Kernel", "Layout", "backend", "check_layout", "check_struct", "kernel", "launch", "layout", "usable"]
