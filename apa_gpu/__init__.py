"""apa_gpu: the APA CUDA kernel for H200 (sm_90), bitwise equal to apa_emu.

``attention(q, k, v, q_offset=0, config=Config(), *, trace=None)`` mirrors ``apa_emu.attention``
(same validation, same Result); ``available()`` says whether the selected backend can run: CuPy, a
GPU and nvcc, or under ``APA_GPU_BACKEND=sim`` the CPU simulator (apa_gpu/device.py). The kernel
sources are ``cuda/``; ``python -m apa_gpu.build`` compiles every variant into the cache. The studies
and ``apa check`` run it as the engine "gpu" (apa_gpu/engine.py). Of apa_emu, this package imports
only its declared contract (pyproject.toml's import-linter contracts): ``apa_emu.call``,
``apa_emu.result``, ``apa_emu.kvstate``, ``apa_emu.trace`` and the Engine interface.
"""

from apa_emu.call import Config, Shape

from .api import attention, available, check_config, prep_arrays
from .plan import Plan

__all__ = ["Config", "Plan", "Shape", "attention", "available", "check_config", "prep_arrays"]
