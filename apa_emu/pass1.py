"""Pass 1: FP4 scores, the lazy frame, UE4M3 P scales, the hot test and cold P·V (numerics.md §7).

One Numba function, ``pass1_warp``, runs one warp of 16 packed rows over its visiting order; it reads
as §7.1 … §7.10, one helper per section, each named like its twin in ``cuda/pass1.cuh``. The per-row
statements of the spec become loops over rows; the warp votes are ``any`` over the rows that run (§6.2).

Arguments come in groups (Numba takes NamedTuples): ``P1Operands`` (what prep made), ``P1Rows`` (the
warp's rows), ``P1Mode`` (the model and switches), ``constants.Pass1Consts``, ``P1State`` (the running
frame and sums), ``P1Out`` (§7.10) and ``trace.VisitTrace`` (§10).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from .constants import EXACT, SM120
from .formats import E2M1_VALUES, e2m1_code, ue4m3_value
from .fpmath import LG2, exp2, f16_bits, f16_value, f16r, fma32
from .sfu import mufu_ex2_f16
from .geometry import GROUP, GROUPS, ROWS, TILE
from .mma import mma_exact, mma_sm90_f32, mma_sm120

F32 = np.float32
NEG_INF = np.float32(-np.inf)
ONE_CODE, ONE_SCALE = np.uint8(2), np.uint8(0x38)  # E2M1 1.0 and UE4M3 1.0: the §7.6 ones (sm120)


class FP4Operands(NamedTuple):
    """The E2M1 codes and UE4M3 scales the `sm120` model multiplies (§3.2). The other models read the
    folded values instead and pass ``FP4Operands.unused()``: Numba compiles one signature, so the
    fields must be arrays of the right type even when nothing reads them."""

    q_codes: np.ndarray  # [terms, 16, d] u8
    q_scales: np.ndarray  # [terms, 16, d/16] u8
    k_codes: np.ndarray  # [T*64, d]
    k_scales: np.ndarray  # [T*64, d/16]
    v_codes_t: np.ndarray  # [T, d, 64]
    v_scales_t: np.ndarray  # [T, d, 4]

    @classmethod
    def unused(cls) -> "FP4Operands":
        u3, u2 = np.zeros((1, ROWS, GROUP), np.uint8), np.zeros((ROWS, GROUP), np.uint8)
        return cls(u3, u3, u2, u2, u3, u3)


class P1Operands(NamedTuple):
    qhat: np.ndarray  # [16, d] f32, the warp's Q̂ rows (0 for padding rows)
    khat: np.ndarray  # [T*64, d] f32
    vhat_t: np.ndarray  # [T, d, 64] f32, keys in slot order
    nu_t: np.ndarray  # [T, 64] f32, §5.8's ν in slot order (output test; else [1, 64] unread)
    fp4: FP4Operands


class P1Rows(NamedTuple):
    valid: np.ndarray  # bool [16]: the real rows, exported and traced (§6.2)
    runs: np.ndarray  # bool [16]: the rows that run §7 and vote (the real ones; all under pad_vote, §6.2)
    lim: np.ndarray  # int64 [16] (§6.1)
    lo: np.ndarray  # int64 [16] (§6.1)
    cq: np.ndarray  # f32 [16] (§5.3)
    beta: np.ndarray  # f32 [16]: the budget test's βr (§7.7; unread under the other tests)


class P1Mode(NamedTuple):
    model: int  # SM90 | SM120 | EXACT (§3)
    ex2: np.ndarray  # f32: §13.2's MUFU.EX2 table in the fast mode (§2), empty for exp2s
    ex2_f16: np.ndarray  # uint16: §13.4's MUFU.EX2.F16 table in the fast mode, empty for exp2s
    pow2: bool  # P scales (§7.4)
    quant_p: bool  # P' quantized (§7.5)
    slots: np.ndarray  # int64 [64]: key of each slot (§7.3)
    vk: np.float32  # §7.10: vg ⊗ Kf
    output: bool  # the output hot test (§7.7)
    fma: bool  # the seed's FMA sites (§1.8)
    direct: bool  # direct_store with pass 1 run: a warp with no hot tile exports §9.5's direct output
    vg: np.float32  # §5.2 (the direct store's vg ⊘ lc)
    budget: bool = False  # the budget hot test (§7.7)


class P1State(NamedTuple):
    """The running state of §7 per row: frame m, all-tile sum la, cold sum lc, cold scale sum ad,
    cold output o, the output test's value-weighted sum lv (+0 under the mass and budget tests) and the
    cold Σ P̂² ws of §9.8."""

    m: np.ndarray
    la: np.ndarray
    lc: np.ndarray
    ad: np.ndarray
    o: np.ndarray
    lv: np.ndarray
    ws: np.ndarray


class P1Out(NamedTuple):
    """§7.10 export and the hot mask."""

    part: np.ndarray  # [16, d] f32
    m1: np.ndarray  # [16] f32
    l1: np.ndarray  # [16] f32
    ad1: np.ndarray  # [16] f32
    ws1: np.ndarray  # [16] f32 (§9.8)
    hot_words: np.ndarray  # [W] u32

    @classmethod
    def new(cls, d: int, ntiles: int) -> "P1Out":
        return cls(np.zeros((ROWS, d), F32), np.full(ROWS, NEG_INF, F32), np.zeros(ROWS, F32), np.zeros(ROWS, F32),
                   np.zeros(ROWS, F32), np.zeros(-(-ntiles // 32), np.uint32))


@njit(cache=True)
def p1_mma(model, a, a_codes, a_scales, b, b_codes, b_scales, c, out):
    """§3: out = A·Bᵀ + C under the model; `sm120` multiplies codes and scales, the others values."""
    if model == SM120:
        mma_sm120(a_codes, a_scales, b_codes, b_scales, c, out)
    elif model == EXACT:
        mma_exact(a, b, c, out)
    else:
        mma_sm90_f32(a, b, c, out)


@njit(cache=True)
def p1_scores(model, ops, t, zero_s, s):
    """§7.1: s = Q̂·K̂ᵀ of tile t from C = +0; `sm120` chains the Q terms (Q₁ then Q₂)."""
    k0, fp4 = t * TILE, ops.fp4
    kc, ks = fp4.k_codes[k0:k0 + TILE], fp4.k_scales[k0:k0 + TILE]
    p1_mma(model, ops.qhat, fp4.q_codes[0], fp4.q_scales[0], ops.khat[k0:k0 + TILE], kc, ks, zero_s, s)
    if model == SM120:
        for term in range(1, fp4.q_codes.shape[0]):
            mma_sm120(fp4.q_codes[term], fp4.q_scales[term], kc, ks, s, s)


@njit(cache=True)
def p1_frame(s, k0, rows, slots, tau, m, gm, c):
    """§7.2: group maxima gm over visible keys (slot groups, §7.3), the warp's vote on moving the
    frame by more than τ, and the candidate frame c."""
    mx = np.empty(ROWS, F32)
    vote = False
    for r in range(ROWS):
        rowmax = NEG_INF
        for g in range(GROUPS):
            gmax = NEG_INF
            for i in range(GROUP):
                j = slots[g * GROUP + i]
                if rows.lo[r] <= k0 + j <= rows.lim[r] and s[r, j] > gmax:
                    gmax = s[r, j]
            gm[r, g] = gmax
            if gmax > rowmax:
                rowmax = gmax
        mx[r] = rowmax * rows.cq[r]
        if rows.runs[r] and mx[r] > m[r] + tau:
            vote = True
    for r in range(ROWS):
        c[r] = m[r]
        if vote and mx[r] > m[r]:
            c[r] = mx[r]


@njit(cache=True)
def p1_pscale(gm, cq, c, k, mode):
    """§7.4: the UE4M3 code kb of one (row, group), the bias of its P' exponents, and §7.8's bound
    a_g = min(dec(kb), 24 ⊗ exp2(u₀)) of what the group's keys weigh below the E2M1 grid."""
    u0 = fma32(gm, cq, k.A - c) if mode.fma else gm * cq + (k.A - c)
    u = min(max(u0, np.float32(-6)), np.float32(8))
    fl = np.floor(u)
    if mode.pow2:
        cu = np.ceil(u)
        kb, bias = 8 * (int(cu) + 7), (k.L - c) - cu
    else:
        e = exp2(u - fl, mode.ex2)
        mi = min(max(int(np.ceil((e - np.float32(1)) * np.float32(8))), 0), 8)
        kb, bias = 8 * (int(fl) + 7) + mi, (k.L - c) - (fl + LG2[mi])
    return kb, bias, min(ue4m3_value(np.uint8(kb)), np.float32(24) * exp2(u0, mode.ex2))


