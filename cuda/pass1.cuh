// pass1.cuh: pass 1 per warp of 16 packed rows (docs/numerics.md §7), the twin of apa_emu/pass1.py; the
// CTA of WARPS warps (§6.2) that runs it is pass1_cta.cuh.
//
// Per lane (g = lane>>2, t0 = lane&3) the warp state (P1State) is held for the two rows g ("lo", h = 0)
// and g+8 ("hi", h = 1) of the warp: m, la, lc, ad, lv, ws replicated over the 4 lanes of the quad, and o as
// the f32 accumulator fragment of the cold P·V (channels 8dn + 2t0 + e). Every cross-lane reduction
// below is a max (exact, order-free) or a vote; every sum is a tensor-core chain the spec defines.
#pragma once

#include "common.cuh"
#include "formats.cuh"
#include "merge.cuh"
#include "mma.cuh"

namespace apa {

// eps .. Kf are apa_emu.constants.Pass1Consts, ascending .. direct its Pass1Flags, by the same names.
#define APA_FIELDS_Pass1Args(X)                                                                                \
    X(const uint16_t*, qhat)                                                                                   \
    X(const float*, cq)                                                                                        \
    X(const uint16_t*, khat)                                                                                   \
    X(const uint16_t*, vhat)                                                                                   \
    X(const float*, scales)                                                                                    \
    X(const uint16_t*, nu)    /* [B, Hkv, ntkv, 64] §5.8's ν in slot order (output hot test; else null) */     \
    X(const float*, qstat)    /* [B, Hkv, Rp, 3] (§5.7; read by the budget hot test alone) */                  \
    X(const unsigned int*, kvstat) /* [B, Hkv, KV_STATS] float bits (§5.7; the budget test reads the means) */ \
    X(float*, part)           /* [B, Hkv, Rp, D]; between the launches of the bounded schedule, o (§6.7) */    \
    X(float*, ml)             /* [B, Hkv, Rp, 4] = (m1, l1, ad1, ws1) */                                       \
    X(float*, carry)          /* [B, Hkv, Rp, P1_CARRY]: the rest of the warp state between launches (§6.7) */ \
    X(TileSpan, span)         /* the images' slots and the tiles this launch visits */                         \
    X(uint32_t*, hot)         /* [B, Hkv, nw, W], zeroed by the host */                                        \
    X(uint8_t*, trace_visits) /* VISIT_DTYPE records (trace builds) */                                         \
    X(const int*, visit_base) /* [B, Hkv, nw]: first record index of the warp, -1 = not traced */              \
    X(float, eps)             /* §7.7 */                                                                       \
    X(float, delta)           /* §7.8 */                                                                       \
    X(float, tau)             /* §7.2 */                                                                       \
    X(float, A)               /* §7.4: 8 ⊖ τ */                                                                \
    X(float, L)               /* §7.4: f32(log2 1536) ⊖ τ */                                                   \
    X(float, Kf)              /* §7.10: f32(2^τ ⊘ 1536) */                                                     \
    X(float, rho)             /* §9.8 ρ (the budget test's βr, §7.7) */                                        \
    X(int, ascending)         /* tile order (§6.4): 0 = diagonal, 1 = ascending */                             \
    X(int, pow2)              /* P scale kind (§7.4): 0 = ue4m3, 1 = pow2 */                                   \
    X(int, interleaved)       /* P groups (§7.3) */                                                            \
    X(int, quant_p)           /* §7.5 */                                                                       \
    X(int, output)            /* hot test (§7.7): the output test */                                           \
    X(int, budget)            /* hot test (§7.7): the budget test (neither: the mass test) */                  \
    X(int, fma)               /* the seed's FMA sites (§1.8): §7.4 u₀, §7.5 y, §7.7, §7.8's la and lv */       \
    X(int, pad_vote)          /* padding rows vote (§6.2): prep gave them row R − 1's Q̂ and c_q */            \
    X(int, direct)            /* direct_store (§9.5): a warp with no hot tile exports o ⊗ (vg ⊘ lc) */
struct Pass1Args {
    APA_FIELDS_Pass1Args(APA_MEMBER)
};

// VISIT_DTYPE byte layout (apa_emu/trace.py): b, hk, warp, visit, tile (i4), hot (u1), pad[3],
// then c, m, tl, la, lc, tv, lv, t2, ws as 16 binary32 each.
constexpr int VISIT_BYTES = 24 + 9 * 16 * 4;
constexpr int VISIT_C = 24, VISIT_M = 88, VISIT_TL = 152, VISIT_LA = 216, VISIT_LC = 280, VISIT_TV = 344,
              VISIT_LV = 408, VISIT_T2 = 472, VISIT_WS = 536;

// The running sums of one row besides o (§7): la, lc, ad, the output test's lv and §9.8's cold Σ P̂² ws.
struct P1Sums {
    float la, lc, ad, lv, ws;
};

// The running state of §7 of the lane's rows (h = 0: g, "lo"; h = 1: g + 8, "hi"), the twin of
// apa_emu/pass1.py P1State: frame m and the sums r per row, o as the f32 accumulator fragment of the
// cold P·V (o[dn][2h + e]: channel 8dn + 2t0 + e of row h), and the visit count (§10's record index).
// Taken by reference into inlined functions: it stays in registers.
template <int NDN>
struct P1State {
    float m[2];
    P1Sums r[2];
    float o[NDN][4];
    int visit;
};

template <int NDN>
__device__ __forceinline__ void p1_init(P1State<NDN>& st) {
    st.m[0] = st.m[1] = neg_inf();
    st.r[0] = st.r[1] = P1Sums{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int dn = 0; dn < NDN; ++dn) st.o[dn][0] = st.o[dn][1] = st.o[dn][2] = st.o[dn][3] = 0.0f;
    st.visit = 0;
}

// update(x) of §7.9 for row h: rescale o (this lane's elements of the row), lc, la, ad, lv, and ws by α
// twice (a sum of squares). The spec's ⊕ (+0) on o is the P̂·V̂ MMA that ends every step, cold or not: a
// sum of zero products is +0 there (§3.1), so a −0 that o ⊗ α left in C comes out +0, and every other
// value unchanged.
// alpha: exp2(m ⊖ x) as the caller already has it (read only when x ≠ m).
template <int NDN>
__device__ __forceinline__ void p1_update_by(float x, float alpha, P1State<NDN>& st, int half) {
    float& m = st.m[half];
    P1Sums& r = st.r[half];
    if (x != m) {
#pragma unroll
        for (int dn = 0; dn < NDN; ++dn) {
            st.o[dn][2 * half + 0] = fmul(st.o[dn][2 * half + 0], alpha);
            st.o[dn][2 * half + 1] = fmul(st.o[dn][2 * half + 1], alpha);
        }
        r.lc = fmul(r.lc, alpha);
        r.la = fmul(r.la, alpha);
        r.ad = fmul(r.ad, alpha);
        r.lv = fmul(r.lv, alpha);
        r.ws = fmul(fmul(r.ws, alpha), alpha);
        m = x;
    }
}
template <int NDN>
__device__ __forceinline__ void p1_update(float x, P1State<NDN>& st, int half) {
    if (x != st.m[half]) p1_update_by(x, exp2x<exp2s_nonpos>(fsub(st.m[half], x)), st, half);
}

// What a warp's visits read besides its state and the tile (with P1State, apa_emu/pass1.py's P1Rows and
// P1Out's hot words): fixed for the launch.
struct P1Warp {
    float cq[2];            // §5.3 c_q of the lane's rows
    float lg2_lane;         // LG2[lane] on lanes 0..8 (p1_pscale)
    int lim_w, lo_w;        // the warp's tightest key limits (p1_mask)
    bool inter;             // §7.3 interleaved P groups
    bool nu_lane;           // §7.6: the lane holds odd columns of tv's MMA, the ones that carry ν
    const uint16_t* nu_bh;  // (b, hk)'s ν (§5.8) at the lane's slots; null unless nu_lane
    float beta[2];          // §7.7 βr of the lane's rows (budget test; else unread)
    uint32_t* hot_w;        // the warp's hot-mask words
    uint8_t* trace;         // the warp's visit records (§10); null unless traced
    int b, hk;
};

// One visit's values of the lane's rows besides the state (apa_emu/pass1.py's c, tl2, t2 and amass):
// the candidate frame c and the frame vote moved (§7.2), lane t0's group's a_g (§7.8), the row sums
// tl, tv, t2 (§7.6: on a cold tile, and before the vote under the budget test; +0 on a hot tile, as
// §10 traces it) and a = exp2(m ⊖ c) (§7.7).
struct P1Visit {
    float c[2], mass[2], tl[2], tv[2], t2[2], a[2];
    bool moved;
};

// §7.1's mask: keys outside lo_r .. lim_r -> −inf, only on tiles that reach past a row's limits. The test
// is on the warp's tightest limits, so a uniform branch, not a divergent one (the lanes whose rows a
// tile does not pass keep their scores: the selects leave them).
__device__ __forceinline__ void p1_mask(float (&s)[8][4], const WarpRows& wr, const P1Warp& w, int t) {
    if (t * TILE + TILE - 1 > w.lim_w || t * TILE < w.lo_w) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = t * TILE + slot_key(8 * nt + 2 * wr.t0 + e, w.inter);
                if (key > wr.lim_lo || key < wr.lo_lo) s[nt][e] = neg_inf();
                if (key > wr.lim_hi || key < wr.lo_hi) s[nt][2 + e] = neg_inf();
            }
        }
    }
}

