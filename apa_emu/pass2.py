"""Pass 2: exact FP16 attention over a warp's hot tiles, in the pass-1 logit frame (numerics.md §8).

``pass2_warp`` reads as §8.1 … §8.6, one helper per section. Rows are independent, so each section
runs as its own loop over the warp's rows; padding rows keep p = 0 and their state untouched.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from .fpmath import exp2, f16r, fma32
from .geometry import ROWS, TILE
from .mma import mma_exact, mma_sm90_f16, mma_sm90_f32

F32 = np.float32
NEG_INF = np.float32(-np.inf)
QUADS = 4  # t0 = 0..3: the per-lane partial row sums of the fragment layout (§6.5)


class P2Rows(NamedTuple):
    valid: np.ndarray  # bool [16] (§6.2)
    lim: np.ndarray  # int64 [16] (§6.1)
    lo: np.ndarray  # int64 [16] (§6.1)
    sh: np.ndarray  # f32 [16]: the row shift q·k̄ ⊗ qmul (§5.3)


class P2Mode(NamedTuple):
    exact: bool  # `exact` model: binary32 everywhere (§3.3)
    f32_out: bool  # p2_accum = "f32" (§8.5)
    f32_scores: bool  # p2_scores = "f32" (§8.1)
    ex2: np.ndarray  # f32: §13.2's MUFU.EX2 table in the fast mode (§2), empty for exp2s
    qmul: np.float32  # §5.3
    fma: bool  # the seed's FMA sites (§1.8): x = fma(float(S), qmul, −sh)


class P2Out(NamedTuple):
    """§8.6: the pass-2 state exported to the merge."""

    m2: np.ndarray  # [16] f32
    l2: np.ndarray  # [16] f32
    o2: np.ndarray  # [16, d] f32
    p2: np.ndarray  # [16] f32: Σ p² (§8.4, for §9.8)

    @classmethod
    def new(cls, d: int) -> "P2Out":
        return cls(np.full(ROWS, NEG_INF, F32), np.zeros(ROWS, F32), np.zeros((ROWS, d), F32), np.zeros(ROWS, F32))


@njit(cache=True)
def p2_scores(mode, q16, k16, t, zero_s, s, rows, x):
    """§8.1: S = q·Kᵀ of tile t in FP16 or binary32 accumulation (binary32 under `exact`), then
    x = (float(S) ⊗ qmul) ⊖ sh, −inf outside the row's keys lo..lim."""
    k0 = t * TILE
    if mode.exact:
        mma_exact(q16, k16[k0:k0 + TILE], zero_s, s)
    elif mode.f32_scores:
        mma_sm90_f32(q16, k16[k0:k0 + TILE], zero_s, s)
    else:
        mma_sm90_f16(q16, k16[k0:k0 + TILE], zero_s, s)
    for r in range(ROWS):
        for j in range(TILE):
            if rows.lo[r] <= k0 + j <= rows.lim[r]:
                x[r, j] = fma32(s[r, j], mode.qmul, -rows.sh[r]) if mode.fma else s[r, j] * mode.qmul - rows.sh[r]
            else:
                x[r, j] = NEG_INF


@njit(cache=True)
def p2_frame(x, valid, mode, m, l4, p4, o):
    """§8.2: move each row's frame to max(m, maxⱼ xⱼ), rescaling l4, p4 (by a twice) and O (FP16 O by
    one binary16 multiply with f16(a))."""
    for r in range(ROWS):
        if not valid[r]:
            continue
        mx = m[r]
        for j in range(TILE):
            if x[r, j] > mx:
                mx = x[r, j]
        a = np.float32(1) if mx == m[r] else exp2(m[r] - mx, mode.ex2)
        m[r] = mx
        for t0 in range(QUADS):
            l4[r, t0] = l4[r, t0] * a
            p4[r, t0] = (p4[r, t0] * a) * a
        if mode.f32_out or mode.exact:
            for c in range(o.shape[1]):
                o[r, c] = o[r, c] * a
        else:
            ah = f16r(a)
            for c in range(o.shape[1]):
                o[r, c] = f16r(o[r, c] * ah)


