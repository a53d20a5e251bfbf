// apa.cu: kernel entry points of the APA attention (docs/numerics.md), one cubin per build variant.
//
// Build variants (-D, see apa_gpu/build.py): APA_D (64 | 128 | 256), APA_TRACE (0 | 1), APA_P2_F32
// (pass-2 output accumulation, §8.5), APA_EXP2_FAST (§2). Everything else is a run-time parameter.
//
// Launch sequence (apa_gpu/plan.py), all on one stream:
//   apa_prep_stats -> apa_prep_finalize -> apa_prep_q, apa_prep_k, apa_prep_v (the images and the
//   certificate's per-head maxima)
//   -> apa_pass1 (skipped when ε < 0) -> apa_pass2 (pass 2 and the merge, reading K and V as given),
// or the prep kernels, then apa_fused; or, bounded (§6.7), the statistics and apa_prep_q, then per
// segment of tiles apa_prep_k and _v into the same images and apa_pass1_segment over it, then
// apa_pass2. Each kernel takes one parameter struct (params.cuh), which
// holds the call's sizes; batch is grid z, except in the persistent apa_fused.
#include "common.cuh"
#include "params.cuh"
#include "prep.cuh"
#include "pass1.cuh"
#include "pass2.cuh"

using namespace apa;

// The six prep kernels share one struct: each reads the fields of its own step (§5).
struct PrepParams {
    GeomSizes sz;
    const uint16_t* q;          // [B, n, H, D] f16
    const uint16_t* k;          // [B, S, Hkv, D] f16, or a page pool [pages, page_size, Hkv, D] (§5.0)
    const uint16_t* v;
    KvPages pages;              // table null: contiguous
    unsigned long long* ksum;   // zeroed by the host
    unsigned int* amax;         // zeroed by the host
    float* kmean;
    float* scales;
    uint16_t* qhat;
    float* cq;
    float* sh;
    float* qstat;
    unsigned int* kvstat;       // zeroed by the host
    uint16_t* khat;
    uint16_t* vhat;
    uint16_t* nu;               // §5.8, output hot test only (else null)
    float qmul;
    int q_mode;                 // prep_q: 0 = NVFP4, 1 = FP8 E4M3, 2 = quantization off
    int q_terms;
    int quant_k;
    int quant_v;
    int lsq;
    int interleaved;
    int v_f16;                  // §5.5: V ⊗ (1/vg) rounded to FP16 before quant16
    int p2_lanes;               // §5.3: the pass-2 row shift in the seed's four lane sums (config p2_shift)
    int pad_vote;               // §6.2: padding rows get row R − 1's Q̂ and c_q, to vote with
    int fma;                    // §1.8: those lanes' channel pairs fused
    TileSpan span;              // the tiles prep_k, _v, _cert form, and where (a KV state's are held, §5.9)
};

// A prep step that reads K or V, instantiated for the layout (prep.cuh kv_row): one uniform branch.
#define APA_BY_LAYOUT(step, ...) \
    do {                                       \
        if (p.pages.table)                     \
            step<true>(__VA_ARGS__);           \
        else                                   \
            step<false>(__VA_ARGS__);          \
    } while (0)

struct Pass1Params {
    GeomSizes sz;
    Pass1Args pass1;
};

struct Pass2Params {
    GeomSizes sz;
    Pass2Args pass2;
};

// Pass 1 and pass 2 share part, ml and hot: the host points both at the same buffers.
struct FusedParams {
    GeomSizes sz;
    int B;
    unsigned int* counters;  // [0]: the ticket; zeroed by the host before every launch
    unsigned int* flags;     // ready flag per work item; zeroed by the host before every launch
    Pass1Args pass1;
    Pass2Args pass2;
};

extern "C" __global__ void __launch_bounds__(STATS_THREADS) apa_prep_stats(const __grid_constant__ PrepParams p) {
    __shared__ long long red[STATS_THREADS * 8], rows[KEYS_PER_CHUNK];  // once, not per layout instantiation
    APA_BY_LAYOUT(prep_stats, red, rows, p.k, p.v, p.ksum, p.amax, p.pages, Geom(p.sz, blockIdx.z));
}