// §7.2 group maxima gm[h] (slots 16g..16g+15 = n-tiles 2g, 2g+1), row maxima and the lazy frame vote:
// the candidate frame c of the lane's two rows, and the vote (false: c = m in every row of the warp).
// Padding rows do not vote (§6.2).
__device__ __forceinline__ bool p1_frame(const float (&s)[8][4], const WarpRows& wr, const float (&cq)[2],
                                         const float (&m)[2], float tau, float (&gm)[2][4], float (&c)[2]) {
#pragma unroll
    for (int gi = 0; gi < 4; ++gi) {
        float x = fmaxf(fmaxf(s[2 * gi][0], s[2 * gi][1]), fmaxf(s[2 * gi + 1][0], s[2 * gi + 1][1]));
        float y = fmaxf(fmaxf(s[2 * gi][2], s[2 * gi][3]), fmaxf(s[2 * gi + 1][2], s[2 * gi + 1][3]));
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 1));
        x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 2));
        y = fmaxf(y, __shfl_xor_sync(0xFFFFFFFFu, y, 1));
        y = fmaxf(y, __shfl_xor_sync(0xFFFFFFFFu, y, 2));
        gm[0][gi] = x;
        gm[1][gi] = y;
    }
    const float mx_lo = fmul(fmaxf(fmaxf(gm[0][0], gm[0][1]), fmaxf(gm[0][2], gm[0][3])), cq[0]);
    const float mx_hi = fmul(fmaxf(fmaxf(gm[1][0], gm[1][1]), fmaxf(gm[1][2], gm[1][3])), cq[1]);
    // & and |, not && and ||: a short circuit on the lane's rows is a divergent branch, with its
    // convergence barrier, on every step.
    const bool trig = __any_sync(0xFFFFFFFFu, (wr.run_lo & (mx_lo > fadd(m[0], tau))) |
                                                  (wr.run_hi & (mx_hi > fadd(m[1], tau))));
    c[0] = trig ? fmaxf(m[0], mx_lo) : m[0];
    c[1] = trig ? fmaxf(m[1], mx_hi) : m[1];
    return trig;
}