@njit(cache=True)
def p2_probs(x, valid, m, ex2, p):
    """§8.3: pⱼ = exp2(xⱼ ⊖ ms), ms = 0 for a row whose frame is still −inf; 0 in padding rows."""
    for r in range(ROWS):
        if not valid[r]:
            p[r, :] = 0
            continue
        ms = np.float32(0) if m[r] == NEG_INF else m[r]
        for j in range(TILE):
            p[r, j] = exp2(x[r, j] - ms, ex2)


@njit(cache=True)
def p2_row_sum(p, valid, l4, p4):
    """§8.4: for nt = 0..7 in order, each t0: l4[t0] ← l4[t0] ⊕ (p[8nt+2t0] ⊕ p[8nt+2t0+1]) and
    p4[t0] ← fma(p[8nt+2t0+1], p[8nt+2t0+1], fma(p[8nt+2t0], p[8nt+2t0], p4[t0]))."""
    for r in range(ROWS):
        if valid[r]:
            for nt in range(TILE // 8):
                for t0 in range(QUADS):
                    j = 8 * nt + 2 * t0
                    l4[r, t0] = l4[r, t0] + (p[r, j] + p[r, j + 1])
                    p4[r, t0] = fma32(p[r, j + 1], p[r, j + 1], fma32(p[r, j], p[r, j], p4[r, t0]))


@njit(cache=True)
def p2_pv(mode, p, v16_t, o):
    """§8.5: O = chain of P16·V with C = O; P16 = f16(p) (`exact`: p), FP16 or binary32 accumulation."""
    if mode.exact:
        mma_exact(p, v16_t, o, o)
        return
    for r in range(ROWS):
        for j in range(TILE):
            p[r, j] = f16r(p[r, j])
    if mode.f32_out:
        mma_sm90_f32(p, v16_t, o, o)
    else:
        mma_sm90_f16(p, v16_t, o, o)


@njit(cache=True)
def p2_end(valid, m, l4, p4, o, out):
    """§8.6: l2 = (l4[0] ⊕ l4[1]) ⊕ (l4[2] ⊕ l4[3]), P2 the same of p4, m2 = m, o2 = float(O), per
    valid row."""
    for r in range(ROWS):
        if valid[r]:
            out.m2[r] = m[r]
            out.p2[r] = (p4[r, 0] + p4[r, 1]) + (p4[r, 2] + p4[r, 3])
            out.l2[r] = (l4[r, 0] + l4[r, 1]) + (l4[r, 2] + l4[r, 3])
            for c in range(o.shape[1]):
                out.o2[r, c] = o[r, c]


@njit(cache=True)
def pass2_warp(mode, rows, q16, k16, v16_t, tiles, out):
    """Pass 2 of one warp over ``tiles`` (its hot tiles, ascending, §8). Writes ``out`` (§8.6)."""
    m = np.full(ROWS, NEG_INF, F32)
    l4 = np.zeros((ROWS, QUADS), F32)
    p4 = np.zeros((ROWS, QUADS), F32)
    o = np.zeros((ROWS, q16.shape[1]), F32)
    s = np.zeros((ROWS, TILE), F32)
    zero_s = np.zeros((ROWS, TILE), F32)
    x = np.zeros((ROWS, TILE), F32)
    p = np.zeros((ROWS, TILE), F32)
    for idx in range(tiles.shape[0]):
        t = tiles[idx]
        p2_scores(mode, q16, k16, t, zero_s, s, rows, x)
        p2_frame(x, rows.valid, mode, m, l4, p4, o)
        p2_probs(x, rows.valid, m, mode.ex2, p)
        p2_row_sum(p, rows.valid, l4, p4)
        p2_pv(mode, p, v16_t[t], o)
    p2_end(rows.valid, m, l4, p4, o, out)
