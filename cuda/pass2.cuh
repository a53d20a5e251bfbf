// pass2.cuh: pass 2 per warp over its hot tiles in ascending order (docs/numerics.md §8), and the
// CTA driver that ends with the merge of both passes (§9, merge.cuh).
//
// Per lane (g = lane>>2, t0 = lane&3), rows g ("lo") and g+8 ("hi"): m replicated over the quad, l4 and
// p4 = the lane's own per-t0 partial sums of p and p² (§8.4: the m16n8k16 accumulator layout gives lane
// t0 exactly keys 8nt + 2t0 + e), O = the output accumulator fragment (f16x2 pairs or f32).
#pragma once

#include "common.cuh"
#include "merge.cuh"
#include "mma.cuh"
#include "pipeline.cuh"

namespace apa {

// all_hot, fma and direct are apa_emu.constants.Pass2Flags, by the same names.
#define APA_FIELDS_Pass2Args(X)                                                                                       \
    X(const uint16_t*, q)          /* [B, n, H, D] f16 */                                                             \
    X(const uint16_t*, k)          /* the inputs: [B, S, Hkv, D] f16, or page pools (§5.0) */                         \
    X(const uint16_t*, v)                                                                                             \
    X(KvPages, pages)              /* table null: contiguous */                                                       \
    X(const void*, kv_maps)        /* contiguous: the tensor maps of k and v (apa_gpu/device.py); paged: null */      \
    X(const float*, sh)            /* [B, Hkv, Rp] */                                                                 \
    X(const float*, part)          /* [B, Hkv, Rp, D] (unused when all_hot) */                                        \
    X(const float*, ml)            /* [B, Hkv, Rp, 4] = (m1, l1, ad1, ws1) (unused when all_hot) */                   \
    X(uint32_t*, hot)              /* [B, Hkv, nw, W]: read; written when all_hot */                                  \
    X(uint16_t*, out)              /* [B, n, H, D] f16 */                                                             \
    X(const float*, cq)            /* [B, Hkv, Rp] (§5.3) */                                                          \
    X(const float*, qstat)         /* [B, Hkv, Rp, 3] (§5.7) */                                                       \
    X(const unsigned int*, kvstat) /* [B, Hkv, KV_STATS] float bits (§5.7) */                                         \
    X(float*, bound)               /* [B, n, H] f32: err_bound (§9.7) */                                              \
    X(float*, est)                 /* [B, n, H] f32: err_est (§9.8) */                                                \
    X(uint8_t*, trace_rows)        /* row_dtype(D) records (trace builds) */                                          \
    X(const int*, row_base)        /* [B, Hkv, nw]: record index of the warp's first row, -1 = not traced */          \
    X(float, qmul)                                                                                                    \
    X(int, all_hot)                /* ε < 0 (§9.6): no pass 1, every active tile hot */                               \
    X(int, fma)                    /* the seed's FMA sites (§1.8): §8.1 x, §9.3-9.4 */                                \
    X(int, direct)                 /* direct_store (§9.5): a warp with no hot tile stores f16(part), not the merge */ \
    X(CertConsts, cert)                                                                                               \
    X(EstConsts, est_k)
struct Pass2Args {
    APA_FIELDS_Pass2Args(APA_MEMBER)
};

// row_dtype(D) byte layout (apa_emu/trace.py): b, hk, row (i4), m1, l1, m2, l2, ad1, err_bound, ws1, p2,
// err_est (f4), part[D], o2[D] (f4), out[D] (f2); packed, no alignment padding.
constexpr int ROW_HEAD = 48;
constexpr int ROW_BYTES = ROW_HEAD + 10 * D;
constexpr int ROW_PART = ROW_HEAD, ROW_O2 = ROW_HEAD + 4 * D, ROW_OUT = ROW_HEAD + 8 * D;

struct Pass2State {
#if APA_P2_F32
    float O[D / 8][4];
#else
    uint32_t O[D / 8][2];
#endif
    float m_lo, m_hi, l4_lo, l4_hi, p4_lo, p4_hi;
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
    st.p4_lo = st.p4_hi = 0.0f;
}

// §8.1 scores of tile t (apa_emu/pass2.py p2_scores): S = chain over channels from C = +0, FP16
// accumulation (APA_P2_S32: binary32), then x = (float(S) ⊗ qmul) ⊖ sh; FUSED: x at the seed's FMA site
// (§1.8). ldmatrix row addresses in the K̂ image: sw128_half(r, c, TILE) with the lane's r and c split into
// the lane's part and the k-step's; r mod 8 = lane mod 8 in every matrix, so the swizzle is an XOR of the
// k-step's chunk bits with one per-lane constant.
template <bool FUSED>
__device__ __forceinline__ void p2_scores(const uint32_t (&qa)[D / 16][4], const uint16_t* Ks, float sh_lo,
                                          float sh_hi, float qmul, float (&x)[8][4]) {
    constexpr int NKS = D / 16;
    const int lane = threadIdx.x & 31;
    const int l7 = lane & 7;
    const uint16_t* k_rows = Ks + 64 * (8 * (lane >> 4) + l7);          // r = 16 np + 8 (lane >> 4) + l7
    const int k_chunk = ((lane >> 3) & 1) ^ l7;                          // c = 16 ks + 8 ((lane >> 3) & 1)
#if APA_P2_S32
    float s[8][4];  // the m16n8 accumulator fragment: lo e0, lo e1, hi e0, hi e1
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#else
    uint32_t s[8][2];  // f16x2 pairs: lo, hi
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = 0u;
#endif
#pragma unroll
    for (int ks = 0; ks < NKS; ++ks) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t kb[4];
            ldsm_x4(kb, k_rows + 1024 * np + 4096 * (ks >> 2) + ((((ks & 3) << 1) ^ k_chunk) << 3));
#if APA_P2_S32
            mma_f32_acc(s[2 * np], qa[ks], kb[0], kb[1]);
            mma_f32_acc(s[2 * np + 1], qa[ks], kb[2], kb[3]);
#else
            mma_f16_acc(s[2 * np], qa[ks], kb[0], kb[1]);
            mma_f16_acc(s[2 * np + 1], qa[ks], kb[2], kb[3]);
#endif
        }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {  // x[nt]: lo e0, lo e1, hi e0, hi e1
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#if APA_P2_S32
            x[nt][e] = madd(s[nt][e], qmul, -sh_lo, FUSED);
            x[nt][2 + e] = madd(s[nt][2 + e], qmul, -sh_hi, FUSED);
#else
            x[nt][e] = madd(f32h(e ? h2_hi(s[nt][0]) : h2_lo(s[nt][0])), qmul, -sh_lo, FUSED);
            x[nt][2 + e] = madd(f32h(e ? h2_hi(s[nt][1]) : h2_lo(s[nt][1])), qmul, -sh_hi, FUSED);
#endif
        }
    }
}