extern "C" __global__ void __launch_bounds__(D) apa_prep_finalize(const __grid_constant__ PrepParams p) {
    prep_finalize(p.ksum, p.amax, p.kmean, p.scales, Geom(p.sz, blockIdx.y));
}

extern "C" __global__ void __launch_bounds__(K_THREADS) apa_prep_k(const __grid_constant__ PrepParams p) {
    APA_BY_LAYOUT(prep_k, p.k, p.kmean, p.scales, p.khat, p.kvstat, p.pages, Geom(p.sz, blockIdx.z), p.span,
                  p.quant_k != 0, p.lsq != 0, p.interleaved != 0);
}

extern "C" __global__ void __launch_bounds__(V_THREADS) apa_prep_v(const __grid_constant__ PrepParams p) {
    APA_DYNAMIC_SMEM(smem);
    APA_BY_LAYOUT(prep_v, smem, p.v, p.scales, p.vhat, p.kvstat, p.nu, p.pages, Geom(p.sz, blockIdx.z), p.span,
                  p.quant_v != 0, p.lsq != 0, p.interleaved != 0, p.v_f16 != 0);
}

extern "C" __global__ void __launch_bounds__(128) apa_prep_q(const __grid_constant__ PrepParams p) {
    prep_q(p.q, p.kmean, p.scales, p.qhat, p.cq, p.sh, p.qstat, Geom(p.sz, blockIdx.z), p.qmul, p.q_mode, p.q_terms, p.lsq != 0,
           p.p2_lanes != 0, p.fma != 0, p.pad_vote != 0);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) apa_pass1(const __grid_constant__ Pass1Params p) {
    APA_DYNAMIC_SMEM(smem);
    const Geom g(p.sz, blockIdx.z);
    if (g.has_cta(blockIdx.x)) pass1_cta<false>(p.pass1, g, smem, blockIdx.z, blockIdx.y, blockIdx.x, true);
}

// Pass 1 over one segment of tiles (the bounded schedule, §6.7): the CTA's steps whose tiles lie in
// p.pass1.span, resumed from and ended with the carried state unless they are its first and last.
extern "C" __global__ void __launch_bounds__(THREADS, 1) apa_pass1_segment(const __grid_constant__ Pass1Params p) {
    APA_DYNAMIC_SMEM(smem);
    const Geom g(p.sz, blockIdx.z);
    if (g.has_cta(blockIdx.x)) pass1_cta<true>(p.pass1, g, smem, blockIdx.z, blockIdx.y, blockIdx.x, true);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) apa_pass2(const __grid_constant__ Pass2Params p) {
    APA_DYNAMIC_SMEM(smem);
    const Geom g(p.sz, blockIdx.z);
    if (g.has_cta(blockIdx.x)) pass2_cta(p.pass2, g, smem, blockIdx.z, blockIdx.y, blockIdx.x, true);
}

// ---------------------------------------------------------------------------------------------
// Fused persistent launch (opt-in: apa_gpu.attention(..., schedule="fused")). One grid of
// persistent CTAs takes tickets from one counter: tickets 0 .. n1-1 are pass-1 work items, tickets
// n1 .. n1+n2-1 pass-2 + merge items of the same (b, hk, qb) in the same order. A pass-2 item
// waits on its pass-1 item's ready flag (release/acquire at gpu scope); that item holds a smaller
// ticket, so it was taken by a CTA that is already running and never waits itself: no deadlock,
// whatever the number of resident CTAs. Scheduling changes no arithmetic (numerics.md §6.2).
// ---------------------------------------------------------------------------------------------
// Query blocks (CTAs) per (b, hk); in a varlen batch the longest sequence's, and a shorter one's
// extra items are empty.
__device__ __forceinline__ int query_blocks(const GeomSizes& sz) {
    return ((sz.n * (sz.H / sz.Hkv) + 15) / 16 + WARPS - 1) / WARPS;
}

