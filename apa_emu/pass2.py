"""Pass 2: exact FP16 attention over a warp's hot tiles, in the pass-1 logit frame (numerics.md §8)."""

from __future__ import annotations

import numpy as np
from numba import njit

from .fpmath import exp2, f16r
from .mma import mma_exact, mma_sm90_f16, mma_sm90_f32

ROWS, TILE = 16, 64
NEG_INF = np.float32(-np.inf)


@njit(cache=True)
def pass2_warp(exact, f32_out, q16, valid, lim, sh, qmul, k16, v16_t, tiles, soft, m2, l2, o2):
    """Run pass 2 for one warp over ``tiles`` (its hot tiles, ascending). Writes m2, l2, o2 (§8.6)."""
    d = q16.shape[1]
    m = np.full(ROWS, NEG_INF, dtype=np.float32)
    l4 = np.zeros((ROWS, 4), dtype=np.float32)
    o = np.zeros((ROWS, d), dtype=np.float32)
    s = np.zeros((ROWS, TILE), dtype=np.float32)
    zero_s = np.zeros((ROWS, TILE), dtype=np.float32)
    x = np.zeros((ROWS, TILE), dtype=np.float32)
    p = np.zeros((ROWS, TILE), dtype=np.float32)
    one = np.float32(1)
    zero = np.float32(0)
    for idx in range(tiles.shape[0]):
        t = tiles[idx]
        k0 = t * TILE
        # §8.1 scores: FP16 accumulation (binary32 under the exact model)
        if exact:
            mma_exact(q16, k16[k0:k0 + TILE], zero_s, s)
        else:
            mma_sm90_f16(q16, k16[k0:k0 + TILE], zero_s, s)
        for r in range(ROWS):
            if not valid[r]:
                for j in range(TILE):
                    p[r, j] = zero
                continue
            mx = m[r]
            for j in range(TILE):
                xv = s[r, j] * qmul - sh[r] if k0 + j <= lim[r] else NEG_INF
                x[r, j] = xv
                if xv > mx:
                    mx = xv
            # §8.2 frame
            a = one if mx == m[r] else exp2(m[r] - mx, soft)
            m[r] = mx
            ms = zero if mx == NEG_INF else mx
            for t0 in range(4):
                l4[r, t0] = l4[r, t0] * a
            if f32_out or exact:
                for c in range(d):
                    o[r, c] = o[r, c] * a
            else:
                ah = f16r(a)
                for c in range(d):
                    o[r, c] = f16r(o[r, c] * ah)
            # §8.3–8.4 probabilities and the per-t0 row sums in fragment order
            for j in range(TILE):
                p[r, j] = exp2(x[r, j] - ms, soft)
            for nt in range(8):
                for t0 in range(4):
                    j = 8 * nt + 2 * t0
                    l4[r, t0] = l4[r, t0] + (p[r, j] + p[r, j + 1])
            if not exact:
                for j in range(TILE):
                    p[r, j] = f16r(p[r, j])
        # §8.5 P·V
        if exact:
            mma_exact(p, v16_t[t], o, o)
        elif f32_out:
            mma_sm90_f32(p, v16_t[t], o, o)
        else:
            mma_sm90_f16(p, v16_t[t], o, o)
    # §8.6
    for r in range(ROWS):
        if valid[r]:
            m2[r] = m[r]
            l2[r] = (l4[r, 0] + l4[r, 1]) + (l4[r, 2] + l4[r, 3])
            for c in range(d):
                o2[r, c] = o[r, c]