// §8.1's mask: x = −inf where key > lim or key < lo, the selects only on the lanes whose rows the tile
// reaches past (a few tiles of each warp; ~100 instructions a tile).
__device__ __forceinline__ void p2_mask(float (&x)[8][4], const WarpRows& wr, int t) {
    const int t0 = threadIdx.x & 3;
    if (t * TILE + TILE - 1 > min(wr.lim_lo, wr.lim_hi) || t * TILE < max(wr.lo_lo, wr.lo_hi)) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = t * TILE + 8 * nt + 2 * t0 + e;
                if (key > wr.lim_lo || key < wr.lo_lo) x[nt][e] = neg_inf();
                if (key > wr.lim_hi || key < wr.lo_hi) x[nt][2 + e] = neg_inf();
            }
        }
    }
}

// §8.2 frame (apa_emu/pass2.py p2_frame): m = max(m, the tile's row max), l4, O and (twice) p4 rescaled
// by a = exp2(m_old ⊖ m); ms: the shift of §8.3 (+0 while m = −inf).
__device__ __forceinline__ void p2_frame(Pass2State& st, const float (&x)[8][4], float& ms_lo, float& ms_hi) {
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
    ms_lo = (st.m_lo == neg_inf()) ? 0.0f : st.m_lo;
    ms_hi = (st.m_hi == neg_inf()) ? 0.0f : st.m_hi;
    st.l4_lo = fmul(st.l4_lo, a_lo);
    st.l4_hi = fmul(st.l4_hi, a_hi);
    st.p4_lo = fmul(fmul(st.p4_lo, a_lo), a_lo);
    st.p4_hi = fmul(fmul(st.p4_hi, a_hi), a_hi);
#if APA_P2_F32
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
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
        for (int dn = 0; dn < D / 8; ++dn) {
            st.O[dn][0] = hmul2(st.O[dn][0], m2_lo);
            st.O[dn][1] = hmul2(st.O[dn][1], m2_hi);
        }
    }