__device__ __forceinline__ void item_coords(int item, const GeomSizes& sz, int B, int& b, int& hk, int& qb) {
    // Heaviest items first: the last query block of every (b, hk) has the most tiles.
    const int nbh = B * sz.Hkv;
    qb = query_blocks(sz) - 1 - item / nbh;
    const int bh = item % nbh;
    b = bh / sz.Hkv;
    hk = bh % sz.Hkv;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) apa_fused(const __grid_constant__ FusedParams p) {
    APA_DYNAMIC_SMEM(smem);
    __shared__ int ticket_s;
    unsigned int* const flags = p.flags;  // held in a register across the items: ptxas then spills less
    const int items = p.B * p.sz.Hkv * query_blocks(p.sz);
    const int n1 = p.pass2.all_hot ? 0 : items;
    bool fresh = true;  // no item has used the tile ring yet
    for (;;) {
        __syncthreads();  // every thread has read the previous ticket; smem is free
        if (threadIdx.x == 0) ticket_s = (int)atomicAdd(&p.counters[0], 1u);
        __syncthreads();
        const int ticket = ticket_s;
        if (ticket >= n1 + items) break;
        int b, hk, qb;
        const int item = ticket < n1 ? ticket : ticket - n1;
        item_coords(item, p.sz, p.B, b, hk, qb);
        const Geom g(p.sz, b);
        const bool real = g.has_cta(qb);
        if (ticket < n1) {
            if (real) pass1_cta<false>(p.pass1, g, smem, b, hk, qb, fresh);
            __syncthreads();  // all of the item's global writes are done
            if (threadIdx.x == 0) {
                __threadfence();
                flag_release(flags + ticket);
            }
        } else if (real) {
            if (n1 && threadIdx.x == 0) {
                unsigned int f = 0;
                for (;;) {
                    f = flag_acquire(flags + item);
                    if (f) break;
                    __nanosleep(256);
                }
            }
            __syncthreads();  // the acquire above orders the pass-1 item's writes before every thread's reads
            pass2_cta(p.pass2, g, smem, b, hk, qb, fresh);
        }
        fresh = fresh && !real;
    }
}

// Constants the host reads back (apa_gpu/device.py Layout) instead of repeating them: the CTA's
// warps and the tile (§6.2, §6.3), the prep-statistics block and its keys per chunk, the dynamic
// shared memory of pass 1, of pass 2 without its hot-mask words and those words per mask word W,
// the trace record sizes (checked against apa_emu.trace's dtypes), the blocks of apa_prep_k and
// apa_prep_v and the latter's dynamic shared memory, pass 1's carried row state, and
// the bytes of a tensor map (checked against apa_gpu/device.py's).
APA_EXPORT_INTS(apa_layout, WARPS, TILE, STATS_THREADS, KEYS_PER_CHUNK, P1_SMEM_BYTES, P2_SMEM_BYTES,
                P2_SMEM_WORDS, VISIT_BYTES, ROW_BYTES, KV_STATS, K_THREADS, V_THREADS, V_SMEM, P1_CARRY,
                TENSOR_MAP_BYTES);

APA_PARAMS_LAYOUT(GeomSizes, APA_FIELD(GeomSizes, n), APA_FIELD(GeomSizes, H), APA_FIELD(GeomSizes, Hkv),
                  APA_FIELD(GeomSizes, S), APA_FIELD(GeomSizes, q_offset), APA_FIELD(GeomSizes, window),
                  APA_FIELD(GeomSizes, S_buf), APA_FIELD(GeomSizes, cu_q), APA_FIELD(GeomSizes, cu_k));
APA_PARAMS_LAYOUT(KvPages, APA_FIELD(KvPages, table), APA_FIELD(KvPages, page_size),
                  APA_FIELD(KvPages, max_pages));
APA_PARAMS_LAYOUT(TileSpan, APA_FIELD(TileSpan, lo), APA_FIELD(TileSpan, hi), APA_FIELD(TileSpan, sink),
                  APA_FIELD(TileSpan, first), APA_FIELD(TileSpan, stride));