// §7.7's vote over the voting rows of x > ε ⊗ ((run ⊗ a) ⊕ x), a = exp2(m ⊖ c), with (x, run) = (tl,
// la) for the mass test and (tv, lv) for the output test. Sets a of the rows: a cold tile's update(c)
// rescales by the same value. moved: p1_frame's vote; without it c = m and a = 1 in every row, and
// the warp skips the two exp2s (in the exact build ~40 instructions, on most steps). p1_vote_a: that a,
// which the budget test's vote (p1_budget_vote) takes too.
__device__ __forceinline__ void p1_vote_a(bool moved, float c_lo, float c_hi, float m_lo, float m_hi, float& a_lo,
                                          float& a_hi) {
    a_lo = a_hi = 1.0f;
    if (moved) {
        a_lo = (c_lo == m_lo) ? 1.0f : exp2x<exp2s_nonpos>(fsub(m_lo, c_lo));
        a_hi = (c_hi == m_hi) ? 1.0f : exp2x<exp2s_nonpos>(fsub(m_hi, c_hi));
    }
}
__device__ __forceinline__ bool p1_hot_vote(const WarpRows& wr, float x_lo, float x_hi, float c_lo, float c_hi,
                                            float m_lo, float m_hi, float run_lo, float run_hi, float eps, bool fused,
                                            bool moved, float& a_lo, float& a_hi) {
    p1_vote_a(moved, c_lo, c_hi, m_lo, m_hi, a_lo, a_hi);
    const bool hp_lo = wr.run_lo & (x_lo > fmul(eps, madd(run_lo, a_lo, x_lo, fused)));  // as in p1_frame
    const bool hp_hi = wr.run_hi & (x_hi > fmul(eps, madd(run_hi, a_hi, x_hi, fused)));
    return __any_sync(0xFFFFFFFFu, hp_lo | hp_hi);
}

// §7.7 budget test's vote over the voting rows of ((ws ⊗ a) ⊗ a) ⊕ t2 > βr ⊗ (L ⊗ L), L = (la ⊗ a) ⊕ tl:
// the tile's Σ P̂² added to the cold keys' would exceed the row's budget. Sets a as p1_hot_vote does.
template <int NDN>
__device__ __forceinline__ bool p1_budget_vote(const WarpRows& wr, const P1Warp& w, const P1State<NDN>& st,
                                               P1Visit& v) {
    p1_vote_a(v.moved, v.c[0], v.c[1], st.m[0], st.m[1], v.a[0], v.a[1]);
    bool over[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float L = fadd(fmul(st.r[h].la, v.a[h]), v.tl[h]);
        over[h] = fadd(fmul(fmul(st.r[h].ws, v.a[h]), v.a[h]), v.t2[h]) > fmul(w.beta[h], fmul(L, L));
    }
    return __any_sync(0xFFFFFFFFu, (wr.run_lo & over[0]) | (wr.run_hi & over[1]));  // as in p1_frame
}

// §7.7 hot test, the mass or the output test (p1_hot_vote; the budget test is p1_budget_vote); sets v.a.
template <int NDN>
__device__ __forceinline__ bool p1_hot_test(const Pass1Args& a, const WarpRows& wr, const P1State<NDN>& st,
                                            P1Visit& v) {
    return a.output ? p1_hot_vote(wr, v.tv[0], v.tv[1], v.c[0], v.c[1], st.m[0], st.m[1], st.r[0].lv, st.r[1].lv,
                                  a.eps, a.fma, v.moved, v.a[0], v.a[1])
                    : p1_hot_vote(wr, v.tl[0], v.tl[1], v.c[0], v.c[1], st.m[0], st.m[1], st.r[0].la, st.r[1].la,
                                  a.eps, a.fma, v.moved, v.a[0], v.a[1]);
}

