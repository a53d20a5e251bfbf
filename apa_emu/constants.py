"""The spec's binary32 constants, by bit pattern, and the per-call constants both the emulator and
the kernel derive from a Config (numerics.md §5.3, §7.4, §7.10). Written once; the launcher passes
the same values to the kernel."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

F32 = np.float32


def f32_bits(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(F32)[0]


LOG2E = f32_bits(0x3FB8AA3B)  # §5.3: qmul = f32(scale ⊗ LOG2E)
LOG2_1536 = f32_bits(0x41295C02)  # §7.4: f32(log2 1536)


class Pass1Consts(NamedTuple):
    """§7.4–7.10 constants of one config, as binary32 (the kernel's Pass1Params carries the same)."""

    eps: np.float32  # §7.7
    delta: np.float32  # §7.8
    tau: np.float32  # §7.2
    A: np.float32  # §7.4: 8 ⊖ τ
    L: np.float32  # §7.4: f32(log2 1536) ⊖ τ
    Kf: np.float32  # §7.10: f32(2^τ ⊘ 1536)


def pass1_consts(eps: float, delta: float, tau: int) -> Pass1Consts:
    t = F32(tau)
    return Pass1Consts(F32(eps), F32(delta), t, F32(8) - t, LOG2_1536 - t, F32(F32(2.0**tau) / F32(1536)))


def qmul(scale: np.float32) -> np.float32:
    """§5.3: the score multiplier f32(scale ⊗ LOG2E)."""
    return F32(F32(scale) * LOG2E)