@njit(cache=True)
def p1_pprime(y, cq, bias, mode):
    """§7.5: P' = exp2((s ⊗ c_q) ⊕ bias), or exp2(fma(s, c_q, bias)) (§1.8); the fast quantized mode
    (§2) takes y by one FMA and MUFU.EX2.F16 of f16(min(y, 4)) (§13.4)."""
    if mode.quant_p and mode.ex2.size:
        h = f16r(min(fma32(y, cq, bias), np.float32(4)))
        return f16_value(mufu_ex2_f16(f16_bits(h), mode.ex2_f16))
    return exp2(fma32(y, cq, bias) if mode.fma else y * cq + bias, mode.ex2)


@njit(cache=True)
def p1_phat(s, k0, rows, gm, c, k, mode, phat, pcodes, pscales, amass):
    """§7.4–7.5 for every running row: P scales per group, then P̂ = e2m1(P')·dec(kb) (quantized) or
    P' ⊗ dec(kb), and each group's a_g (§7.8). Padding rows (unless they vote, §6.2), rows with no
    visible key yet (c = −inf, §7.4) and invisible keys give 0."""
    for r in range(ROWS):
        if not rows.runs[r] or c[r] == NEG_INF:
            phat[r, :] = 0
            pcodes[r, :] = 0
            pscales[r, :] = 0
            amass[r, :] = 0
            continue
        for g in range(GROUPS):
            kb, bias, amass[r, g] = p1_pscale(gm[r, g], rows.cq[r], c[r], k, mode)
            pscales[r, g] = kb
            scale = ue4m3_value(np.uint8(kb))
            for i in range(GROUP):
                slot = g * GROUP + i
                j = mode.slots[slot]
                visible = rows.lo[r] <= k0 + j <= rows.lim[r]
                pp = (p1_pprime(s[r, j], rows.cq[r], bias, mode) if visible
                      else np.float32(0))
                if mode.quant_p:
                    code = e2m1_code(pp)
                    pcodes[r, slot] = code
                    phat[r, slot] = E2M1_VALUES[code] * scale
                else:
                    ph = pp * scale
                    phat[r, slot] = ph if mode.model == EXACT else f16r(ph)


