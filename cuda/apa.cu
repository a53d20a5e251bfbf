// apa.cu: kernel entry points of the APA attention (docs/numerics.md), one cubin per build variant.
//
// Build variants (-D, see apa_gpu/build.py): APA_D (64 | 128), APA_TRACE (0 | 1), APA_P2_F32
// (pass-2 output accumulation, §8.5), APA_EXP2_FAST (§2). Everything else is a run-time argument.
//
// Launch sequence (apa_gpu/launch.py), all on one stream:
//   apa_prep_stats -> apa_prep_finalize -> apa_prep_q, apa_prep_k, apa_prep_v, apa_prep_kv16
//   -> apa_pass1 (skipped when ε < 0) -> apa_pass2 (pass 2 and the merge).
// Every kernel takes the geometry (n, H, Hkv, S, q_offset) as int32 and batch as grid z.
#include "common.cuh"
#include "prep.cuh"
#include "pass1.cuh"
#include "pass2.cuh"

using namespace apa;

extern "C" __global__ void __launch_bounds__(STATS_THREADS)
apa_prep_stats(const uint16_t* k, const uint16_t* v, unsigned long long* ksum, unsigned int* amax, int n, int H,
               int Hkv, int S, int q_offset) {
    const Geom g(n, H, Hkv, S, q_offset);
    prep_stats(k, v, ksum, amax, g);
}

extern "C" __global__ void __launch_bounds__(D)
apa_prep_finalize(const unsigned long long* ksum, const unsigned int* amax, float* kmean, float* scales, int n,
                  int H, int Hkv, int S, int q_offset) {
    const Geom g(n, H, Hkv, S, q_offset);
    prep_finalize(ksum, amax, kmean, scales, g);
}

extern "C" __global__ void __launch_bounds__(128)
apa_prep_k(const uint16_t* k, const float* kmean, const float* scales, uint16_t* khat, int n, int H, int Hkv,
           int S, int q_offset, int quant, int lsq, int interleaved) {
    const Geom g(n, H, Hkv, S, q_offset);
    prep_k(k, kmean, scales, khat, g, quant != 0, lsq != 0, interleaved != 0);
}

extern "C" __global__ void __launch_bounds__(128)
apa_prep_v(const uint16_t* v, const float* scales, uint16_t* vhat, int n, int H, int Hkv, int S, int q_offset,
           int quant, int lsq, int interleaved) {
    const Geom g(n, H, Hkv, S, q_offset);
    prep_v(v, scales, vhat, g, quant != 0, lsq != 0, interleaved != 0);
}

extern "C" __global__ void __launch_bounds__(128)
apa_prep_kv16(const uint16_t* k, const uint16_t* v, uint16_t* kimg, uint16_t* vimg, int n, int H, int Hkv, int S,
              int q_offset) {
    const Geom g(n, H, Hkv, S, q_offset);
    prep_kv16(k, v, kimg, vimg, g);
}

