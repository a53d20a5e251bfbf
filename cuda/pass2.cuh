// pass2.cuh: pass 2 per warp over its hot tiles in ascending order (docs/numerics.md §8).
//
// Per lane (g = lane>>2, t0 = lane&3), rows g ("lo") and g+8 ("hi"): m replicated over the quad,
// l4 = the lane's own per-t0 partial sum (§8.4: the m16n8k16 accumulator layout gives lane t0
// exactly keys 8nt + 2t0 + e), O = the output accumulator fragment (f16x2 pairs or f32).
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace apa {

struct Pass2State {
#if APA_P2_F32
    float O[D / 8][4];
#else
    uint32_t O[D / 8][2];
#endif
    float m_lo, m_hi, l4_lo, l4_hi;
};

__device__ __forceinline__ void p2_init(Pass2State& st) {
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
#if APA_P2_F32
        st.O[dn][0] = st.O[dn][1] = st.O[dn][2] = st.O[dn][3] = 0.0f;
#else
        st.O[dn][0] = st.O[dn][1] = 0u;
#endif
    }
    st.m_lo = st.m_hi = neg_inf();
    st.l4_lo = st.l4_hi = 0.0f;
}

// One hot tile of one warp (§8.1-8.5).
__device__ __forceinline__ void p2_tile(Pass2State& st, const uint32_t (&qa)[D / 16][4], const uint16_t* Ks,
                                        const uint16_t* Vs, int t, int lim_lo, int lim_hi, float sh_lo, float sh_hi,
                                        float qmul) {
    constexpr int NKS = D / 16, NDN = D / 8;
    const int lane = threadIdx.x & 31, t0 = lane & 3;
    // ldmatrix row addresses in the tile images: sw128_half(r, c, TILE) with the lane's r and c
    // split into the lane's part and the k-step's; r mod 8 = lane mod 8 in every matrix, so the
    // swizzle is an XOR of the k-step's chunk bits with one per-lane constant.
    const int l7 = lane & 7;
    const uint16_t* k_rows = Ks + 64 * (8 * (lane >> 4) + l7);          // r = 16 np + 8 (lane >> 4) + l7
    const int k_chunk = ((lane >> 3) & 1) ^ l7;                          // c = 16 ks + 8 ((lane >> 3) & 1)
    const uint16_t* v_rows = Vs + 64 * (8 * ((lane >> 3) & 1) + l7);    // r = 16 kk + 8 ((lane >> 3) & 1) + l7
    const int v_chunk = (lane >> 4) ^ l7;                                // c = 16 dp + 8 (lane >> 4)
    // §8.1 S = chain over channels from C = +0, FP16 accumulation.
    uint32_t s16[8][2];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s16[nt][0] = s16[nt][1] = 0u;
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t kb[4];
            ldsm_x4(kb, k_rows + 1024 * np + 4096 * (ks >> 2) + ((((ks & 3) << 1) ^ k_chunk) << 3));
            mma_f16_acc(s16[2 * np], qa[ks], kb[0], kb[1]);
            mma_f16_acc(s16[2 * np + 1], qa[ks], kb[2], kb[3]);
        }
    }
    // x = (float(S) ⊗ qmul) ⊖ sh, -inf where key > lim.
    float x[8][4];  // [nt][lo e0, lo e1, hi e0, hi e1]
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int key = t * TILE + 8 * nt + 2 * t0 + e;
            const float slo = f32h(e ? h2_hi(s16[nt][0]) : h2_lo(s16[nt][0]));
            const float shi = f32h(e ? h2_hi(s16[nt][1]) : h2_lo(s16[nt][1]));
            x[nt][e] = key > lim_lo ? neg_inf() : fsub(fmul(slo, qmul), sh_lo);
            x[nt][2 + e] = key > lim_hi ? neg_inf() : fsub(fmul(shi, qmul), sh_hi);
        }
    }
    // §8.2 frame.
    float mx_lo = st.m_lo, mx_hi = st.m_hi;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        mx_lo = fmaxf(mx_lo, fmaxf(x[nt][0], x[nt][1]));
        mx_hi = fmaxf(mx_hi, fmaxf(x[nt][2], x[nt][3]));
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xFFFFFFFFu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xFFFFFFFFu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xFFFFFFFFu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xFFFFFFFFu, mx_hi, 2));
    const float a_lo = (mx_lo == st.m_lo) ? 1.0f : exp2x<exp2s_nonpos>(fsub(st.m_lo, mx_lo));
    const float a_hi = (mx_hi == st.m_hi) ? 1.0f : exp2x<exp2s_nonpos>(fsub(st.m_hi, mx_hi));
    st.m_lo = mx_lo;
    st.m_hi = mx_hi;
    const float ms_lo = (st.m_lo == neg_inf()) ? 0.0f : st.m_lo;
    const float ms_hi = (st.m_hi == neg_inf()) ? 0.0f : st.m_hi;
    st.l4_lo = fmul(st.l4_lo, a_lo);
    st.l4_hi = fmul(st.l4_hi, a_hi);