@njit(cache=True)
def p1_row_sums(model, phat, pcodes, pscales, nu, output, tl2):
    """§7.6: tl = chain of P̂ against ones from C = +0 (`sm120`: E2M1 ones with scale 1) in column 0;
    under the output test tv = chain of P̂ against the tile's ν in column 1 (`exact`: §3.3; else the
    `sm90` chain, ν being FP16)."""
    ones = np.ones((1, TILE), F32)
    tl = np.zeros((ROWS, 1), F32)
    p1_mma(model, phat, pcodes, pscales, ones, np.full((1, TILE), ONE_CODE, np.uint8),
           np.full((1, GROUPS), ONE_SCALE, np.uint8), np.zeros((ROWS, 1), F32), tl)
    tl2[:, 0] = tl[:, 0]
    tl2[:, 1] = 0
    if output:
        tv = np.zeros((ROWS, 1), F32)
        if model == EXACT:
            mma_exact(phat, nu.reshape(1, TILE), np.zeros((ROWS, 1), F32), tv)
        else:
            mma_sm90_f32(phat, nu.reshape(1, TILE), np.zeros((ROWS, 1), F32), tv)
        tl2[:, 1] = tv[:, 0]


@njit(cache=True)
def p1_hot_test(tl2, t2, rows, st, c, eps, mode):
    """§7.7: hot if any running row has tl > ε ⊗ ((la ⊗ a) ⊕ tl), a = exp2(m ⊖ c), or ε ⊗ fma(la, a, tl)
    (§1.8); the output test compares tv with lv instead; the budget test has ((ws ⊗ a) ⊗ a) ⊕ t2 >
    βr ⊗ (L ⊗ L), L = (la ⊗ a) ⊕ tl."""
    for r in range(ROWS):
        if rows.runs[r]:
            a = np.float32(1) if c[r] == st.m[r] else exp2(st.m[r] - c[r], mode.ex2)
            if mode.budget:
                big = st.la[r] * a + tl2[r, 0]
                if (st.ws[r] * a) * a + t2[r] > rows.beta[r] * (big * big):
                    return True
                continue
            x, run = (tl2[r, 1], st.lv[r]) if mode.output else (tl2[r, 0], st.la[r])
            if x > eps * (fma32(run, a, x) if mode.fma else run * a + x):
                return True
    return False


