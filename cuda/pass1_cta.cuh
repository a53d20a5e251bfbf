// pass1_cta.cuh: pass 1's CTA (docs/numerics.md §6.2) around the per-warp numerics of §7 (pass1.cuh, the
// twin of apa_emu/pass1.py): the shared memory and its tile ring, the warp's setup, the warpgroups' turns
// at the tensor cores, and the bounded schedule's carry between launches (§6.7).
#pragma once

#include "pass1.cuh"
#include "pipeline.cuh"

namespace apa {

// Shared memory: the tile ring (pipeline.cuh; a stage holds the K̂ then the V̂ᵀ image of one tile),
// then Q̂ as one image of 64 rows per warpgroup (mma.cuh sw128_half). The MMAs are wgmma (mma.cuh):
// the 4 warps of a warpgroup share each K̂/V̂ᵀ operand read, and no fragment passes through
// registers except P̂.
constexpr int P1_STAGES = D == 256 ? 3 : 5;  // D = 256: stages of 64 KB, 3 and Q̂ fill shared memory
constexpr int P1_Q_HALVES = ROWS_PER_CTA * D;
constexpr int P1_SMEM_BYTES = ring_smem_bytes<P1_STAGES>() + P1_Q_HALVES * 2;

// The bounded schedule (§6.7) ends a launch with the CTA's visiting order unfinished: each warp
// stores its state (o in part, the rest in carry, as m, la, lc, ad, lv, ws and the visit count's bits),
// every row of the warp padding included, and the next launch resumes from it bit for bit. Only the
// segment kernel loads it: with o loaded, ptxas serializes the kernel's wgmma (its warning C7515).
constexpr int P1_CARRY = 7;
template <int NDN>
__device__ __forceinline__ void p1_carry(const Pass1Args& a, const Geom& geo, const WarpRows& wr, size_t bh,
                                         bool store, P1State<NDN>& st) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const size_t r = bh * geo.Rp_buf + (half ? wr.r_hi : wr.r_lo);
        float2* prow = reinterpret_cast<float2*>(a.part + r * D + 2 * wr.t0);
        float* c = a.carry + r * P1_CARRY;
        float& m = st.m[half];
        P1Sums& x = st.r[half];
#pragma unroll
        for (int dn = 0; dn < NDN; ++dn) {
            if (store) {
                prow[4 * dn] = make_float2(st.o[dn][2 * half], st.o[dn][2 * half + 1]);
            } else {
                const float2 v = prow[4 * dn];
                st.o[dn][2 * half] = v.x;
                st.o[dn][2 * half + 1] = v.y;
            }
        }
        if (store) {
            if (wr.t0 == 0) {
                c[0] = m, c[1] = x.la, c[2] = x.lc, c[3] = x.ad, c[4] = x.lv, c[5] = x.ws;
                c[6] = __uint_as_float((uint32_t)st.visit);
            }
        } else {
            m = c[0], x.la = c[1], x.lc = c[2], x.ad = c[3], x.lv = c[4], x.ws = c[5];
            st.visit = (int)__float_as_uint(c[6]);
        }
    }
}

// The warp's rows (common.cuh warp_rows) as pass 1 runs them.
__device__ __forceinline__ WarpRows p1_rows(const Pass1Args& a, const Geom& geo, int qb) {
    WarpRows wr = warp_rows(geo, qb);
    if (a.pad_vote) {  // §6.2: padding rows vote, over the keys of their own unclamped positions
        wr.run_lo = wr.run_hi = true;
        wr.lim_lo = geo.lim(wr.r_lo), wr.lim_hi = geo.lim(wr.r_hi);
        wr.lo_lo = geo.lo(wr.r_lo), wr.lo_hi = geo.lo(wr.r_hi);
    }
    return wr;
}

// Q̂ of the warp's 16 rows (§7.1) into Qg, its warpgroup's image (rows 16 (wl mod 4) ..), as one cp.async
// group, and c_q per row. A warp past the CTA's rows zeroes its rows of the image: the
// warpgroup's wgmma reads them too.
__device__ __forceinline__ void p1_load_q(const Pass1Args& a, const Geom& geo, const WarpRows& wr, size_t bh,
                                          uint16_t* Qg, float (&cq)[2]) {
    const int wrow = 16 * (wr.wl & 3);  // the warp's first row in the image
    cq[0] = cq[1] = 1.0f;
    const uint16_t* qsrc = a.qhat + (bh * geo.Rp_buf + (wr.warp_active ? wr.row0 : 0)) * D;  // padded to Rp
    for (int c = wr.lane; c < 16 * (D / 8); c += 32) {
        const int row = c / (D / 8), col = (c % (D / 8)) * 8;
        cp_async16(Qg + sw128_half(wrow + row, col, 64), qsrc + (size_t)row * D + col, wr.warp_active ? 16u : 0u);
    }
    if (wr.warp_active) {
        cq[0] = a.cq[bh * geo.Rp_buf + wr.r_lo];
        cq[1] = a.cq[bh * geo.Rp_buf + wr.r_hi];
    }
    cp_async_commit();
}