#endif
}

// §8.3 probabilities (apa_emu/pass2.py p2_probs), §8.4 row sums of p and p² (p2_row_sum: per t0,
// n-tiles in order; p² by fmas, 2 per pair where the §3.1 chain of P16 against itself took 8 MMAs per
// tile: pass 2 −4.5 % fast, −7.5 % exact) and §8.5's P16 A fragments pa, in one pass over the n-tiles.
__device__ __forceinline__ void p2_probs(Pass2State& st, const float (&x)[8][4], float ms_lo, float ms_hi,
                                         uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float p0 = exp2x<exp2s_nonpos>(fsub(x[nt][0], ms_lo));
        const float p1 = exp2x<exp2s_nonpos>(fsub(x[nt][1], ms_lo));
        const float p2 = exp2x<exp2s_nonpos>(fsub(x[nt][2], ms_hi));
        const float p3 = exp2x<exp2s_nonpos>(fsub(x[nt][3], ms_hi));
        st.l4_lo = fadd(st.l4_lo, fadd(p0, p1));
        st.l4_hi = fadd(st.l4_hi, fadd(p2, p3));
        st.p4_lo = fma_sq(p1, fma_sq(p0, st.p4_lo));
        st.p4_hi = fma_sq(p3, fma_sq(p2, st.p4_hi));
        pa[nt >> 1][(nt & 1) * 2 + 0] = f16x2(p0, p1);
        pa[nt >> 1][(nt & 1) * 2 + 1] = f16x2(p2, p3);
    }
}