// §7.8 hot branch for row h: frame f = max(m, c ⊖ δ), la ⊕= tl ⊗ exp2(c ⊖ f), lv ⊕= tv ⊗ the same.
// (p1_branch sets the hot bit and zeroes P̂, so the tile adds nothing to o.) moved: as in
// p1_hot_vote; without it c = m, so f = m (δ ≥ 0, which the config requires) and b = 1.
template <int NDN>
__device__ __forceinline__ void p1_hot_branch(float c, float tl, float tv, float delta, bool moved, P1State<NDN>& st,
                                              int half, bool fused) {
    P1Sums& r = st.r[half];
    float b = 1.0f;
    if (moved) {
        const float f = fmaxf(st.m[half], fsub(c, delta));
        b = (f == c) ? 1.0f : exp2x<exp2s_nonpos>(fsub(c, f));
        p1_update(f, st, half);
    }
    r.la = madd(tl, b, r.la, fused);
    r.lv = madd(tv, b, r.lv, fused);
}

// §7.8 cold branch for row h: frame c (a = exp2(m ⊖ c) from the hot test), la ⊕= tl, lv ⊕= tv,
// lc ⊕= tl, ad ⊕= the groups' a_g summed in order (mass), ws ⊕= t2; the caller's P̂·V̂ adds to o. moved:
// as in p1_hot_vote (without it c = m: no update, and no divergent branch to find that out).
template <int NDN>
__device__ __forceinline__ void p1_cold_branch(float c, float a, float tl, float tv, float mass, float t2, bool moved,
                                               P1State<NDN>& st, int half) {
    P1Sums& r = st.r[half];
    if (moved) p1_update_by(c, a, st, half);
    r.la = fadd(r.la, tl);
    r.lv = fadd(r.lv, tv);
    r.lc = fadd(r.lc, tl);
    r.ad = fadd(r.ad, mass);
    r.ws = fadd(r.ws, t2);
}

// §7.6 t2 (apa_emu/pass1.py p1_self_sums) of the lane's rows g and g + 8: the chain of each row's P̂
// against itself over the 4 groups in slot order from C = +0. An m16n8k16 A fragment's registers a0,
// a2 (row g, k = 2t0, 2t0 + 1 and + 8) are the B fragment registers b0, b1 of column n = g, so with
// B = (a0, a2) column g of C is row g's P̂ and C[r][g] = P̂ᵣ·P̂_g, and with B = (a1, a3) C[r][g] =
// P̂ᵣ·P̂_{g+8}: the diagonals C[g][g] and C[g + 8][g] are the rows' chains (an MMA's elements are
// independent dot products). Lane (g, t0 = g >> 1) holds them as c[g & 1] and c[2 + (g & 1)]; the quad
// takes them from there. Every lane of the warp calls it (a cold tile is warp-uniform: p1_hot_test's vote).
__device__ __forceinline__ void p1_self_sums(const uint32_t (&pa)[4][4], float (&t2)[2]) {
    float lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int gi = 0; gi < 4; ++gi) {
        mma_f32_acc(lo, pa[gi], pa[gi][0], pa[gi][2]);
        mma_f32_acc(hi, pa[gi], pa[gi][1], pa[gi][3]);
    }
    const int g = (threadIdx.x & 31) >> 2, src = 4 * g + (g >> 1);
    t2[0] = __shfl_sync(0xFFFFFFFFu, (g & 1) ? lo[1] : lo[0], src);
    t2[1] = __shfl_sync(0xFFFFFFFFu, (g & 1) ? hi[3] : hi[2], src);
}

// §7.8 ((a₀ ⊕ a₁) ⊕ a₂) ⊕ a₃ of a row from the quad lanes t0 = g that hold each group's a_g.
__device__ __forceinline__ float p1_group_mass(float my_mass) {
    const int base = (threadIdx.x & 31) & ~3;
    float sum = 0.0f;  // +0 ⊕ a₀ = a₀
#pragma unroll
    for (int gi = 0; gi < 4; ++gi) sum = fadd(sum, __shfl_sync(0xFFFFFFFFu, my_mass, base | gi));
    return sum;
}

// §7.4's two exp2s of a group for the lane's two rows (h = 0 lo, 1 hi), e = exp2(u ⊖ fl) and
// mass_cap = 24 ⊗ exp2(u₀) (u₀ ≤ 8; −inf, a masked group, gives 0), from one software exp2 where they
// share it. With f₀ = floor(u₀) and x₀ = u₀ ⊖ f₀ (exact), exp2s(u₀) reduces u₀ to the same
// f = x₀ ⊖ round(x₀) as exp2s(x₀) does, so exp2s(u₀) = exp2s(x₀) ⊗ 2^f₀ bit for bit (an exact
// power-of-two scaling of a normal number), except when x₀ = 0.5 and f₀ is odd (round(u₀) is then
// f₀ + 1 and round(x₀) is 0) or u₀ lies outside [−125, 127) (NaN, ±inf, the subnormal and infinite
// ends): those lanes evaluate exp2s(u₀), after both rows' common part, so that the two rows' chains
// interleave. And e is exp2s(x₀) when u₀ is not clamped (u = u₀), else exp2s(+0) = 1. Saves a
// software exp2 (about 25 instructions) per row and group on every step. The hardware exp2 of the
// fast mode has no such identity: it evaluates both.
__device__ __forceinline__ void p1_pscale_exp2(const float (&u0)[2], const float (&u)[2], const float (&fl)[2],
                                               float (&e)[2], float (&mass_cap)[2]) {
#if APA_EXP2_FAST
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        e[h] = exp2_hw(fsub(u[h], fl[h]));
        mass_cap[h] = fmul(24.0f, exp2_hw(u0[h]));
    }
