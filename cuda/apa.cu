// apa.cu: kernel entry points of the APA attention (docs/numerics.md), one cubin per build variant.
//
// Build variants (-D, see apa_gpu/build.py): APA_D (64 | 128 | 256), APA_TRACE (0 | 1), APA_P2_F32
// (pass-2 output accumulation, §8.5), APA_P2_S32 (pass-2 score accumulation, §8.1), APA_EXP2_FAST (§2).
// Everything else is a run-time parameter.
//
// Launch sequence (apa_gpu/plan.py), all on one stream:
//   apa_prep_stats -> apa_prep_finalize -> apa_prep_q, apa_prep_k, apa_prep_v (the images, the
//   certificate's per-head maxima and the per-tile sums of the estimate's means) -> apa_prep_means
//   -> apa_pass1 (skipped when ε < 0) -> apa_pass2 (pass 2 and the merge, reading K and V as given),
// or the prep kernels, then apa_fused; or, bounded (§6.7), the statistics and apa_prep_q, then per
// segment of tiles apa_prep_k and _v into the same images and apa_pass1_segment over it, then
// apa_prep_means and apa_pass2. Under the budget hot test (§7.7) the pass-1 entries are
// apa_pass1_budget, apa_pass1_segment_budget and apa_fused_budget. Each kernel takes one parameter struct (params.cuh), which
// holds the call's sizes; batch is grid z, except in the persistent apa_fused.
#include "common.cuh"
#include "params.cuh"
#include "prep.cuh"
#include "pass1_cta.cuh"
#include "pass2.cuh"

using namespace apa;

// The six prep kernels share one struct: each reads the fields of its own step (§5). q_mode ..
// fma are apa_emu.constants.PrepFlags, by the same names.
#define APA_FIELDS_PrepParams(X)                                                                                 \
    X(GeomSizes, sz)                                                                                             \
    X(const uint16_t*, q)        /* [B, n, H, D] f16 */                                                          \
    X(const uint16_t*, k)        /* [B, S, Hkv, D] f16, or a page pool [pages, page_size, Hkv, D] (§5.0) */      \
    X(const uint16_t*, v)                                                                                        \
    X(KvPages, pages)            /* table null: contiguous */                                                    \
    X(unsigned long long*, ksum) /* zeroed by the host */                                                        \
    X(unsigned int*, amax)       /* zeroed by the host */                                                        \
    X(float*, kmean)                                                                                             \
    X(float*, scales)                                                                                            \
    X(uint16_t*, qhat)                                                                                           \
    X(float*, cq)                                                                                                \
    X(float*, sh)                                                                                                \
    X(float*, qstat)                                                                                             \
    X(unsigned int*, kvstat)     /* zeroed by the host */                                                        \
    X(unsigned long long*, kvsum) /* [B, Hkv, ntkv_buf, KV_SUMS]: §5.7's sums per tile */                         \
    X(uint16_t*, khat)                                                                                           \
    X(uint16_t*, vhat)                                                                                           \
    X(uint16_t*, nu)             /* §5.8, output hot test only (else null) */                                    \
    X(float, qmul)                                                                                               \
    X(int, q_mode)               /* prep_q: 0 = NVFP4, 1 = FP8 E4M3, 2 = quantization off */                     \
    X(int, q_terms)                                                                                              \
    X(int, quant_k)                                                                                              \
    X(int, quant_v)                                                                                              \
    X(int, lsq)                                                                                                  \
    X(int, interleaved)                                                                                          \
    X(int, v_f16)                /* §5.5: V ⊗ (1/vg) rounded to FP16 before quant16 */                           \
    X(int, p2_lanes)             /* §5.3: the pass-2 row shift in the seed's four lane sums (config p2_shift) */ \
    X(int, pad_vote)             /* §6.2: padding rows get row R − 1's Q̂ and c_q, to vote with */               \
    X(int, fma)                  /* §1.8: those lanes' channel pairs fused */                                    \
    X(TileSpan, span)            /* the tiles prep_k, _v, _cert form, and where (a KV state's are held, §5.9) */
struct PrepParams {
    APA_FIELDS_PrepParams(APA_MEMBER)
};

// A prep step that reads K or V, instantiated for the layout (prep.cuh kv_row): one uniform branch.
#define APA_BY_LAYOUT(step, ...) \
    do {                                       \
        if (p.pages.table)                     \
            step<true>(__VA_ARGS__);           \
        else                                   \
            step<false>(__VA_ARGS__);          \
    } while (0)

#define APA_FIELDS_Pass1Params(X) X(GeomSizes, sz) X(Pass1Args, pass1)
struct Pass1Params {
    APA_FIELDS_Pass1Params(APA_MEMBER)
};

#define APA_FIELDS_Pass2Params(X) X(GeomSizes, sz) X(Pass2Args, pass2)
struct Pass2Params {
    APA_FIELDS_Pass2Params(APA_MEMBER)
};

// Pass 1 and pass 2 share part, ml and hot: the host points both at the same buffers.
#define APA_FIELDS_FusedParams(X)                                                                     \
    X(GeomSizes, sz)                                                                                  \
    X(int, B)                                                                                         \
    X(unsigned int*, counters) /* [0]: the ticket; zeroed by the host before every launch */          \
    X(unsigned int*, flags)    /* ready flag per work item; zeroed by the host before every launch */ \
    X(Pass1Args, pass1)                                                                               \
    X(Pass2Args, pass2)
struct FusedParams {
    APA_FIELDS_FusedParams(APA_MEMBER)
};