extern "C" __global__ void __launch_bounds__(128)
apa_prep_q(const uint16_t* q, const float* kmean, const float* scales, uint16_t* qhat, float* cq, float* sh, int n,
           int H, int Hkv, int S, int q_offset, float qmul, int q_mode, int q_terms, int lsq) {
    const Geom g(n, H, Hkv, S, q_offset);
    prep_q(q, kmean, scales, qhat, cq, sh, g, qmul, q_mode, q_terms, lsq != 0);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
apa_pass1(const uint16_t* qhat, const float* cq, const uint16_t* khat, const uint16_t* vhat, const float* scales,
          float* part, float* ml, uint32_t* hot, uint8_t* trace_visits, const int* visit_base, int n, int H,
          int Hkv, int S, int q_offset, float eps, float delta, float tau, float A, float L, float Kf,
          int ascending, int pow2, int interleaved, int quant_p) {
    APA_DYNAMIC_SMEM(smem);
    const Geom g(n, H, Hkv, S, q_offset);
    Pass1Args a;
    a.qhat = qhat; a.cq = cq; a.khat = khat; a.vhat = vhat; a.scales = scales;
    a.part = part; a.ml = ml; a.hot = hot; a.trace_visits = trace_visits; a.visit_base = visit_base;
    a.eps = eps; a.delta = delta; a.tau = tau; a.A = A; a.L = L; a.Kf = Kf;
    a.ascending = ascending; a.pow2 = pow2; a.interleaved = interleaved; a.quant_p = quant_p;
    pass1_cta(a, g, smem, blockIdx.z, blockIdx.y, blockIdx.x, true);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
apa_pass2(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* sh, const float* part,
          const float* ml, uint32_t* hot, uint16_t* out, uint8_t* trace_rows, const int* row_base, int n, int H,
          int Hkv, int S, int q_offset, float qmul, int all_hot) {
    APA_DYNAMIC_SMEM(smem);
    const Geom g(n, H, Hkv, S, q_offset);
    Pass2Args a;
    a.q = q; a.k = k; a.v = v; a.sh = sh; a.part = part; a.ml = ml; a.hot = hot; a.out = out;
    a.trace_rows = trace_rows; a.row_base = row_base; a.qmul = qmul; a.all_hot = all_hot;
    pass2_cta(a, g, smem, blockIdx.z, blockIdx.y, blockIdx.x, true);
}

// ---------------------------------------------------------------------------------------------
// Fused persistent launch (opt-in: apa_gpu.attention(..., schedule="fused")). One grid of
// persistent CTAs takes tickets from one counter: tickets 0 .. n1-1 are pass-1 work items, tickets
// n1 .. n1+n2-1 pass-2 + merge items of the same (b, hk, qb) in the same order. A pass-2 item
// waits on its pass-1 item's ready flag (release/acquire at gpu scope); that item holds a smaller
// ticket, so it was taken by a CTA that is already running and never waits itself: no deadlock,
// whatever the number of resident CTAs. Scheduling changes no arithmetic (numerics.md §6.2).
// counters[0] (the ticket) and flags[] are zeroed by the host before every launch.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void item_coords(int item, const Geom& g, int B, int& b, int& hk, int& qb) {
    // Heaviest items first: the last query block of every (b, hk) has the most tiles.
    const int nbh = B * g.Hkv;
    const int nqb = (g.nw + WARPS - 1) / WARPS;
    qb = nqb - 1 - item / nbh;
    const int bh = item % nbh;
    b = bh / g.Hkv;
    hk = bh % g.Hkv;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
apa_fused(const uint16_t* qhat, const float* cq, const uint16_t* khat, const uint16_t* vhat, const float* scales,
          float* part, float* ml, uint32_t* hot, uint8_t* trace_visits, const int* visit_base,
          const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* sh, uint16_t* out,
          uint8_t* trace_rows, const int* row_base, unsigned int* counters, unsigned int* flags, int B, int n,
          int H, int Hkv, int S, int q_offset, float eps, float delta, float tau, float A, float L, float Kf,
          int ascending, int pow2, int interleaved, int quant_p, float qmul, int all_hot) {
    APA_DYNAMIC_SMEM(smem);
    __shared__ int ticket_s;
    const Geom g(n, H, Hkv, S, q_offset);
    Pass1Args a1;
    a1.qhat = qhat; a1.cq = cq; a1.khat = khat; a1.vhat = vhat; a1.scales = scales;
    a1.part = part; a1.ml = ml; a1.hot = hot; a1.trace_visits = trace_visits; a1.visit_base = visit_base;
    a1.eps = eps; a1.delta = delta; a1.tau = tau; a1.A = A; a1.L = L; a1.Kf = Kf;
    a1.ascending = ascending; a1.pow2 = pow2; a1.interleaved = interleaved; a1.quant_p = quant_p;
    Pass2Args a2;
    a2.q = q; a2.k = k; a2.v = v; a2.sh = sh; a2.part = part; a2.ml = ml; a2.hot = hot; a2.out = out;
    a2.trace_rows = trace_rows; a2.row_base = row_base; a2.qmul = qmul; a2.all_hot = all_hot;
    const int items = B * g.Hkv * ((g.nw + WARPS - 1) / WARPS);
    const int n1 = all_hot ? 0 : items;
    for (bool fresh = true;; fresh = false) {
        __syncthreads();  // every thread has read the previous ticket; smem is free
        if (threadIdx.x == 0) ticket_s = (int)atomicAdd(&counters[0], 1u);
        __syncthreads();
        const int ticket = ticket_s;
        if (ticket >= n1 + items) break;
        int b, hk, qb;
        if (ticket < n1) {
            item_coords(ticket, g, B, b, hk, qb);
            pass1_cta(a1, g, smem, b, hk, qb, fresh);
            __syncthreads();  // all of the item's global writes are done
            if (threadIdx.x == 0) {
                __threadfence();
                flag_release(flags + ticket);
            }
        } else {
            const int item = ticket - n1;
            item_coords(item, g, B, b, hk, qb);
            if (n1 && threadIdx.x == 0) {
                unsigned int f = 0;
                for (;;) {
                    f = flag_acquire(flags + item);
                    if (f) break;
                    __nanosleep(256);
                }
            }
            __syncthreads();  // the acquire above orders the pass-1 item's writes before every thread's reads
            pass2_cta(a2, g, smem, b, hk, qb, fresh);
        }
    }
}

// Layout constants the host reads back (apa_gpu/launch.py) instead of recomputing them:
// dynamic shared memory of pass 1, of pass 2 without its hot-mask words and those words per
// mask word W (merge.cuh), and the trace record sizes (checked against apa_emu.trace's dtypes).
extern "C" __device__ const int apa_layout[5] = {P1_SMEM_BYTES, P2_SMEM_BYTES, P2_SMEM_WORDS, VISIT_BYTES,
                                                 ROW_BYTES};
