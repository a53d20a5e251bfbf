"""Pass 1: FP4 scores, the lazy frame, UE4M3 P scales, the hot test and cold P·V (numerics.md §7).

One Numba function runs one warp of 16 packed rows over its visiting order. The per-row statements of
the spec become loops over rows; the warp votes are ``any`` over valid rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .formats import E2M1_VALUES, e2m1_code, ue4m3_value
from .fpmath import LG2, exp2, f16r
from .mma import mma_exact, mma_sm90_f32, mma_sm120

F32 = np.float32
NEG_INF = np.float32(-np.inf)
ROWS, TILE, GROUP = 16, 64, 16
SM90, SM120, EXACT = 0, 1, 2
# f32(log2 1536), §7.4
LOG2_1536 = np.array([0x41295C02], dtype=np.uint32).view(np.float32)[0]
ONE_CODE, ONE_SCALE = np.uint8(2), np.uint8(0x38)


@njit(cache=True)
def _update(x, m, la, lc, o, valid, soft):
    """§7.9: move every row's frame to x, rescaling its sums and its cold output."""
    for r in range(ROWS):
        if valid[r] and x[r] != m[r]:
            alpha = exp2(m[r] - x[r], soft)
            for c in range(o.shape[1]):
                o[r, c] = o[r, c] * alpha
            lc[r] = lc[r] * alpha
            la[r] = la[r] * alpha
            m[r] = x[r]