// §8.5 (apa_emu/pass2.py p2_pv): O = chain of P16·V over the 4 16-key k-steps with C = O. ldmatrix
// rows of the V̂ᵀ image as in p2_scores.
__device__ __forceinline__ void p2_pv(Pass2State& st, const uint32_t (&pa)[4][4], const uint16_t* Vs) {
    const int lane = threadIdx.x & 31, l7 = lane & 7;
    const uint16_t* v_rows = Vs + 64 * (8 * ((lane >> 3) & 1) + l7);    // r = 16 kk + 8 ((lane >> 3) & 1) + l7
    const int v_chunk = (lane >> 4) ^ l7;                                // c = 16 dp + 8 (lane >> 4)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
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

// One hot tile of one warp (§8.1-8.5); FUSED: §8.1's x at the seed's FMA site (§1.8).
template <bool FUSED>
__device__ __forceinline__ void p2_tile(Pass2State& st, const uint32_t (&qa)[D / 16][4], const uint16_t* Ks,
                                        const uint16_t* Vs, int t, const WarpRows& wr, float sh_lo, float sh_hi,
                                        float qmul) {
    float x[8][4];
    p2_scores<FUSED>(qa, Ks, sh_lo, sh_hi, qmul, x);
    p2_mask(x, wr, t);
    float ms_lo, ms_hi;
    p2_frame(st, x, ms_lo, ms_hi);
    uint32_t pa[4][4];
    p2_probs(st, x, ms_lo, ms_hi, pa);
    p2_pv(st, pa, Vs);
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

// §8.6 l2 of the lane's two rows from the quad's four l4 partials: (l4[0] ⊕ l4[1]) ⊕ (l4[2] ⊕ l4[3]); the
// same sum of the quad's per-t0 partials is §9.8's ssq4.
__device__ __forceinline__ float quad_sum(float l4) {
    const int lane = threadIdx.x & 31, base = lane & ~3;
    const float a0 = __shfl_sync(0xFFFFFFFFu, l4, base + 0);
    const float a1 = __shfl_sync(0xFFFFFFFFu, l4, base + 1);
    const float a2 = __shfl_sync(0xFFFFFFFFu, l4, base + 2);
    const float a3 = __shfl_sync(0xFFFFFFFFu, l4, base + 3);
    return fadd(fadd(a0, a1), fadd(a2, a3));
}

__device__ __forceinline__ int p2_next_tile(const uint32_t* U, int from, int Tmax) {
    for (int t = from; t <= Tmax; ++t) {
        const uint32_t wd = U[t >> 5] >> (t & 31);
        if (wd == 0) {
            t = (t | 31);  // rest of this word is empty
            continue;
        }
        return t + __ffs(wd) - 1;
    }
    return Tmax + 1;
}

// Shared memory of pass 2: P2_SLICES tile rings of P2_STAGES stages, one per slice of consecutive
// warps, then each slice's union of its warps' hot-mask words U[P2_SLICES][W] and each warp's own
// words [WARPS][W]: P2_SMEM_BYTES + 4 W P2_SMEM_WORDS.
// Three slices of 4 warps (D = 64, 128): at 122880 keys the busiest slice's union is 886 tiles
// against the CTA's 1258 (outlier-heavy input), and pass 2 took 11 % less than with one ring of 6
// stages, 5 % less than with two of 3 (docs/results/performance-log.md).
constexpr int P2_SLICES = D == 256 ? 1 : 3;
constexpr int P2_STAGES = (D == 256 ? 3 : 6) / P2_SLICES;
using Pass2Ring = TileRing<P2_STAGES, P2_SLICES>;
constexpr int P2_SMEM_BYTES = ring_smem_bytes<P2_STAGES * P2_SLICES>();
constexpr int P2_SMEM_WORDS = P2_SLICES + WARPS;

// §9.7 err_bound of the lane's row (half: 0 lo, 1 hi) from pass 1's m1, l1, ad1, pass 2's l2, the row's
// c_q (§5.3) and qstat and the head's kvstat (§5.7); ok: every channel of the row's output is finite.
__device__ __forceinline__ float p2_bound(const Pass2Args& a, const WarpRows& wr, const MergeWeights& mw,
                                          const float (&ml)[P1_ML], float l2, float cq, const float* qs,
                                          const unsigned int* kv, int half, int nh, bool ok) {
    const CertRow row{ml[0], ml[1], ml[2], l2, cq, qs[0], qs[1], qs[2], __uint_as_float(kv[0]), __uint_as_float(kv[1]),
                      __uint_as_float(kv[2]), __uint_as_float(kv[3]), __uint_as_float(kv[4]),
                      half ? wr.lo_hi : wr.lo_lo, half ? wr.lim_hi : wr.lim_lo, nh, ok};
    return merge_bound(mw, row, a.cert, a.qmul);
}

// §9.8 err_est of the lane's row from pass 1's ws1, pass 2's m2, l2 and P2 (§8.6), the row's c_q, qstat and
// shift sh (§5.3), the head's means (§5.7) and ssq4's quad sums q2 and f2; ok as in p2_bound.
__device__ __forceinline__ float p2_estimate(const Pass2Args& a, const MergeWeights& mw, const float (&ml)[P1_ML],
                                             float m2, float l2, float p2, float cq, const float* qs, float sh,
                                             const unsigned int* kv, float q2, float f2, int nh, bool ok) {
    const EstRow er{ml[3], m2, l2, p2, cq, qs[0], qs[1], sh, __uint_as_float(kv[5]), __uint_as_float(kv[6]),
                    __uint_as_float(kv[7]), __uint_as_float(kv[8]), q2, f2, nh, ok};
    return merge_estimate<D>(mw, er, a.est_k);
}

#if APA_TRACE
// §10: channels c, c + 1 of a row's record: part, o2 and out. Records are only 4-byte aligned (48 + 10 D
// bytes each): scalar stores.
__device__ __forceinline__ void p2_record_channels(uint8_t* rec, int c, float2 pv, float o2a, float o2b, uint32_t pr) {
    float* fp = reinterpret_cast<float*>(rec + ROW_PART + 4 * c);
    float* fo = reinterpret_cast<float*>(rec + ROW_O2 + 4 * c);
    fp[0] = pv.x; fp[1] = pv.y;
    fo[0] = o2a; fo[1] = o2b;
    *reinterpret_cast<uint32_t*>(rec + ROW_OUT + 2 * c) = pr;
}

// §10: the head of row r's record: b, hk, r, m1, l1, m2, l2, ad1, err_bound (eb), ws1, p2, err_est (ee).
__device__ __forceinline__ void p2_record_head(const Pass2Args& a, const Geom& geo, const WarpRows& wr, size_t bh,
                                               int b, int hk, int r, const float (&ml)[P1_ML], float m2, float l2,
                                               float eb, float p2, float ee) {
    const int rb = a.row_base[bh * geo.nw_buf + wr.w];
    if (rb >= 0) {
        uint8_t* rec = a.trace_rows + (size_t)(rb + (r - wr.row0)) * ROW_BYTES;
        int* hdr = reinterpret_cast<int*>(rec);
        float* fh = reinterpret_cast<float*>(rec);
        hdr[0] = b; hdr[1] = hk; hdr[2] = r;
        fh[3] = ml[0]; fh[4] = ml[1]; fh[5] = m2; fh[6] = l2;
        fh[7] = ml[2]; fh[8] = eb; fh[9] = ml[3]; fh[10] = p2; fh[11] = ee;
    }
}
#endif

// §8.6 end, §9 merge, §9.7 certificate and §9.8 estimate of the warp's valid rows (every warp, with or
// without hot tiles: §9.5), stored to out, bound and est and, in trace builds, to the row records (§10).
// Pass 1's ml and part are read with ld.global.cg (see pass2_cta). Hs: the warp's hot-mask words (nh of
// §9.7); sh: the rows' shifts (§5.3).
// The fast build compiles the merge apart from the tile loop: inlined, its registers (the estimate's
// sums, the merge weights, the row records) pushed ptxas to spill inside the loop (60 B); out of line the
// loop spills nothing and pass 2 runs 3.2 % faster (tools/bench_ab.py, H200). The exact build's loop,
// whose exp2s needs more registers, was 5.6 % slower so, and keeps it inline (as does the simulator, to
// which inlining means nothing).
#if APA_EXP2_FAST && !defined(APA_SIM)
#define APA_P2_MERGE __noinline__
#else
#define APA_P2_MERGE __forceinline__
#endif
__device__ APA_P2_MERGE void p2_merge_rows(const Pass2Args& a, const Geom& geo, const WarpRows& wr,
                                        const Pass2State& st, const uint32_t* Hs, int b, int hk,
                                        const float (&sh)[2]) {
    constexpr int NDN = D / 8;
    const size_t bh = (size_t)b * geo.Hkv + hk;
    const float l2_lo = quad_sum(st.l4_lo);
    const float l2_hi = quad_sum(st.l4_hi);
    int nh = 0;
    for (int j = 0; j <= (wr.Tw >> 5); ++j) nh += __popc(Hs[j]);
    float ml[2][P1_ML];
    MergeWeights mw[2];
    bool bad[2] = {false, false};  // a non-finite channel of the lane's share of the row
    // §9.8 ssq4's lane sums (this lane is t0) of o2 and of the final rounding's error out ⊖ y
    float q2[2] = {0.0f, 0.0f}, f2[2] = {0.0f, 0.0f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        ml[half][0] = neg_inf();
        ml[half][1] = ml[half][2] = ml[half][3] = 0.0f;
        if (!(half ? wr.v_hi : wr.v_lo)) continue;
        const int r = half ? wr.r_hi : wr.r_lo;
        if (!a.all_hot) {
#pragma unroll
            for (int i = 0; i < P1_ML; ++i) ml[half][i] = __ldcg(a.ml + (bh * geo.Rp_buf + r) * P1_ML + i);
        }
        mw[half] = merge_weights(ml[half][0], ml[half][1], half ? st.m_hi : st.m_lo, half ? l2_hi : l2_lo, a.fma);
        const int i_q = r / geo.G, h = hk * geo.G + r % geo.G;
        uint16_t* orow = a.out + ((geo.q0 + i_q) * geo.H + h) * D;
        const float* prow = a.part + (bh * geo.Rp_buf + r) * D;
        [[maybe_unused]] uint8_t* rec = nullptr;
#if APA_TRACE
        {
            const int rb = a.row_base[bh * geo.nw_buf + wr.w];
            if (rb >= 0) rec = a.trace_rows + (size_t)(rb + (r - wr.row0)) * ROW_BYTES;
        }
#endif
#pragma unroll
        for (int dn = 0; dn < NDN; ++dn) {
            const int c = 8 * dn + 2 * wr.t0;
            float2 pv = make_float2(0.0f, 0.0f);
            if (!a.all_hot) pv = __ldcg(reinterpret_cast<const float2*>(prow + c));
            const float o2a = p2_o2(st, dn, half, 0), o2b = p2_o2(st, dn, half, 1);
            const float2 y = a.direct && nh == 0 ? pv : merge_y2(mw[half], pv, o2a, o2b, a.fma);  // §9.5, §9.4
            const uint32_t pr = f16x2(y.x, y.y);
            *reinterpret_cast<uint32_t*>(orow + c) = pr;
            bad[half] |= (pr & 0x7C00u) == 0x7C00u || (pr & 0x7C000000u) == 0x7C000000u;
            const float ea = fsub(f32h(h2_lo(pr)), y.x), eb = fsub(f32h(h2_hi(pr)), y.y);
            q2[half] = fadd(fadd(q2[half], fmul(o2a, o2a)), fmul(o2b, o2b));
            f2[half] = fadd(fadd(f2[half], fmul(ea, ea)), fmul(eb, eb));
#if APA_TRACE
            if (rec != nullptr) p2_record_channels(rec, c, pv, o2a, o2b, pr);
#endif
        }
    }
    // Finiteness of each row over its quad (an OR: order-free), and ssq4's quad sums, with every lane of
    // the warp present.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        int any = bad[half] ? 1 : 0;
        any |= __shfl_xor_sync(0xFFFFFFFFu, any, 1);
        any |= __shfl_xor_sync(0xFFFFFFFFu, any, 2);
        bad[half] = any != 0;
        q2[half] = quad_sum(q2[half]);
        f2[half] = quad_sum(f2[half]);
    }
    const float p2_lo = quad_sum(st.p4_lo), p2_hi = quad_sum(st.p4_hi);  // §8.6 P2
    if (wr.t0 != 0) return;
    const unsigned int* kv = a.kvstat + bh * KV_STATS;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        if (!(half ? wr.v_hi : wr.v_lo)) continue;
        const int r = half ? wr.r_hi : wr.r_lo;
        const float* qs = a.qstat + (bh * geo.Rp_buf + r) * 3;
        const float cq = a.cq[bh * geo.Rp_buf + r], m2 = half ? st.m_hi : st.m_lo, p2 = half ? p2_hi : p2_lo;
        const float l2 = half ? l2_hi : l2_lo;
        const float eb = p2_bound(a, wr, mw[half], ml[half], l2, cq, qs, kv, half, nh, !bad[half]);
        const float ee = p2_estimate(a, mw[half], ml[half], m2, l2, p2, cq, qs, sh[half], kv, q2[half], f2[half], nh,
                                     !bad[half]);
        const size_t o = (geo.q0 + r / geo.G) * geo.H + hk * geo.G + r % geo.G;
        a.bound[o] = eb;
        a.est[o] = ee;
#if APA_TRACE
        p2_record_head(a, geo, wr, bh, b, hk, r, ml[half], m2, l2, eb, p2, ee);
#endif
    }
}

