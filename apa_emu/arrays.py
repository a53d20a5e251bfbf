"""Arrays in and out of ``attention``: NumPy, or any array that speaks DLPack (``__dlpack__`` and
``__dlpack_device__``: torch tensors, JAX arrays, CuPy arrays), on the host or on a CUDA device.

An input is imported once, in ``apa_emu.call.resolve_call``: a host array becomes a NumPy array and a
CUDA one a CuPy array, each sharing the caller's memory (``np.from_dlpack``, ``cupy.from_dlpack``), so
that the engines see NumPy or CuPy alone. A strided tensor is imported with its strides; what needs
it contiguous (the kernel's launcher) copies it then. A tensor that requires grad is detached first:
attention here is inference only, no gradient flows back, and DLPack refuses to export such a tensor.
``like`` gives an engine's NumPy result back as the caller's kind of array, on the caller's device,
through the ``from_dlpack`` of its library. CuPy is imported only when a device array arrives; torch
and JAX never (an array of theirs has imported them already).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

# DLPack device types whose memory the host reads, which np.from_dlpack imports: kDLCPU, kDLCUDAHost,
# kDLROCMHost, kDLCUDAManaged
HOST = frozenset({1, 3, 11, 13})
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 10: "rocm",
                 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}


def speaks_dlpack(x) -> bool:
    """Whether ``x`` is an array that DLPack can import (NumPy arrays included)."""
    return hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")


def device(x) -> tuple[int, int]:
    """The DLPack device (type, index) of ``x``; the host, (1, 0), for anything that speaks no DLPack."""
    if isinstance(x, np.ndarray) or not speaks_dlpack(x):
        return 1, 0
    kind, index = x.__dlpack_device__()
    return int(kind), int(index)


def where(x) -> str:
    """``x``'s device in words, as torch names it: "cpu:0", "cuda:1"."""
    kind, index = device(x)
    return f"{_DEVICE_NAMES.get(kind, f'DLPack device type {kind}')}:{index}"


def _cupy(name: str, x):
    try:
        import cupy
    except ImportError as e:
        raise ValueError(f"{name}: an array on {where(x)} needs CuPy to be read (pip install cupy-cuda13x)") from e
    return cupy


def imported(name: str, x, expected: str):
    """``x`` as a NumPy array (on the host) or a CuPy array (on a CUDA device), sharing its memory.
    NumPy arrays, and objects that speak no DLPack, come back as they are: the checks that follow name
    what they are. What DLPack cannot import (a bfloat16 tensor) is one ValueError naming ``name`` and
    what was ``expected`` of it ("dtype float16")."""
    if isinstance(x, np.ndarray) or not speaks_dlpack(x):
        return x
    x = _detached(x)
    on_host = device(x)[0] in HOST
    module = np if on_host else _cupy(name, x)
    try:
        return module.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        on = "" if on_host else f" on {where(x)}"
        why = (str(e).strip().splitlines() or ["no reason given"])[0]
        raise ValueError(f"{name}: expected {expected}, got {getattr(x, 'dtype', type(x).__name__)}{on} "
                         f"(DLPack: {why})") from e


def _detached(x):
    """A tensor that requires grad, detached (DLPack refuses to export it; nothing flows back)."""
    return x.detach() if getattr(x, "requires_grad", False) and hasattr(x, "detach") else x


def host(name: str, x, expected: str):
    """``x`` as ``imported`` does, but on the host: an array on a device copied over, by its own
    library where it honours DLPack 1.0's ``dl_device`` (torch does), else through CuPy. For the small
    tables a call reads on the host (block_table, cu_seqlens) and an engine's results, which
    ``apa check`` compares there."""
    if device(x)[0] in HOST:
        return imported(name, x, expected)
    try:
        return np.from_dlpack(_detached(x), device="cpu", copy=True)
    except (BufferError, NotImplementedError, RuntimeError, TypeError, ValueError):
        return imported(name, x, expected).get()  # a CuPy array: its host copy


def require_host(**arrays) -> None:
    """Refuse, in one line naming it, an array on a device: the emulator runs on the host, and moving
    the caller's array there is a copy as large as the problem, the caller's to choose."""
    for name, x in arrays.items():
        if device(x)[0] not in HOST:
            raise ValueError(f"{name}: an array on {where(x)}; apa_emu.attention runs on the host: pass a host "
                             f"array (torch: x.cpu()), or run it on the GPU with apa_gpu.attention")


def _from_dlpack(x) -> Callable:
    """The ``from_dlpack`` of ``x``'s library: its top module's (torch, cupy), else its array
    namespace's (JAX: jax.numpy); NumPy's when neither has one."""
    make = getattr(sys.modules.get(type(x).__module__.partition(".")[0]), "from_dlpack", None)
    if make is None and hasattr(x, "__array_namespace__"):
        make = getattr(x.__array_namespace__(), "from_dlpack", None)
    return make or np.from_dlpack


def like(x) -> Callable | None:
    """A function that gives a NumPy result array back as ``x``'s kind of array on ``x``'s device (a
    torch tensor in, torch tensors out), sharing memory on the host; None for a NumPy ``x``. Other
    values, and §10's structured records, which DLPack cannot carry, pass as they are."""
    if isinstance(x, np.ndarray) or not speaks_dlpack(x):
        return None
    make, (kind, index) = _from_dlpack(x), device(x)

    def back(a):
        if not isinstance(a, np.ndarray) or a.dtype.names is not None:
            return a
        if kind not in HOST:
            cupy = _cupy("result", x)
            with cupy.cuda.Device(index):
                a = cupy.asarray(a)
        return make(a)

    return back