// The warp's P1Warp. lim_w, lo_w: through __reduce, so that p1_mask's test is warp-uniform.
template <bool BUDGET>
__device__ __forceinline__ P1Warp p1_warp(const Pass1Args& a, const Geom& geo, const WarpRows& wr, size_t bh, int b,
                                          int hk, const float (&cq)[2], float lg2_lane, bool inter) {
    P1Warp w;
    w.cq[0] = cq[0], w.cq[1] = cq[1];
    w.lg2_lane = lg2_lane;
    w.inter = inter;
    w.b = b, w.hk = hk;
    w.trace = nullptr;
#if APA_TRACE
    if (wr.warp_active) {
        const int vb = a.visit_base[bh * geo.nw_buf + wr.w];
        if (vb >= 0) w.trace = a.trace_visits + (size_t)vb * VISIT_BYTES;
    }
#endif
    w.hot_w = a.hot + (bh * geo.nw_buf + wr.w) * geo.W_buf;
    const int lim_w = __reduce_min_sync(0xFFFFFFFFu, min(wr.lim_lo, wr.lim_hi));
    const int lo_w = __reduce_max_sync(0xFFFFFFFFu, max(wr.lo_lo, wr.lo_hi));
    w.lim_w = lim_w, w.lo_w = lo_w;
    w.nu_lane = a.output && (wr.g & 1);
    w.nu_bh = w.nu_lane ? a.nu + bh * a.span.stride * TILE + 2 * wr.t0 : nullptr;
    if constexpr (BUDGET)
        if (wr.warp_active) p1_budget_beta(a, geo, wr, bh, cq, w.beta);
    return w;
}

// Pass 1's hardware barriers besides barrier 0 (__syncthreads), as FA3's FwdNamedBarriers. The
// warpgroups issue their MMA batches (batch 0: step 0's scores; batch j + 1: step j's P̂·V̂ and step
// j + 1's scores) in turn, 0, 1, 2, 0, ..., FA3's warp-scheduler barrier: without it they drift into
// issuing together and then all wait for the tensor cores while the ALUs idle (the turns: −2 % in the
// fast mode, docs/results/performance-log.md). Warpgroup w waits on MmaTurn + w for its predecessor's arrival
// (P1_TURN_THREADS: the two warpgroups); every batch has its successor but the last.
enum class P1Barrier : int { MmaTurn = 1 };
constexpr int P1_NWG = WARPS / 4, P1_TURN_THREADS = 2 * 128;
static_assert((int)P1Barrier::MmaTurn + P1_NWG <= 16, "one hardware barrier per warpgroup besides barrier 0");
__device__ __forceinline__ int p1_turn_barrier(int wg) { return (int)P1Barrier::MmaTurn + wg; }

