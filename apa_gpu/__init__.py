"""apa_gpu: the APA CUDA kernel for H200 (sm_90), launched with CuPy, bitwise equal to apa_emu.

``attention(q, k, v, q_offset=0, config=Config(), *, trace=None)`` mirrors ``apa_emu.attention``
(same validation, same Result); ``available()`` says whether a GPU, CuPy and nvcc are present.
The kernel sources are ``cuda/``; ``python -m apa_gpu.build`` compiles every variant into the cache.
"""

from apa_emu.config import Config

from .launch import Plan, Shape, attention, available, check_config, prep_arrays

__all__ = ["Config", "Plan", "Shape", "attention", "available", "check_config", "prep_arrays"]