#else
    float p[2];
    bool shared[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float f0 = floorf(u0[h]);
        const float x0 = fsub(u0[h], f0);
        const float e0 = exp2s_core(x0);  // x₀ in [0, 1) when u₀ is finite; unused otherwise
        e[h] = u[h] == u0[h] ? e0 : 1.0f;
        shared[h] = u0[h] >= -125.0f && u0[h] < 127.0f && !(x0 == 0.5f && ((int)f0 & 1));
        p[h] = fmul(e0, f32_from_bits((uint32_t)((int)f0 + 127) << 23));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
        if (!shared[h]) p[h] = exp2s(u0[h]);  // a branch, not a select: the lanes that need it are few
#pragma unroll
    for (int h = 0; h < 2; ++h) mass_cap[h] = fmul(24.0f, p[h]);
#endif
}

// P scale of one group (§7.4) for the lane's two rows (h = 0 lo, 1 hi), side by side: each row's
// chain is long and serial, and two interleaved chains wait half as long. Sets bias, dec(kb) and
// §7.8's a_g = min(dec(kb), 24 ⊗ exp2(u₀)). lg2_lane: LG2[lane] on lanes 0..8 (a shuffle, not a
// switch: lanes differ in mi, and a divergent jump table serializes them).
__device__ __forceinline__ void p1_pscale(const float (&gm)[2], const float (&cq)[2], const float (&c)[2],
                                          const Pass1Args& a, float lg2_lane, float (&bias)[2], float (&scale)[2],
                                          float (&mass)[2]) {
    float u0[2], u[2], fl[2], Lc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        u0[h] = madd(gm[h], cq[h], fsub(a.A, c[h]), a.fma);
        u[h] = fminf(fmaxf(u0[h], -6.0f), 8.0f);
        fl[h] = floorf(u[h]);
        Lc[h] = fsub(a.L, c[h]);
    }
    if (a.pow2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float mass_cap = fmul(24.0f, exp2x(u0[h]));  // u₀ ≤ 8; −inf (masked group) gives 0
            const float cu = ceilf(u[h]);
            scale[h] = f32_from_bits((uint32_t)((int)cu + 127) << 23);  // dec(8 (cu + 7)) = 2^cu
            mass[h] = c[h] == neg_inf() ? 0.0f : fminf(scale[h], mass_cap);
            bias[h] = c[h] == neg_inf() ? neg_inf() : fsub(Lc[h], cu);
        }
        return;
    }
    float e[2], mass_cap[2];
    p1_pscale_exp2(u0, u, fl, e, mass_cap);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int mi = (int)ceilf(fmul(8.0f, fsub(e[h], 1.0f)));
#if APA_EXP2_FAST
        mi = min(max(mi, 0), 8);  // the hardware exp2 of u - fl in [0, 1) may leave [1, 2]
#endif
        // dec(kb), kb = 8 (fl + 7) + mi in 8..120: a normal code, 2^fl (1 + mi/8), whose bits are the
        // exponent's plus mi << 20 (mi = 8 carries into the exponent, as into kb's).
        scale[h] = f32_from_bits(((uint32_t)((int)fl[h] + 127) << 23) + ((uint32_t)mi << 20));
        mass[h] = fminf(scale[h], mass_cap[h]);
        bias[h] = fsub(Lc[h], fadd(fl[h], __shfl_sync(0xFFFFFFFFu, lg2_lane, mi)));
        // A row none of whose keys is visible yet (c = -inf, only with a window): P̂ = 0 and a_g = 0
        // (§7.4). Selected after the shuffle, which every lane must reach.
        if (c[h] == neg_inf()) mass[h] = 0.0f, bias[h] = neg_inf();
    }
}

