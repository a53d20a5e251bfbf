// merge.cuh: the pass-2 CTA driver and the log-sum-exp merge (docs/numerics.md §8, §9).
#pragma once

#include "common.cuh"
#include "pass2.cuh"
#include "pipeline.cuh"

namespace apa {

struct Pass2Args {
    const uint16_t* q;       // [B, n, H, D] f16
    const uint16_t* k;       // [B, Hkv, ntkv, 64 * D] f16 tile images (prep.cuh prep_kv16)
    const uint16_t* v;
    const float* sh;         // [B, Hkv, Rp]
    const float* part;       // [B, Hkv, Rp, D] (unused when all_hot)
    const float* ml;         // [B, Hkv, Rp, 2] (unused when all_hot)
    uint32_t* hot;           // [B, Hkv, nw, W]: read; written when all_hot
    uint16_t* out;           // [B, n, H, D] f16
    uint8_t* trace_rows;     // row_dtype(D) records (trace builds)
    const int* row_base;     // [B, Hkv, nw]: record index of the warp's first row, -1 = not traced
    float qmul;
    int all_hot;             // ε < 0 (§9.6): no pass 1, every active tile hot
};

// row_dtype(D) byte layout (apa_emu/trace.py): b, hk, row (i4), m1, l1, m2, l2 (f4), part[D],
// o2[D] (f4), out[D] (f2); packed, no alignment padding.
constexpr int ROW_BYTES = 28 + 10 * D;
constexpr int ROW_PART = 28, ROW_O2 = 28 + 4 * D, ROW_OUT = 28 + 8 * D;

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

// Shared memory of pass 2: the tile ring, then the CTA's union of hot-mask words U[W] and each
// warp's own words [WARPS][W]: P2_SMEM_BYTES + 4 W P2_SMEM_WORDS.
constexpr int P2_STAGES = 6;
constexpr int P2_SMEM_BYTES = ring_smem_bytes<P2_STAGES>();
constexpr int P2_SMEM_WORDS = 1 + WARPS;

// Data written by pass 1 (hot words, m1/l1, part) is read with ld.global.cg (L2, not L1): in the
// fused launch another CTA wrote it, behind the ready flag's release/acquire.
// One CTA's work item of pass 2 and the merge: warps 12 qb .. 12 qb + 11 of (b, hk). fresh: see
// TileRing::reset.
__device__ __forceinline__ void pass2_cta(const Pass2Args& a, const Geom& geo, uint16_t* smem, int b, int hk,
                                          int qb, bool fresh) {
    constexpr int NKS = D / 16, NDN = D / 8;
    const size_t bh = (size_t)b * geo.Hkv + hk;
    const auto [lane, wl, g, t0, w, row0, warp_active, r_lo, r_hi, v_lo, v_hi, lim_lo, lim_hi, Tw, wlast, Tmax] =
        warp_rows(geo, qb);
    const int nwords = (Tmax >> 5) + 1;
    uint32_t* hot_w = a.hot + (bh * geo.nw + (warp_active ? w : 0)) * geo.W;
    TileRing<P2_STAGES> ring(smem);
    ring.reset(fresh);
    uint32_t* U = reinterpret_cast<uint32_t*>(ring.tail());
    uint32_t* Hs = U + geo.W + wl * geo.W;  // this warp's words

    // Union of the CTA's hot masks (the tiles the CTA loads; each warp computes only its own).
    for (int j = threadIdx.x; j < nwords; j += THREADS) U[j] = 0u;
    __syncthreads();
    if (warp_active) {
        for (int j = lane; j <= (Tw >> 5); j += 32) {
            uint32_t word;
            if (a.all_hot) {
                const int nb = min(32, Tw + 1 - 32 * j);
                word = nb >= 32 ? 0xFFFFFFFFu : ((1u << nb) - 1u);
                hot_w[j] = word;
            } else {
                word = __ldcg(hot_w + j);
            }
            Hs[j] = word;
            atomicOr(&U[j], word);
        }
    }
    __syncthreads();

    // Q (FP16) A fragments and the row shifts.
    uint32_t qa[NKS][4];
    float sh_lo = 0.0f, sh_hi = 0.0f;
    {
        const int rl = v_lo ? r_lo : 0, rh = v_hi ? r_hi : 0;
        const uint32_t* qlo = reinterpret_cast<const uint32_t*>(
            a.q + (((size_t)b * geo.n + rl / geo.G) * geo.H + hk * geo.G + rl % geo.G) * D);
        const uint32_t* qhi = reinterpret_cast<const uint32_t*>(
            a.q + (((size_t)b * geo.n + rh / geo.G) * geo.H + hk * geo.G + rh % geo.G) * D);
#pragma unroll
        for (int ks = 0; ks < NKS; ++ks) {
            qa[ks][0] = v_lo ? qlo[8 * ks + t0] : 0u;
            qa[ks][1] = v_hi ? qhi[8 * ks + t0] : 0u;
            qa[ks][2] = v_lo ? qlo[8 * ks + 4 + t0] : 0u;
            qa[ks][3] = v_hi ? qhi[8 * ks + 4 + t0] : 0u;
        }
        if (warp_active) {
            sh_lo = a.sh[bh * geo.Rp + r_lo];
            sh_hi = a.sh[bh * geo.Rp + r_hi];
        }
    }

    Pass2State st;
    p2_init(st);

    // The ring's steps are the union's tiles in ascending order (§8: each warp's own hot tiles in
    // ascending order). ahead = the tile of step i + P2_STAGES, which the last reader of step i loads.
    auto load = [&](int i, int t) {  // K and V of keys 64t.., keys >= S zero (§8.1)
        const size_t base = (bh * geo.ntkv + t) * TILE * D;
        ring.load_images(i, a.k + base, a.v + base);
    };
    int cur = p2_next_tile(U, 0, Tmax);
    int ahead = cur;
    for (int k = 0; k < P2_STAGES; ++k) {
        if (k == wl && ahead <= Tmax) load(k, ahead);
        ahead = p2_next_tile(U, ahead + 1, Tmax);
    }
    for (int i = 0; cur <= Tmax; ++i) {
        ring.wait(i);
        const uint16_t* stage = ring.stage(i);
        if (warp_active && cur <= Tw && ((Hs[cur >> 5] >> (cur & 31)) & 1u))
            p2_tile(st, qa, stage, stage + TILE * D, cur, lim_lo, lim_hi, sh_lo, sh_hi, a.qmul);
        if (ring.release(i) && ahead <= Tmax) load(i + P2_STAGES, ahead);
        ahead = p2_next_tile(U, ahead + 1, Tmax);
        cur = p2_next_tile(U, cur + 1, Tmax);
    }

    // §8.6 end, §9 merge (every warp, §9.5).
    if (!warp_active) return;
    const float l2_lo = p2_l2(st.l4_lo);
    const float l2_hi = p2_l2(st.l4_hi);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        if (!(half ? v_hi : v_lo)) continue;
        const int r = half ? r_hi : r_lo;
        const float m2 = half ? st.m_hi : st.m_lo;
        const float l2 = half ? l2_hi : l2_lo;
        float m1 = neg_inf(), l1 = 0.0f;
        if (!a.all_hot) {
            m1 = __ldcg(a.ml + (bh * geo.Rp + r) * 2 + 0);
            l1 = __ldcg(a.ml + (bh * geo.Rp + r) * 2 + 1);
        }
        const float M = fmaxf(m1, m2);                                   // §9.1
        const float w1 = (l1 > 0.0f) ? exp2x(fsub(m1, M)) : 0.0f;         // §9.2
        const float w2 = (l2 > 0.0f) ? exp2x(fsub(m2, M)) : 0.0f;
        const float inv = fdiv(1.0f, fadd(fmul(w1, l1), fmul(w2, l2)));  // §9.3
        const int i_q = r / geo.G, h = hk * geo.G + r % geo.G;
        uint16_t* orow = a.out + (((size_t)b * geo.n + i_q) * geo.H + h) * D;
        const float* prow = a.part + (bh * geo.Rp + r) * D;
        [[maybe_unused]] uint8_t* rec = nullptr;
#if APA_TRACE
        {
            const int rb = a.row_base[bh * geo.nw + w];
            if (rb >= 0) rec = a.trace_rows + (size_t)(rb + (r - row0)) * ROW_BYTES;
        }
#endif
#pragma unroll
        for (int dn = 0; dn < NDN; ++dn) {
            const int c = 8 * dn + 2 * t0;
            float2 pv = make_float2(0.0f, 0.0f);
            if (!a.all_hot) pv = __ldcg(reinterpret_cast<const float2*>(prow + c));
            const float o2a = p2_o2(st, dn, half, 0), o2b = p2_o2(st, dn, half, 1);
            const float ya = fmul(fadd(fmul(w1, pv.x), fmul(w2, o2a)), inv);  // §9.4
            const float yb = fmul(fadd(fmul(w1, pv.y), fmul(w2, o2b)), inv);
            const uint32_t pr = f16x2(ya, yb);
            *reinterpret_cast<uint32_t*>(orow + c) = pr;
#if APA_TRACE
            if (rec != nullptr) {
                // Records are only 4-byte aligned (28 + 10 D bytes each): scalar stores.
                float* fp = reinterpret_cast<float*>(rec + ROW_PART + 4 * c);
                float* fo = reinterpret_cast<float*>(rec + ROW_O2 + 4 * c);
                fp[0] = pv.x; fp[1] = pv.y;
                fo[0] = o2a; fo[1] = o2b;
                *reinterpret_cast<uint32_t*>(rec + ROW_OUT + 2 * c) = pr;
            }
#endif
        }
#if APA_TRACE
        if (rec != nullptr && t0 == 0) {
            int* hdr = reinterpret_cast<int*>(rec);
            float* fh = reinterpret_cast<float*>(rec);
            hdr[0] = b; hdr[1] = hk; hdr[2] = r;
            fh[3] = m1; fh[4] = l1; fh[5] = m2; fh[6] = l2;
        }
#endif
    }
}

}  // namespace apa