APA_PARAMS_LAYOUT(PrepParams, APA_FIELD(PrepParams, sz), APA_FIELD(PrepParams, q), APA_FIELD(PrepParams, k),
                  APA_FIELD(PrepParams, v), APA_FIELD(PrepParams, pages), APA_FIELD(PrepParams, ksum), APA_FIELD(PrepParams, amax),
                  APA_FIELD(PrepParams, kmean), APA_FIELD(PrepParams, scales), APA_FIELD(PrepParams, qhat),
                  APA_FIELD(PrepParams, cq), APA_FIELD(PrepParams, sh), APA_FIELD(PrepParams, qstat),
                  APA_FIELD(PrepParams, kvstat), APA_FIELD(PrepParams, khat),
                  APA_FIELD(PrepParams, vhat), APA_FIELD(PrepParams, nu), APA_FIELD(PrepParams, qmul), APA_FIELD(PrepParams, q_mode), APA_FIELD(PrepParams, q_terms),
                  APA_FIELD(PrepParams, quant_k), APA_FIELD(PrepParams, quant_v), APA_FIELD(PrepParams, lsq),
                  APA_FIELD(PrepParams, interleaved), APA_FIELD(PrepParams, v_f16), APA_FIELD(PrepParams, p2_lanes),
                  APA_FIELD(PrepParams, pad_vote), APA_FIELD(PrepParams, fma), APA_FIELD(PrepParams, span));
APA_PARAMS_LAYOUT(Pass1Args, APA_FIELD(Pass1Args, qhat), APA_FIELD(Pass1Args, cq), APA_FIELD(Pass1Args, khat),
                  APA_FIELD(Pass1Args, vhat), APA_FIELD(Pass1Args, scales), APA_FIELD(Pass1Args, nu),
                  APA_FIELD(Pass1Args, part),
                  APA_FIELD(Pass1Args, ml), APA_FIELD(Pass1Args, carry), APA_FIELD(Pass1Args, span),
                  APA_FIELD(Pass1Args, hot), APA_FIELD(Pass1Args, trace_visits),
                  APA_FIELD(Pass1Args, visit_base), APA_FIELD(Pass1Args, eps), APA_FIELD(Pass1Args, delta),
                  APA_FIELD(Pass1Args, tau), APA_FIELD(Pass1Args, A), APA_FIELD(Pass1Args, L),
                  APA_FIELD(Pass1Args, Kf), APA_FIELD(Pass1Args, ascending), APA_FIELD(Pass1Args, pow2),
                  APA_FIELD(Pass1Args, interleaved), APA_FIELD(Pass1Args, quant_p), APA_FIELD(Pass1Args, output),
                  APA_FIELD(Pass1Args, fma), APA_FIELD(Pass1Args, pad_vote), APA_FIELD(Pass1Args, direct));
APA_PARAMS_LAYOUT(CertConsts, APA_FIELD(CertConsts, sd), APA_FIELD(CertConsts, cs), APA_FIELD(CertConsts, c2),
                  APA_FIELD(CertConsts, fast), APA_FIELD(CertConsts, delta));
APA_PARAMS_LAYOUT(Pass2Args, APA_FIELD(Pass2Args, q), APA_FIELD(Pass2Args, k), APA_FIELD(Pass2Args, v),
                  APA_FIELD(Pass2Args, pages), APA_FIELD(Pass2Args, kv_maps),
                  APA_FIELD(Pass2Args, sh), APA_FIELD(Pass2Args, part), APA_FIELD(Pass2Args, ml),
                  APA_FIELD(Pass2Args, hot), APA_FIELD(Pass2Args, out), APA_FIELD(Pass2Args, cq),
                  APA_FIELD(Pass2Args, qstat), APA_FIELD(Pass2Args, kvstat), APA_FIELD(Pass2Args, bound),
                  APA_FIELD(Pass2Args, trace_rows), APA_FIELD(Pass2Args, row_base), APA_FIELD(Pass2Args, qmul),
                  APA_FIELD(Pass2Args, all_hot), APA_FIELD(Pass2Args, fma), APA_FIELD(Pass2Args, direct),
                  APA_FIELD(Pass2Args, cert));
APA_PARAMS_LAYOUT(Pass1Params, APA_FIELD(Pass1Params, sz), APA_FIELD(Pass1Params, pass1));
APA_PARAMS_LAYOUT(Pass2Params, APA_FIELD(Pass2Params, sz), APA_FIELD(Pass2Params, pass2));
APA_PARAMS_LAYOUT(FusedParams, APA_FIELD(FusedParams, sz), APA_FIELD(FusedParams, B),
                  APA_FIELD(FusedParams, counters), APA_FIELD(FusedParams, flags), APA_FIELD(FusedParams, pass1),
                  APA_FIELD(FusedParams, pass2));