extern "C" __global__ void __launch_bounds__(STATS_THREADS) apa_prep_stats(const __grid_constant__ PrepParams p) {
    __shared__ long long red[STATS_THREADS * 8], rows[KEYS_PER_CHUNK];  // once, not per layout instantiation
    APA_BY_LAYOUT(prep_stats, red, rows, p.k, p.v, p.ksum, p.amax, p.pages, Geom(p.sz, blockIdx.z));
}

extern "C" __global__ void __launch_bounds__(D) apa_prep_finalize(const __grid_constant__ PrepParams p) {
    prep_finalize(p.ksum, p.amax, p.kmean, p.scales, Geom(p.sz, blockIdx.y));
}

extern "C" __global__ void __launch_bounds__(K_THREADS) apa_prep_k(const __grid_constant__ PrepParams p) {
    APA_BY_LAYOUT(prep_k, p.k, p.kmean, p.scales, p.khat, p.kvstat, p.kvsum, p.pages, Geom(p.sz, blockIdx.z), p.span,
                  p.quant_k != 0, p.lsq != 0, p.interleaved != 0);
}

extern "C" __global__ void __launch_bounds__(V_THREADS) apa_prep_v(const __grid_constant__ PrepParams p) {
    APA_DYNAMIC_SMEM(smem);
    APA_BY_LAYOUT(prep_v, smem, p.v, p.scales, p.vhat, p.kvstat, p.kvsum, p.nu, p.pages, Geom(p.sz, blockIdx.z), p.span,
                  p.quant_v != 0, p.lsq != 0, p.interleaved != 0, p.v_f16 != 0);
}

extern "C" __global__ void __launch_bounds__(MEAN_THREADS) apa_prep_means(const __grid_constant__ PrepParams p) {
    prep_means(p.kvsum, p.scales, p.kvstat, Geom(p.sz, blockIdx.y));
}

extern "C" __global__ void __launch_bounds__(128) apa_prep_q(const __grid_constant__ PrepParams p) {
    prep_q(p.q, p.kmean, p.scales, p.qhat, p.cq, p.sh, p.qstat, Geom(p.sz, blockIdx.z), p.qmul, p.q_mode, p.q_terms, p.lsq != 0,
           p.p2_lanes != 0, p.fma != 0, p.pad_vote != 0);
}

// Pass 1 per hot test kind (pass1_cta's BUDGET): apa_pass1 for the mass and output tests, apa_pass1_budget
// for the budget test (§7.7). _segment: over one segment of tiles (the bounded schedule, §6.7), the CTA's
// steps whose tiles lie in p.pass1.span, resumed from and ended with the carried state unless they are
// its first and last.
#define APA_PASS1_ENTRY(name, SEGMENT, BUDGET)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) name(const __grid_constant__ Pass1Params p) {     \
        APA_DYNAMIC_SMEM(smem);                                                                                \
        const Geom g(p.sz, blockIdx.z);                                                                        \
        if (g.has_cta(blockIdx.x))                                                                             \
            pass1_cta<SEGMENT, BUDGET>(p.pass1, g, smem, blockIdx.z, blockIdx.y, blockIdx.x, true);            \
    }
APA_PASS1_ENTRY(apa_pass1, false, false)
APA_PASS1_ENTRY(apa_pass1_budget, false, true)
APA_PASS1_ENTRY(apa_pass1_segment, true, false)
APA_PASS1_ENTRY(apa_pass1_segment_budget, true, true)

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

// The persistent launch's loop; BUDGET: pass 1's hot test kind, as apa_pass1's.
template <bool BUDGET>
__device__ __forceinline__ void fused(const FusedParams& p, uint16_t* smem) {
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
            if (real) pass1_cta<false, BUDGET>(p.pass1, g, smem, b, hk, qb, fresh);
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

extern "C" __global__ void __launch_bounds__(THREADS, 1) apa_fused(const __grid_constant__ FusedParams p) {
    APA_DYNAMIC_SMEM(smem);
    fused<false>(p, smem);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) apa_fused_budget(const __grid_constant__ FusedParams p) {
    APA_DYNAMIC_SMEM(smem);
    fused<true>(p, smem);
}

// Constants the host reads back (apa_gpu/device.py Layout) instead of repeating them: the CTA's
// warps and the tile (§6.2, §6.3), the prep-statistics block and its keys per chunk, the dynamic
// shared memory of pass 1, of pass 2 without its hot-mask words and those words per mask word W,
// the trace record sizes (checked against apa_emu.trace's dtypes), the blocks of apa_prep_k and
// apa_prep_v and the latter's dynamic shared memory, pass 1's carried row state, and
// the bytes of a tensor map (checked against apa_gpu/device.py's); the per-tile sums of the means and
// their block, and pass 1's export per row besides part.
APA_EXPORT_INTS(apa_layout, WARPS, TILE, STATS_THREADS, KEYS_PER_CHUNK, P1_SMEM_BYTES, P2_SMEM_BYTES,
                P2_SMEM_WORDS, VISIT_BYTES, ROW_BYTES, KV_STATS, K_THREADS, V_THREADS, V_SMEM, P1_CARRY,
                TENSOR_MAP_BYTES, KV_SUMS, MEAN_THREADS, P1_ML);

// Every parameter struct's layout (params.cuh), which apa_gpu/device.py checks before a launch.
APA_PARAMS_EXPORT(GeomSizes)
APA_PARAMS_EXPORT(KvPages)
APA_PARAMS_EXPORT(TileSpan)
APA_PARAMS_EXPORT(PrepParams)
APA_PARAMS_EXPORT(Pass1Args)
APA_PARAMS_EXPORT(CertConsts)
APA_PARAMS_EXPORT(EstConsts)
APA_PARAMS_EXPORT(Pass2Args)
APA_PARAMS_EXPORT(Pass1Params)
APA_PARAMS_EXPORT(Pass2Params)
APA_PARAMS_EXPORT(FusedParams)
