"""Log-sum-exp merge of the pass-1 partial and the pass-2 state (numerics.md §9)."""

from __future__ import annotations

import numpy as np

from . import fpmath

F32 = np.float32


def merge(m1, l1, part, m2, l2, o2, soft: bool) -> np.ndarray:
    """§9 (every warp, §9.5) for arrays of rows: m/l [R], part/o2 [R, d] (binary32). Returns the FP16 output [R, d].

    Every step is an elementwise binary32 operation, so the vectorised form rounds exactly as the
    per-row statements of the spec.
    """
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # padding rows: 0/0
        big = np.maximum(m1, m2)  # §9.1
        # exp2 of (−inf) − M is 0 either way; the l > 0 guards also cover m = −inf with M = −inf
        w1 = np.where(l1 > 0, fpmath.exp2_np(np.where(l1 > 0, m1 - big, F32(0)), soft), F32(0)).astype(F32)
        w2 = np.where(l2 > 0, fpmath.exp2_np(np.where(l2 > 0, m2 - big, F32(0)), soft), F32(0)).astype(F32)  # §9.2
        inv = F32(1) / (w1 * l1 + w2 * l2)  # §9.3
        num = w1[:, None] * part + w2[:, None] * o2
        return (num * inv[:, None]).astype(np.float16)  # §9.4