@njit(cache=True)
def p1_update(x, runs, st, ex2):
    """§7.9: move every running row's frame to x, rescaling its sums and its cold output."""
    for r in range(ROWS):
        if runs[r] and x[r] != st.m[r]:
            alpha = exp2(st.m[r] - x[r], ex2)
            for ch in range(st.o.shape[1]):
                st.o[r, ch] = st.o[r, ch] * alpha + np.float32(0)  # an underflowed −0 becomes +0
            st.lc[r] = st.lc[r] * alpha
            st.la[r] = st.la[r] * alpha
            st.ad[r] = st.ad[r] * alpha
            st.ws[r] = (st.ws[r] * alpha) * alpha
            st.lv[r] = st.lv[r] * alpha
            st.m[r] = x[r]


@njit(cache=True)
def p1_self_sums(model, phat, runs, t2):
    """§7.6 t2: per running row, the chain of P̂ᵣ against itself from C = +0 (`exact`: §3.3, else the
    `sm90` chain, P̂ being FP16-exact), the tile's Σ P̂² of §9.8."""
    zero, one = np.zeros((1, 1), F32), np.zeros((1, 1), F32)
    for r in range(ROWS):
        t2[r] = 0
        if runs[r]:
            row = phat[r:r + 1]
            if model == EXACT:
                mma_exact(row, row, zero, one)
            else:
                mma_sm90_f32(row, row, zero, one)
            t2[r] = one[0, 0]


@njit(cache=True)
def p1_branch(hot, t, tl2, t2, c, rows, ops, k, mode, phat, pcodes, pscales, amass, st, hot_words):
    """§7.8: a hot tile moves the frame to max(m, c ⊖ δ), adds its sum to la alone (tv to lv) and
    sets its hot bit; a cold tile moves it to c, adds its sum to la and lc (tv to lv), its groups'
    a_g to ad, its Σ P̂² t2 to ws (§9.8; formed here unless the budget test formed it) and its P̂·V̂ to o.
    t2 is left +0 on a hot tile (§10), under the budget test too."""
    if hot:
        t2[:] = 0
        f = np.empty(ROWS, F32)
        for r in range(ROWS):
            f[r] = max(st.m[r], c[r] - k.delta) if rows.runs[r] else st.m[r]
        p1_update(f, rows.runs, st, mode.ex2)
        for r in range(ROWS):
            if rows.runs[r]:
                b = np.float32(1) if f[r] == c[r] else exp2(c[r] - f[r], mode.ex2)
                st.la[r] = fma32(tl2[r, 0], b, st.la[r]) if mode.fma else st.la[r] + tl2[r, 0] * b
                if mode.output:
                    st.lv[r] = fma32(tl2[r, 1], b, st.lv[r]) if mode.fma else st.lv[r] + tl2[r, 1] * b
        hot_words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    else:
        if not mode.budget:
            p1_self_sums(mode.model, phat, rows.runs, t2)
        p1_update(c, rows.runs, st, mode.ex2)
        for r in range(ROWS):
            if rows.runs[r]:
                st.la[r] = st.la[r] + tl2[r, 0]
                if mode.output:
                    st.lv[r] = st.lv[r] + tl2[r, 1]
                st.lc[r] = st.lc[r] + tl2[r, 0]
                st.ad[r] = st.ad[r] + (((amass[r, 0] + amass[r, 1]) + amass[r, 2]) + amass[r, 3])
                st.ws[r] = st.ws[r] + t2[r]
        fp4 = ops.fp4
        p1_mma(mode.model, phat, pcodes, pscales, ops.vhat_t[t], fp4.v_codes_t[t], fp4.v_scales_t[t],
               st.o, st.o)