@njit(cache=True)
def pass1_warp(
    model, qhat, q_codes, q_scales, valid, lim, cq,
    khat, k_codes, k_scales, vhat_t, v_codes_t, v_scales_t,
    order, slots, eps, delta, tau, soft, pow2, quant_p, kf, vk,
    part, m1, l1, hot_words,
    trace, tr_tile, tr_hot, tr_c, tr_m, tr_tl, tr_la, tr_lc,
):
    """Run pass 1 for one warp (§7). Writes part/m1/l1 (§7.10), the hot mask and, if traced, the
    per-visit records. Arrays are per (b, hk); ``order`` lists the tiles in visiting order (§6.4)."""
    d = qhat.shape[1]
    m = np.full(ROWS, NEG_INF, dtype=np.float32)
    la = np.zeros(ROWS, dtype=np.float32)
    lc = np.zeros(ROWS, dtype=np.float32)
    o = np.zeros((ROWS, d), dtype=np.float32)
    s = np.zeros((ROWS, TILE), dtype=np.float32)
    zero_s = np.zeros((ROWS, TILE), dtype=np.float32)
    phat = np.zeros((ROWS, TILE), dtype=np.float32)
    pcodes = np.zeros((ROWS, TILE), dtype=np.uint8)
    pscales = np.zeros((ROWS, 4), dtype=np.uint8)
    tl2 = np.zeros((ROWS, 1), dtype=np.float32)
    zero_tl = np.zeros((ROWS, 1), dtype=np.float32)
    ones = np.ones((1, TILE), dtype=np.float32)
    ones_codes = np.full((1, TILE), ONE_CODE, dtype=np.uint8)
    ones_scales = np.full((1, 4), ONE_SCALE, dtype=np.uint8)
    gm = np.zeros((ROWS, 4), dtype=np.float32)
    c = np.zeros(ROWS, dtype=np.float32)
    f = np.zeros(ROWS, dtype=np.float32)
    mx = np.zeros(ROWS, dtype=np.float32)
    tauf = np.float32(tau)
    shift_a = np.float32(8) - tauf
    lconst = LOG2_1536 - tauf
    one = np.float32(1)

    for visit in range(order.shape[0]):
        t = order[visit]
        k0 = t * TILE
        # §7.1 scores
        if model == SM120:
            mma_sm120(q_codes[0], q_scales[0], k_codes[k0:k0 + TILE], k_scales[k0:k0 + TILE], zero_s, s)
            for term in range(1, q_codes.shape[0]):
                mma_sm120(q_codes[term], q_scales[term], k_codes[k0:k0 + TILE], k_scales[k0:k0 + TILE], s, s)
        elif model == EXACT:
            mma_exact(qhat, khat[k0:k0 + TILE], zero_s, s)
        else:
            mma_sm90_f32(qhat, khat[k0:k0 + TILE], zero_s, s)

        # §7.2 group maxima (over slots) and the lazy frame vote
        vote = False
        for r in range(ROWS):
            rowmax = NEG_INF
            for g in range(4):
                gmax = NEG_INF
                for i in range(GROUP):
                    j = slots[g * GROUP + i]
                    if k0 + j <= lim[r] and s[r, j] > gmax:
                        gmax = s[r, j]
                gm[r, g] = gmax
                if gmax > rowmax:
                    rowmax = gmax
            mx[r] = rowmax * cq[r]
            if valid[r] and mx[r] > m[r] + tauf:
                vote = True
        for r in range(ROWS):
            c[r] = m[r]
            if vote and mx[r] > m[r]:
                c[r] = mx[r]

        # §7.4–7.5 P scales and P'
        for r in range(ROWS):
            if not valid[r]:
                for jj in range(TILE):
                    phat[r, jj] = 0
                    pcodes[r, jj] = 0
                for g in range(4):
                    pscales[r, g] = 0
                continue
            lc_r = lconst - c[r]
            for g in range(4):
                u = gm[r, g] * cq[r] + (shift_a - c[r])
                u = max(u, np.float32(-6))
                u = min(u, np.float32(8))
                fl = np.floor(u)
                if pow2:
                    cu = np.ceil(u)
                    kb = 8 * (int(cu) + 7)
                    bias = lc_r - cu
                else:
                    e = exp2(u - fl, soft)
                    mi = min(max(int(np.ceil((e - one) * np.float32(8))), 0), 8)
                    kb = 8 * (int(fl) + 7) + mi
                    bias = lc_r - (fl + LG2[mi])
                pscales[r, g] = kb
                scale = ue4m3_value(np.uint8(kb))
                for i in range(GROUP):
                    slot = g * GROUP + i
                    j = slots[slot]
                    if k0 + j <= lim[r]:
                        if quant_p and not soft:  # §7.5 fast: y by an FMA, binary16 hardware exp2 (model)
                            y = np.float32(np.float64(s[r, j]) * np.float64(cq[r]) + np.float64(bias))
                            pp = f16r(exp2(f16r(min(y, np.float32(4))), False))
                        else:
                            pp = exp2(s[r, j] * cq[r] + bias, soft)
                    else:
                        pp = np.float32(0)
                    if quant_p:
                        code = e2m1_code(pp)
                        pcodes[r, slot] = code
                        phat[r, slot] = E2M1_VALUES[code] * scale
                    else:
                        ph = pp * scale
                        phat[r, slot] = ph if model == EXACT else f16r(ph)

        # §7.6 tile row sums
        if model == SM120:
            mma_sm120(pcodes, pscales, ones_codes, ones_scales, zero_tl, tl2)
        elif model == EXACT:
            mma_exact(phat, ones, zero_tl, tl2)
        else:
            mma_sm90_f32(phat, ones, zero_tl, tl2)

        # §7.7 hot test
        hot = False
        for r in range(ROWS):
            if valid[r]:
                a = one if c[r] == m[r] else exp2(m[r] - c[r], soft)
                tl = tl2[r, 0]
                if tl > eps * (la[r] * a + tl):
                    hot = True

        # §7.8 branches
        if hot:
            for r in range(ROWS):
                f[r] = max(m[r], c[r] - delta) if valid[r] else m[r]
            _update(f, m, la, lc, o, valid, soft)
            for r in range(ROWS):
                if valid[r]:
                    b = one if f[r] == c[r] else exp2(c[r] - f[r], soft)
                    la[r] = la[r] + tl2[r, 0] * b
            hot_words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
        else:
            _update(c, m, la, lc, o, valid, soft)
            for r in range(ROWS):
                if valid[r]:
                    la[r] = la[r] + tl2[r, 0]
                    lc[r] = lc[r] + tl2[r, 0]
            if model == SM120:
                mma_sm120(pcodes, pscales, v_codes_t[t], v_scales_t[t], o, o)
            elif model == EXACT:
                mma_exact(phat, vhat_t[t], o, o)
            else:
                mma_sm90_f32(phat, vhat_t[t], o, o)

        if trace:
            tr_tile[visit] = t
            tr_hot[visit] = 1 if hot else 0
            for r in range(ROWS):
                if valid[r]:
                    tr_c[visit, r] = c[r]
                    tr_m[visit, r] = m[r]
                    tr_tl[visit, r] = tl2[r, 0]
                    tr_la[visit, r] = la[r]
                    tr_lc[visit, r] = lc[r]

    # §7.10 export
    for r in range(ROWS):
        if valid[r]:
            for ch in range(d):
                part[r, ch] = o[r, ch] * vk
            m1[r] = m[r]
            l1[r] = lc[r] * kf