// The warp's hot-mask words into Hs and their union over the slice into U (the tiles its ring loads;
// each warp computes only its own), U0: every slice's union. Under all_hot (ε < 0, §9.6) every active
// tile F_w .. T_w is hot, and the words are written to hot_w as well.
__device__ __forceinline__ void p2_hot_union(const Pass2Args& a, const Geom& geo, const WarpRows& wr, uint32_t* hot_w,
                                             uint32_t* U0, uint32_t* U, uint32_t* Hs) {
    for (int j = threadIdx.x; j < P2_SLICES * geo.W; j += THREADS) U0[j] = 0u;
    __syncthreads();
    if (wr.warp_active) {
        for (int j = wr.lane; j <= (wr.Tw >> 5); j += 32) {
            uint32_t word;
            if (a.all_hot) {
                const int first = max(wr.Fw - 32 * j, 0), last = min(wr.Tw - 32 * j, 31);  // bits of word j
                word = first > last ? 0u : (0xFFFFFFFFu >> (31 - last)) & (0xFFFFFFFFu << first);
                hot_w[j] = word;
            } else {
                word = __ldcg(hot_w + j);
            }
            Hs[j] = word;
            atomicOr(&U[j], word);
        }
    }
    __syncthreads();
}

// Q (FP16) as the A fragments of §8.1's MMA, zero in invalid rows, and the row shifts sh (§5.3).
__device__ __forceinline__ void p2_load_q(const Pass2Args& a, const Geom& geo, const WarpRows& wr, size_t bh, int hk,
                                          uint32_t (&qa)[D / 16][4], float& sh_lo, float& sh_hi) {
    sh_lo = 0.0f, sh_hi = 0.0f;
    const int rl = wr.v_lo ? wr.r_lo : 0, rh = wr.v_hi ? wr.r_hi : 0;
    const uint32_t* qlo = reinterpret_cast<const uint32_t*>(
        a.q + ((geo.q0 + rl / geo.G) * geo.H + hk * geo.G + rl % geo.G) * D);
    const uint32_t* qhi = reinterpret_cast<const uint32_t*>(
        a.q + ((geo.q0 + rh / geo.G) * geo.H + hk * geo.G + rh % geo.G) * D);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        qa[ks][0] = wr.v_lo ? qlo[8 * ks + wr.t0] : 0u;
        qa[ks][1] = wr.v_hi ? qhi[8 * ks + wr.t0] : 0u;
        qa[ks][2] = wr.v_lo ? qlo[8 * ks + 4 + wr.t0] : 0u;
        qa[ks][3] = wr.v_hi ? qhi[8 * ks + 4 + wr.t0] : 0u;
    }
    if (wr.warp_active) {
        sh_lo = a.sh[bh * geo.Rp_buf + wr.r_lo];
        sh_hi = a.sh[bh * geo.Rp_buf + wr.r_hi];
    }
}