@njit(cache=True)
def p1_record(trace, visit, t, hot, c, st, tl2, t2, valid):
    """§10: one visit record (valid rows; padding rows keep +0)."""
    trace.tile[visit] = t
    trace.hot[visit] = 1 if hot else 0
    for r in range(ROWS):
        if valid[r]:
            trace.c[visit, r] = c[r]
            trace.m[visit, r] = st.m[r]
            trace.tl[visit, r] = tl2[r, 0]
            trace.la[visit, r] = st.la[r]
            trace.lc[visit, r] = st.lc[r]
            trace.tv[visit, r] = tl2[r, 1]
            trace.lv[visit, r] = st.lv[r]
            trace.t2[visit, r] = t2[r]
            trace.ws[visit, r] = st.ws[r]


@njit(cache=True, error_model="numpy")  # vg ⊘ lc is IEEE: +inf for lc = 0 (every cold P̂ zero), as in the kernel
def p1_export(st, valid, mode, Kf, out):
    """§7.10: part = o ⊗ vk, m1 = m, l1 = lc ⊗ Kf, ad1 = ad ⊗ Kf, ws1 = (ws ⊗ Kf) ⊗ Kf per valid row; under ``direct_store``
    a warp with no hot tile exports part = o ⊗ (vg ⊘ lc), §9.5's direct output."""
    direct = mode.direct and not out.hot_words.any()
    for r in range(ROWS):
        if valid[r]:
            f = mode.vg / st.lc[r] if direct else mode.vk
            for ch in range(st.o.shape[1]):
                out.part[r, ch] = st.o[r, ch] * f
            out.m1[r] = st.m[r]
            out.l1[r] = st.lc[r] * Kf
            out.ad1[r] = st.ad[r] * Kf
            out.ws1[r] = (st.ws[r] * Kf) * Kf


@njit(cache=True)
def pass1_warp(ops, rows, mode, k, order, traced, trace, out):
    """Pass 1 of one warp (§7) over ``order`` (§6.4). Writes ``out`` and, if ``traced``, ``trace``."""
    st = P1State(np.full(ROWS, NEG_INF, F32), np.zeros(ROWS, F32), np.zeros(ROWS, F32), np.zeros(ROWS, F32),
                 np.zeros((ROWS, ops.qhat.shape[1]), F32), np.zeros(ROWS, F32), np.zeros(ROWS, F32))
    s = np.zeros((ROWS, TILE), F32)
    zero_s = np.zeros((ROWS, TILE), F32)
    phat = np.zeros((ROWS, TILE), F32)
    pcodes = np.zeros((ROWS, TILE), np.uint8)
    pscales = np.zeros((ROWS, GROUPS), np.uint8)
    amass = np.zeros((ROWS, GROUPS), F32)
    tl2 = np.zeros((ROWS, 2), F32)  # tl, tv
    t2 = np.zeros(ROWS, F32)
    gm = np.zeros((ROWS, GROUPS), F32)
    c = np.zeros(ROWS, F32)
    for visit in range(order.shape[0]):
        t = order[visit]
        p1_scores(mode.model, ops, t, zero_s, s)
        p1_frame(s, t * TILE, rows, mode.slots, k.tau, st.m, gm, c)
        p1_phat(s, t * TILE, rows, gm, c, k, mode, phat, pcodes, pscales, amass)
        p1_row_sums(mode.model, phat, pcodes, pscales, ops.nu_t[t if mode.output else 0], mode.output, tl2)
        if mode.budget:  # §7.6: the budget test reads t2 on every tile
            p1_self_sums(mode.model, phat, rows.runs, t2)
        hot = p1_hot_test(tl2, t2, rows, st, c, k.eps, mode)
        p1_branch(hot, t, tl2, t2, c, rows, ops, k, mode, phat, pcodes, pscales, amass, st, out.hot_words)
        if traced:
            p1_record(trace, visit, t, hot, c, st, tl2, t2, rows.valid)
    p1_export(st, rows.valid, mode, k.Kf, out)