// §7.5 P' of the tile, folded into FP16 A fragments (k-step kk = group kk): lane t0 of each quad
// holds the scale and bias of group t0 (p1_pscale) and the quad exchanges them. QUANT (§7.5 on):
// e2m1(exp2s(y)) by thresholds, so no per-element exp2 at all; in the fast mode, the hardware exp2
// in binary16 pairs instead. §7.6 tile row sums tl4: the chain over the 4 groups in slot order from
// C = +0 against ones (tl in every column), each step issued as soon as its group is done, so that the
// tensor core's latency hides behind the next group's P'.
template <bool QUANT, bool FUSED>
__device__ __forceinline__ void p1_pfrags(const float (&s)[8][4], float cq_lo, float cq_hi, float my_bias_lo,
                                          float my_bias_hi, float my_sc_lo, float my_sc_hi,
                                          uint32_t (&pa)[4][4], float (&tl4)[4]) {
    tl4[0] = tl4[1] = tl4[2] = tl4[3] = 0.0f;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int gi = 0; gi < 4; ++gi) {
        const int src = (lane & ~3) | gi;
        const float sc_lo = __shfl_sync(0xFFFFFFFFu, my_sc_lo, src);
        const float sc_hi = __shfl_sync(0xFFFFFFFFu, my_sc_hi, src);
        const float bias_lo = __shfl_sync(0xFFFFFFFFu, my_bias_lo, src);
        const float bias_hi = __shfl_sync(0xFFFFFFFFu, my_bias_hi, src);
        if constexpr (QUANT && APA_EXP2_FAST) {  // §7.5 fast: y by one FMA, binary16 pairs
            const uint32_t sc2_lo = f16x2(sc_lo, sc_lo), sc2_hi = f16x2(sc_hi, sc_hi);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const float (&sj)[4] = s[2 * gi + j];
                pa[gi][2 * j] = e2m1_exp2_fast_x2(__fmaf_rn(sj[0], cq_lo, bias_lo), __fmaf_rn(sj[1], cq_lo, bias_lo),
                                                  sc2_lo);
                pa[gi][2 * j + 1] = e2m1_exp2_fast_x2(__fmaf_rn(sj[2], cq_hi, bias_hi),
                                                      __fmaf_rn(sj[3], cq_hi, bias_hi), sc2_hi);
            }
        } else {
            float ph[2][4];  // [n-tile 2gi + j][lo e0, lo e1, hi e0, hi e1]
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bool hi = e >= 2;
                    const float y = madd(s[2 * gi + j][e], hi ? cq_hi : cq_lo, hi ? bias_hi : bias_lo, FUSED);
                    ph[j][e] = QUANT ? e2m1_exp2s_scaled(y, hi ? sc_hi : sc_lo) : fmul(exp2x(y), hi ? sc_hi : sc_lo);
                }
            }
            pa[gi][0] = f16x2(ph[0][0], ph[0][1]);
            pa[gi][1] = f16x2(ph[0][2], ph[0][3]);
            pa[gi][2] = f16x2(ph[1][0], ph[1][1]);
            pa[gi][3] = f16x2(ph[1][2], ph[1][3]);
        }
        mma_f32_acc(tl4, pa[gi], ONES_H2, ONES_H2);
    }
}

// §7.4–7.5 (apa_emu/pass1.py p1_phat): the P scales, then P̂ as the FP16 A fragments pa, with §7.6's tl
// (p1_pfrags) and lane t0's a_g. The 4 lanes of a quad share rows g and g+8, so lane t0 computes the
// scales of group t0 for both rows (the same values, a quarter of the work).
__device__ __forceinline__ void p1_phat(const Pass1Args& a, const WarpRows& wr, const P1Warp& w, const float (&s)[8][4],
                                        const float (&gm)[2][4], P1Visit& v, uint32_t (&pa)[4][4]) {
    const float gsel[2] = {
        wr.t0 == 0 ? gm[0][0] : wr.t0 == 1 ? gm[0][1] : wr.t0 == 2 ? gm[0][2] : gm[0][3],
        wr.t0 == 0 ? gm[1][0] : wr.t0 == 1 ? gm[1][1] : wr.t0 == 2 ? gm[1][2] : gm[1][3]};
    float bias[2], sc[2];
    p1_pscale(gsel, {w.cq[0], w.cq[1]}, {v.c[0], v.c[1]}, a, w.lg2_lane, bias, sc, v.mass);
    float tl4[4];
    // The element loop compiled per (quantized P', fused y): a run-time select there costs ~5 %.
#define APA_PFRAGS(QUANT, FUSED) p1_pfrags<QUANT, FUSED>(s, w.cq[0], w.cq[1], bias[0], bias[1], sc[0], sc[1], pa, tl4)
    if (a.quant_p)
        a.fma ? APA_PFRAGS(true, true) : APA_PFRAGS(true, false);
    else
        a.fma ? APA_PFRAGS(false, true) : APA_PFRAGS(false, false);
#undef APA_PFRAGS
    v.tl[0] = tl4[0], v.tl[1] = tl4[2];
}

// §7.6 row sums (apa_emu/pass1.py p1_row_sums): tl came with P̂ (p1_pfrags); this is tv. Without the
// output test lv runs beside la on tl and nothing reads it. With it, tv is the same chain against ν in
// the odd columns (k = slots 16 gi + 2 t0 + {0, 1} and + 8): an MMA's columns are independent dot
// products, so a second chain gives the bits ν beside the ones in one MMA gave, and the mass test
// issues neither it nor ν's loads and their addresses (~15 a step).
__device__ __forceinline__ void p1_row_sums(const Pass1Args& a, const P1Warp& w, const uint32_t (&pa)[4][4], int t,
                                            P1Visit& v) {
    v.tv[0] = v.tl[0], v.tv[1] = v.tl[1];
    if (a.output) {
        const bool nu_lane = w.nu_lane;
        uint32_t bw[4][2];
#pragma unroll
        for (int gi = 0; gi < 4; ++gi) bw[gi][0] = bw[gi][1] = ONES_H2;  // the even columns: unread
        if (nu_lane) {
            const uint16_t* nu_t = w.nu_bh + a.span.slot(t) * TILE;
#pragma unroll
            for (int gi = 0; gi < 4; ++gi) {
                bw[gi][0] = *reinterpret_cast<const uint32_t*>(nu_t + 16 * gi);
                bw[gi][1] = *reinterpret_cast<const uint32_t*>(nu_t + 16 * gi + 8);
            }
        }
        float tv4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int gi = 0; gi < 4; ++gi) mma_f32_acc(tv4, pa[gi], bw[gi][0], bw[gi][1]);
        v.tv[0] = tv4[1], v.tv[1] = tv4[3];
    }
}