// Data written by pass 1 (hot words, m1/l1, part) is read with ld.global.cg (L2, not L1): in the
// fused launch another CTA wrote it, behind the ready flag's release/acquire.
// One CTA's work item of pass 2 and the merge: warps WARPS qb .. WARPS qb + WARPS − 1 of (b, hk). fresh: see
// TileRing::reset.
__device__ __forceinline__ void pass2_cta(const Pass2Args& a, const Geom& geo, uint16_t* smem, int b, int hk,
                                          int qb, bool fresh) {
    constexpr int NKS = D / 16;
    const size_t bh = (size_t)b * geo.Hkv + hk;
    const WarpRows wr = warp_rows(geo, qb);
    uint32_t* hot_w = a.hot + (bh * geo.nw_buf + (wr.warp_active ? wr.w : 0)) * geo.W_buf;
    const int slice = wr.wl / Pass2Ring::MEMBERS, sw = wr.wl % Pass2Ring::MEMBERS;  // slice, warp in it
    Pass2Ring ring(smem, slice);
    ring.reset(fresh, a.kv_maps ? 1 : 32);
    if (a.kv_maps && (threadIdx.x & 31) == 0) tensormap_acquire(a.kv_maps);
    uint32_t* const U0 = reinterpret_cast<uint32_t*>(ring.tail());
    uint32_t* const U = U0 + slice * geo.W;
    uint32_t* Hs = U0 + P2_SLICES * geo.W + wr.wl * geo.W;  // this warp's words

    p2_hot_union(a, geo, wr, hot_w, U0, U, Hs);
    uint32_t qa[NKS][4];
    float sh_lo, sh_hi;
    p2_load_q(a, geo, wr, bh, hk, qa, sh_lo, sh_hi);

    Pass2State st;
    p2_init(st);

    // The ring's steps are the union's tiles in ascending order (§8: each warp's own hot tiles in
    // ascending order). ahead = the tile of step i + P2_STAGES, which the last reader of step i loads.
    // K and V of keys 64t.. (§8.1). Keys >= S are zeros through the rows (paged), or through the
    // tensor maps the next sequence's keys or zeros: finite either way (validated inputs), so their
    // masked scores and P = +0 make the same bits (§3.1: zero products add nothing).
    auto load = [&](int i, int t) {
        if (a.kv_maps) return ring.load_tensors(i, a.kv_maps, hk, (int)(geo.k0 + (long long)t * TILE));
        ring.load_rows(i, a.k, a.v, [&](int j) {
            const int key = t * TILE + j;
            if (key >= geo.S) return -1LL;
            return a.pages.table ? kv_row<true>(a.pages, geo, b, key, hk) : kv_row<false>(a.pages, geo, b, key, hk);
        });
    };
    int cur = p2_next_tile(U, 0, wr.Tmax);
    int ahead = cur;
    for (int k = 0; k < P2_STAGES; ++k) {
        if (k == sw && ahead <= wr.Tmax) load(k, ahead);
        ahead = p2_next_tile(U, ahead + 1, wr.Tmax);
    }
    for (int i = 0; cur <= wr.Tmax; ++i) {
        ring.wait(i);
        const uint16_t* stage = ring.stage(i);
        if (wr.warp_active && cur <= wr.Tw && ((Hs[cur >> 5] >> (cur & 31)) & 1u)) {
            if (a.fma)  // compiled twice: a run-time select in the element loop costs ~15 % of pass 2
                p2_tile<true>(st, qa, stage, stage + TILE * D, cur, wr, sh_lo, sh_hi, a.qmul);
            else
                p2_tile<false>(st, qa, stage, stage + TILE * D, cur, wr, sh_lo, sh_hi, a.qmul);
        }
        if (ring.release(i) && ahead <= wr.Tmax) load(i + P2_STAGES, ahead);
        ahead = p2_next_tile(U, ahead + 1, wr.Tmax);
        cur = p2_next_tile(U, cur + 1, wr.Tmax);
    }

    if (wr.warp_active) p2_merge_rows(a, geo, wr, st, Hs, b, hk, {sh_lo, sh_hi});
}

}  // namespace apa