// One CTA's work item of pass 1: warps WARPS qb .. WARPS qb + WARPS − 1 of (b, hk). fresh: see TileRing::reset.
// The loop over the CTA's visiting order runs the tile ring and the warpgroups' turns at the tensor
// cores; a warp's own visits are p1_visit.
// BUDGET: the hot test kind (a.budget), a kernel entry of its own (apa.cu), so that the mass and output
// tests' code is that of a kernel without the budget test. Its t2 before the vote and βr cost registers,
// and ptxas allocates one kernel's registers for all of its code: both kinds behind a run-time branch
// in one kernel left the mass test's pass 1 spilling inside its loop, 20 % slower (docs/results/performance-log.md).
template <bool SEGMENT, bool BUDGET>
__device__ __forceinline__ void pass1_cta(const Pass1Args& a, const Geom& geo, uint16_t* smem, int b, int hk, int qb,
                                          bool fresh) {
    if ((a.budget != 0) != BUDGET) __trap();  // the host launched the other kind's entry (apa_gpu/plan.py)
    constexpr int NDN = D / 8;  // channel n-tiles of o
    const size_t bh = (size_t)b * geo.Hkv + hk;
    const WarpRows wr = p1_rows(a, geo, qb);
    const bool inter = a.interleaved != 0;
    const float lg2_lane = lg2_table(wr.lane < 9 ? wr.lane : 0);
    TileRing<P1_STAGES> ring(smem);
    ring.reset(fresh, 1);
    __syncthreads();
    int i0 = 0, i1 = wr.steps;  // the steps of this launch: all, or the bounded schedule's segment (§6.7)
    if constexpr (SEGMENT) step_range(wr.Fmin, wr.Tmax, a.ascending, a.span.lo, a.span.hi, i0, i1);
    const int nst = i1 - i0;
    if (nst == 0) return;  // the whole CTA
    // The warpgroup's Q̂ image. Its index through a shuffle from lane 0, which the compiler knows to be
    // warp-uniform: the Q̂ descriptors of the score wgmma then live in uniform registers, where
    // computed from threadIdx they took six instructions per wgmma to move there (~45 a step).
    const int wg = __shfl_sync(0xFFFFFFFFu, wr.wl >> 2, 0);
    uint16_t* Qg = ring.tail() + wg * 64 * D;
    float cq[2];
    p1_load_q(a, geo, wr, bh, Qg, cq);
    P1State<NDN> st;
    p1_init(st);
    const uint16_t* khat_bh = a.khat + bh * a.span.stride * TILE * D;
    const uint16_t* vhat_bh = a.vhat + bh * a.span.stride * TILE * D;
    const P1Warp w = p1_warp<BUDGET>(a, geo, wr, bh, b, hk, cq, lg2_lane, inter);
    auto load = [&](int j) {  // the tile images of prep of ring step j (visiting step i0 + j), keys >= S zero
        const size_t base = a.span.slot(visit_tile(i0 + j, wr.Fmin, wr.Tmax, a.ascending)) * TILE * D;
        ring.load_images(j, khat_bh + base, vhat_bh + base);
    };
    if (wr.wl < P1_STAGES && wr.wl < nst) load(wr.wl);
    cp_async_wait<0>();
    fence_proxy_async();  // this lane's Q̂ copies (generic proxy) before the wgmma reads them (async proxy)
    __syncthreads();
    float s[8][4];
    const WgOperand Qop = wg_operand(Qg), stage_op = wg_operand(ring.stage(0));
    auto issue_scores = [&](int j) {  // p1_scores of step j
        ring.wait(j);
        const WgOperand Kop = stage_op.plus((j % P1_STAGES) * STAGE_HALVES);
        p1_zero(s);
        wg_fence();
        p1_scores(s, Qop, Kop);
        wg_commit();
    };
    auto mma_turn = [&](int batch) {  // the warpgroups' turns at the tensor cores: see P1Barrier
        if constexpr (P1_NWG > 1)
            if (batch > 0 || wg > 0) named_bar_sync(p1_turn_barrier(wg), P1_TURN_THREADS);
    };
    auto mma_pass = [&](int batch) {
        if constexpr (P1_NWG > 1)
            if (batch < nst || wg < P1_NWG - 1) named_bar_arrive(p1_turn_barrier((wg + 1) % P1_NWG), P1_TURN_THREADS);
    };
    // Step i's P̂·V̂ and step i+1's scores run on the tensor cores together: one wait per step. The
    // warp releases a stage once both are done (its V̂ᵀ feeds the former).
    mma_turn(0);
    issue_scores(0);
    mma_pass(0);
    uint32_t rel = 0;  // lane 0: the release counter before the warp's last increment
    for (int j = 0; j < nst; ++j) {
        const int t = visit_tile(i0 + j, wr.Fmin, wr.Tmax, a.ascending);
        wg_wait<0>();
        if constexpr (SEGMENT)  // a resumed run's state (§6.7)
            if (j == 0 && i0 > 0 && wr.warp_active) p1_carry(a, geo, wr, bh, false, st);
        // The release of step j − 1's stage, tested a step later, when the counter's round trip is done:
        // the last warp out loads step j + NS − 2 there.
        if (j > 1 && ring.released(j - 2, rel) && j - 2 + P1_STAGES < nst) load(j - 2 + P1_STAGES);
        if (j > 0) rel = ring.release_begin(j - 1);
        const WgOperand Vop = stage_op.plus((j % P1_STAGES) * STAGE_HALVES + TILE * D);
        uint32_t pa[4][4];  // P̂ of a cold tile; zero otherwise (set on each path: no zeroing first)
        if (wr.warp_active && t >= wr.Fw && t <= wr.Tw)
            p1_visit<BUDGET>(a, wr, w, t, s, st, pa);
        else
            p1_zero(pa);
        mma_turn(j + 1);
        wg_fence();
        p1_pv(st, pa, Vop);
        wg_commit();
        if (j + 1 < nst) issue_scores(j + 1);
        mma_pass(j + 1);
    }
    wg_wait<0>();  // the last P̂·V̂ (the ring needs no release: no step follows, and reset re-arms it)

    if (!wr.warp_active) return;
    if (SEGMENT && i1 < wr.steps)
        p1_carry(a, geo, wr, bh, true, st);
    else
        p1_export(a, geo, wr, bh, st);
}

}  // namespace apa