template <typename T, int N>
__device__ __forceinline__ void p1_zero(T (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = T(0);
}

// §7.8 (apa_emu/pass1.py p1_branch): a hot tile sets its bit in the warp's mask and zeroes P̂, so the
// caller's P̂·V̂ adds nothing to o; a cold tile keeps P̂. v.t2 leaves as the tile's Σ P̂² on a cold tile
// (BUDGET: the budget test formed it before its vote), +0 on a hot one (§10's trace; outside trace
// builds nothing reads it there).
template <bool BUDGET, int NDN>
__device__ __forceinline__ void p1_branch(const Pass1Args& a, const WarpRows& wr, const P1Warp& w, bool hot, int t,
                                          P1Visit& v, P1State<NDN>& st, uint32_t (&pa)[4][4]) {
    if (hot) {
        v.t2[0] = v.t2[1] = 0.0f;
        p1_hot_branch(v.c[0], v.tl[0], v.tv[0], a.delta, v.moved, st, 0, a.fma);
        p1_hot_branch(v.c[1], v.tl[1], v.tv[1], a.delta, v.moved, st, 1, a.fma);
        if (wr.lane == 0) atomicOr(w.hot_w + (t >> 5), 1u << (t & 31));
        p1_zero(pa);
    } else {
        const float mass_lo = p1_group_mass(v.mass[0]), mass_hi = p1_group_mass(v.mass[1]);
        if constexpr (!BUDGET) p1_self_sums(pa, v.t2);
        p1_cold_branch(v.c[0], v.a[0], v.tl[0], v.tv[0], mass_lo, v.t2[0], v.moved, st, 0);
        p1_cold_branch(v.c[1], v.a[1], v.tl[1], v.tv[1], mass_hi, v.t2[1], v.moved, st, 1);
    }
}

// One per-row field of a visit record (§10): rows g and g + 8, padding rows +0.
__device__ __forceinline__ void p1_trace_rows(uint8_t* rec, int field, int g, float lo, float hi, bool vlo, bool vhi) {
    float* f = reinterpret_cast<float*>(rec + field);
    f[g] = vlo ? lo : 0.0f;
    f[g + 8] = vhi ? hi : 0.0f;
}

// §10 (apa_emu/pass1.py p1_record): the visit's record, if the warp is traced; nothing outside trace builds.
template <int NDN>
__device__ __forceinline__ void p1_record(const Pass1Args& a, const WarpRows& wr, const P1Warp& w, bool hot, int t,
                                          const P1Visit& v, const P1State<NDN>& st) {
#if APA_TRACE
    if (w.trace == nullptr) return;
    uint8_t* rec = w.trace + (size_t)st.visit * VISIT_BYTES;
    if (wr.lane == 0) {
        int* hdr = reinterpret_cast<int*>(rec);
        hdr[0] = w.b; hdr[1] = w.hk; hdr[2] = wr.w; hdr[3] = st.visit; hdr[4] = t;
        hdr[5] = hot ? 1 : 0;  // hot (u1) and the 3 padding bytes
    }
    if (wr.t0 == 0) {
        p1_trace_rows(rec, VISIT_C, wr.g, v.c[0], v.c[1], wr.v_lo, wr.v_hi);
        p1_trace_rows(rec, VISIT_M, wr.g, st.m[0], st.m[1], wr.v_lo, wr.v_hi);
        p1_trace_rows(rec, VISIT_TL, wr.g, v.tl[0], v.tl[1], wr.v_lo, wr.v_hi);
        p1_trace_rows(rec, VISIT_LA, wr.g, st.r[0].la, st.r[1].la, wr.v_lo, wr.v_hi);
        p1_trace_rows(rec, VISIT_LC, wr.g, st.r[0].lc, st.r[1].lc, wr.v_lo, wr.v_hi);
        const bool out = a.output != 0;  // the mass and budget tests trace tv and lv as +0 (§10)
        p1_trace_rows(rec, VISIT_TV, wr.g, v.tv[0], v.tv[1], wr.v_lo && out, wr.v_hi && out);
        p1_trace_rows(rec, VISIT_LV, wr.g, st.r[0].lv, st.r[1].lv, wr.v_lo && out, wr.v_hi && out);
        p1_trace_rows(rec, VISIT_T2, wr.g, v.t2[0], v.t2[1], wr.v_lo, wr.v_hi);
        p1_trace_rows(rec, VISIT_WS, wr.g, st.r[0].ws, st.r[1].ws, wr.v_lo, wr.v_hi);
    }
#endif
}

// One visit of tile t by a warp that has it (§7.1's mask to §7.8, §10): the loop body of
// apa_emu/pass1.py pass1_warp past p1_scores, s holding the scores. pa leaves as P̂ of a cold tile,
// zero for a hot one: the caller's P̂·V̂ adds it to o. BUDGET: the budget hot test (§7.7).
template <bool BUDGET, int NDN>
__device__ __forceinline__ void p1_visit(const Pass1Args& a, const WarpRows& wr, const P1Warp& w, int t,
                                         float (&s)[8][4], P1State<NDN>& st, uint32_t (&pa)[4][4]) {
    P1Visit v;
    float gm[2][4];
    p1_mask(s, wr, w, t);
    v.moved = p1_frame(s, wr, w.cq, st.m, a.tau, gm, v.c);
    p1_phat(a, wr, w, s, gm, v, pa);
    p1_row_sums(a, w, pa, t, v);
    bool hot;
    if constexpr (BUDGET) {
        p1_self_sums(pa, v.t2);  // §7.6: the budget test reads t2 on every tile
        hot = p1_budget_vote(wr, w, st, v);
    } else {
        hot = p1_hot_test(a, wr, st, v);
    }
    p1_branch<BUDGET>(a, wr, w, hot, t, v, st, pa);
    p1_record(a, wr, w, hot, t, v, st);
    ++st.visit;
}

// §7.10 export of the warp's valid rows: part = o ⊗ vk with vk = vg ⊗ Kf, m1 = m, l1 = lc ⊗ Kf,
// ad1 = ad ⊗ Kf, ws1 = (ws ⊗ Kf) ⊗ Kf; under direct_store, a warp none of whose tiles was hot (its mask
// words, set by lane 0's atomics in this launch or an earlier segment's, read past L1) exports
// part = o ⊗ (vg ⊘ lc) (§9.5).
template <int NDN>
__device__ __forceinline__ void p1_export(const Pass1Args& a, const Geom& geo, const WarpRows& wr, size_t bh,
                                          const P1State<NDN>& st) {
    const float kf = a.Kf;
    const float vg = a.scales[bh * 2 + 1];
    const float vk = fmul(vg, kf);
    bool direct = false;
    if (a.direct) {
        __syncwarp();
        const uint32_t* hot_w = a.hot + (bh * geo.nw_buf + wr.w) * geo.W_buf;
        uint32_t any = 0;
        for (int j = 0; j < geo.W_buf; ++j) any |= __ldcg(hot_w + j);
        direct = any == 0;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? wr.r_hi : wr.r_lo;
        if (!(half ? wr.v_hi : wr.v_lo)) continue;
        float* prow = a.part + (bh * geo.Rp_buf + r) * D;
        const float f = direct ? fdiv(vg, st.r[half].lc) : vk;
#pragma unroll
        for (int dn = 0; dn < NDN; ++dn) {
            float2 val = make_float2(fmul(st.o[dn][2 * half], f), fmul(st.o[dn][2 * half + 1], f));
            *reinterpret_cast<float2*>(prow + 8 * dn + 2 * wr.t0) = val;
        }
        if (wr.t0 == 0) {
            float* ml = a.ml + (bh * geo.Rp_buf + r) * P1_ML;
            ml[0] = st.m[half];
            ml[1] = fmul(st.r[half].lc, kf);
            ml[2] = fmul(st.r[half].ad, kf);
            ml[3] = fmul(fmul(st.r[half].ws, kf), kf);
        }
    }
}

// §7.7 βr = (ε ⊗ ε) ⊗ (X ⊘ κ) of the lane's rows (apa_emu/merge.py budget_beta), +inf where κ = +0: §9.8
// steps 1–2 from the row's qstat (+0 in a padding row) and c_q as pass 1 reads them, and the head's means
// (prep_means ran before pass 1 under this test, apa_gpu/plan.py).
__device__ __forceinline__ void p1_budget_beta(const Pass1Args& a, const Geom& geo, const WarpRows& wr, size_t bh,
                                               const float (&cq)[2], float (&beta)[2]) {
    const unsigned int* kv = a.kvstat + bh * KV_STATS;
    const float ee = fmul(a.eps, a.eps);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float* qs = a.qstat + (bh * geo.Rp_buf + (h ? wr.r_hi : wr.r_lo)) * 3;
        float x;
        const float kappa = est_cold_kappa<D>(cq[h], qs[0], qs[1], __uint_as_float(kv[5]), __uint_as_float(kv[6]),
                                              __uint_as_float(kv[7]), __uint_as_float(kv[8]), a.rho, x);
        beta[h] = kappa > 0.0f ? fmul(ee, fdiv(x, kappa)) : pos_inf();
    }
}

// §7.1 scores of one tile (apa_emu/pass1.py p1_scores), per n-tile a chain over channel k-steps
// ascending from C = s (+0), issued by the whole warpgroup (wgmma is collective) between the caller's
// wg_fence and wg_commit; warps without the tile discard it.
__device__ __forceinline__ void p1_scores(float (&s)[8][4], const WgOperand& Qop, const WgOperand& Kop) {
    constexpr int NKS = D / 16;  // channel k-steps
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks)
        wgmma_ss_n64(s, Qop.plus((ks >> 2) * 64 * 64 + (ks & 3) * 16), Kop.plus((ks >> 2) * TILE * 64 + (ks & 3) * 16));
}

// §7.8 cold branch, o = chain of P̂·V̂ over the 4 groups in slot order with C = o, issued by the whole
// warpgroup: the zero P̂ of a hot or skipped tile adds zero products to C, the largest term, which
// leaves o as it is bit for bit (mma_models.md §3).
template <int NDN>
__device__ __forceinline__ void p1_pv(P1State<NDN>& st, const uint32_t (&pa)[4][4], const WgOperand& Vop) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs(st.o, pa[kk], Vop.plus(16 * kk));
}

}  // namespace apa