#if APA_P2_F32
#pragma unroll
    for (int dn = 0; dn < NDN; ++dn) {
        st.O[dn][0] = fmul(st.O[dn][0], a_lo);
        st.O[dn][1] = fmul(st.O[dn][1], a_lo);
        st.O[dn][2] = fmul(st.O[dn][2], a_hi);
        st.O[dn][3] = fmul(st.O[dn][3], a_hi);
    }
#else
    {
        const __half ah_lo = f16(a_lo), ah_hi = f16(a_hi);
        const uint32_t m2_lo = pack_h2(ah_lo, ah_lo), m2_hi = pack_h2(ah_hi, ah_hi);
#pragma unroll
        for (int dn = 0; dn < NDN; ++dn) {
            st.O[dn][0] = hmul2(st.O[dn][0], m2_lo);
            st.O[dn][1] = hmul2(st.O[dn][1], m2_hi);
        }
    }
#endif
    // §8.3 probabilities, §8.4 row sum (per t0, n-tiles in order), §8.5 P16 A fragments.
    uint32_t pa[4][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float p0 = exp2x<exp2s_nonpos>(fsub(x[nt][0], ms_lo));
        const float p1 = exp2x<exp2s_nonpos>(fsub(x[nt][1], ms_lo));
        const float p2 = exp2x<exp2s_nonpos>(fsub(x[nt][2], ms_hi));
        const float p3 = exp2x<exp2s_nonpos>(fsub(x[nt][3], ms_hi));
        st.l4_lo = fadd(st.l4_lo, fadd(p0, p1));
        st.l4_hi = fadd(st.l4_hi, fadd(p2, p3));
        pa[nt >> 1][(nt & 1) * 2 + 0] = f16x2(p0, p1);
        pa[nt >> 1][(nt & 1) * 2 + 1] = f16x2(p2, p3);
    }
    // §8.5 O = chain of P16·V over the 4 16-key k-steps with C = O.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int dp = 0; dp < NDN / 2; ++dp) {
            uint32_t vb[4];
            ldsm_x4_trans(vb, v_rows + 1024 * kk + 4096 * (dp >> 2) + ((((dp & 3) << 1) ^ v_chunk) << 3));
#if APA_P2_F32
            mma_f32_acc(st.O[2 * dp], pa[kk], vb[0], vb[1]);
            mma_f32_acc(st.O[2 * dp + 1], pa[kk], vb[2], vb[3]);
#else
            mma_f16_acc(st.O[2 * dp], pa[kk], vb[0], vb[1]);
            mma_f16_acc(st.O[2 * dp + 1], pa[kk], vb[2], vb[3]);
#endif
        }
    }
}

// o2 element of this lane: row half (0 lo, 1 hi), channel 8dn + 2t0 + e (§8.6: o2 = float(O)).
__device__ __forceinline__ float p2_o2(const Pass2State& st, int dn, int half, int e) {
#if APA_P2_F32
    return st.O[dn][2 * half + e];
#else
    const uint32_t pr = st.O[dn][half];
    return f32h(e ? h2_hi(pr) : h2_lo(pr));
#endif
}

// §8.6 l2 of the lane's two rows from the quad's four l4 partials: (l4[0] ⊕ l4[1]) ⊕ (l4[2] ⊕ l4[3]).
__device__ __forceinline__ float p2_l2(float l4) {
    const int lane = threadIdx.x & 31, base = lane & ~3;
    const float a0 = __shfl_sync(0xFFFFFFFFu, l4, base + 0);
    const float a1 = __shfl_sync(0xFFFFFFFFu, l4, base + 1);
    const float a2 = __shfl_sync(0xFFFFFFFFu, l4, base + 2);
    const float a3 = __shfl_sync(0xFFFFFFFFu, l4, base + 3);
    return fadd(fadd(a0, a1), fadd(a2, a3));
}

}  // namespace apa
