// common.cuh: geometry of the APA kernels (docs/numerics.md §6) and shared constants.
#pragma once

#include <stdint.h>
#include "fpmath.cuh"
#include "params.cuh"

#ifndef APA_D
#error "APA_D (head dim, 64, 128 or 256) must be defined by the build"
#endif
#if APA_D != 64 && APA_D != 128 && APA_D != 256
#error "APA_D must be 64, 128 or 256"
#endif
#ifndef APA_TRACE
#define APA_TRACE 0
#endif
#ifndef APA_P2_F32
#define APA_P2_F32 0
#endif
#ifndef APA_P2_S32
#define APA_P2_S32 0
#endif

// The kernels' dynamic shared memory (the simulator hands out a per-CTA host buffer instead).
#ifdef APA_SIM
#define APA_DYNAMIC_SMEM(name) uint16_t* name = reinterpret_cast<uint16_t*>(::apa_sim::dynamic_smem())
#else
#define APA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint16_t name[]
#endif

namespace apa {

constexpr int D = APA_D;
constexpr int TILE = 64;              // keys per tile (§6.3)
// Warps per CTA (§6.2; no arithmetic depends on it). At D = 256 one warpgroup, so that a thread may
// keep pass 1's o of its row pair, 128 binary32, in registers.
constexpr int WARPS = D == 256 ? 4 : 12;
constexpr int ROWS_PER_CTA = 16 * WARPS;
constexpr int THREADS = 32 * WARPS;
constexpr uint32_t ONES_H2 = 0x3C003C00u;  // two binary16 ones
constexpr int KV_STATS = 9;  // per-head statistics kn, ek, k2n, vn, ev (maxima), km, ekm, vm, evm (means) (§5.7)
constexpr int KV_SUMS = 4;   // per tile: the means' integer sums of km, ekm, vm ⊘ vg, evm ⊘ vg (§5.7)
constexpr int P1_ML = 4;     // pass 1's export per row besides part: m1, l1, ad1, ws1 (§7.10)

// The basic sizes of one call, as every kernel's parameter struct carries them (apa.cu).
// A varlen batch (§6.6): sequence b has rows cu_q[b] .. cu_q[b+1]-1 of q and keys cu_k[b] ..
// cu_k[b+1]-1 of k and v; n and S are then the longest sequence's, which size the per-(b, hk)
// buffers. cu_q and cu_k null: every batch entry has n rows and S keys.
#define APA_FIELDS_GeomSizes(X)                                                                            \
    X(int, n)                                                                                              \
    X(int, H)                                                                                              \
    X(int, Hkv)                                                                                            \
    X(int, S)                                                                                              \
    X(int, q_offset)                                                                                       \
    X(int, window)      /* sliding window of W keys (§6.1); 0: full causal */                              \
    X(int, S_buf)       /* keys the per-(b, hk) K and V images have room for (a KV state's, §5.9); 0: S */ \
    X(const int*, cu_q) /* varlen: [B + 1] first rows of q */                                              \
    X(const int*, cu_k) /* varlen: [B + 1] first keys of k and v */
struct GeomSizes {
    APA_FIELDS_GeomSizes(APA_MEMBER)
};

// Runtime geometry of batch entry b of one call (numerics.md §6.1-6.3, §6.6), derived from the
// basic sizes.
struct Geom {
    int n, H, Hkv, G, S, q_offset, window;
    int R;      // packed rows per (b, hk): n * G
    int nw;     // warps per (b, hk): ceil(R / 16)
    int Rp;     // padded rows: 16 * nw
    int ntkv;   // tiles: ceil(S / 64)
    int W;      // hot-mask words per warp: ceil(ntkv / 32)
    long long q0, k0;  // entry b's first row of q, out and bound, and first key of k and v
    // The strides of the per-(b, hk) buffers (prep images, part, ml, hot, trace bases): the sizes
    // of GeomSizes' n and S (or S_buf), which differ from the entry's own in a varlen batch or under a
    // KV state only.
    int Rp_buf, ntkv_buf, nw_buf, W_buf;

    __device__ __forceinline__ Geom(const GeomSizes& s, int b)
        : H(s.H), Hkv(s.Hkv), G(s.H / s.Hkv), window(s.window) {
        nw_buf = (s.n * G + 15) / 16;
        Rp_buf = 16 * nw_buf;
        ntkv_buf = ((s.S_buf ? s.S_buf : s.S) + TILE - 1) / TILE;
        W_buf = (ntkv_buf + 31) / 32;
        if (s.cu_q) {  // §6.6: bottom-right causal within the sequence
            q0 = s.cu_q[b];
            k0 = s.cu_k[b];
            n = s.cu_q[b + 1] - s.cu_q[b];
            S = s.cu_k[b + 1] - s.cu_k[b];
            q_offset = S - n;
        } else {
            n = s.n;
            S = s.S;
            q_offset = s.q_offset;
            q0 = (long long)b * n;
            k0 = (long long)b * S;
        }
        R = n * G;
        nw = (R + 15) / 16;
        Rp = 16 * nw;
        ntkv = (S + TILE - 1) / TILE;
        W = (ntkv + 31) / 32;
    }
    // Whether CTA qb (WARPS warps) has a warp of this entry: a shorter varlen sequence has fewer.
    __device__ __forceinline__ bool has_cta(int qb) const { return qb * WARPS < nw; }
    // Key limit of packed row r (§6.1): min(q_offset + r div G, S - 1). 64-bit safe.
    __device__ __forceinline__ int lim(int r) const {
        long long p = (long long)q_offset + r / G;
        return p < (long long)(S - 1) ? (int)p : S - 1;
    }
    // First visible key of packed row r (§6.1): max(0, p - W + 1) with a window, else 0. 64-bit safe.
    __device__ __forceinline__ int lo(int r) const {
        if (window == 0) return 0;
        const long long p = (long long)q_offset + r / G - window + 1;
        return p > 0 ? (int)p : 0;
    }
    // First active tile F_w of warp w (§6.3): its first row's first key, in tiles.
    __device__ __forceinline__ int first_tile(int w) const { return lo(16 * w) / TILE; }
    // Last active tile T_w of warp w (§6.3): min(p_wmax div 64, ntkv - 1).
    __device__ __forceinline__ int last_tile(int w) const {
        int rmax = min(16 * w + 15, R - 1);
        long long p = (long long)q_offset + rmax / G;
        long long t = p / TILE;
        return t < (long long)(ntkv - 1) ? (int)t : ntkv - 1;
    }
};

// §5.0 paged KV: K and V are page pools [pages, page_size, Hkv, D] read through a block table;
// table null: the contiguous [B, S, Hkv, D] layout.
#define APA_FIELDS_KvPages(X)                              \
    X(const int*, table) /* [B, max_pages], -1 = a hole */ \
    X(int, page_size)                                      \
    X(int, max_pages)
struct KvPages {
    APA_FIELDS_KvPages(APA_MEMBER)
};

// The element offset of the row (b, key s, hk) in K or V, or -1 for a hole, which reads as zeros. The
// steps that read K or V are instantiated for PAGED (p.table set) and not: the contiguous
// layout keeps its plain strided loads, without a table lookup or a hole test.
template <bool PAGED>
__device__ __forceinline__ long long kv_row(const KvPages& p, const Geom& g, int b, int s, int hk) {
    if constexpr (!PAGED) return ((g.k0 + s) * g.Hkv + hk) * D;
    const int page = p.table[(size_t)b * p.max_pages + s / p.page_size];
    return page < 0 ? -1 : (((long long)page * p.page_size + s % p.page_size) * g.Hkv + hk) * D;
}

// The per-(b, hk) key images prep forms for pass 1 (prep.cuh), and the tiles one launch forms or
// visits (§6.7). The images hold tiles 0 .. sink-1 at slots 0 .. sink-1, then tile first + j at
// slot sink + j, stride slots per (b, hk). One pass over all tiles: sink = first = 0, slot = tile.
// The bounded schedule: sink = 1 (tile 0), and one segment of tiles after it at a time.
#define APA_FIELDS_TileSpan(X)                     \
    X(int, lo) /* the launch's tiles lo .. hi-1 */ \
    X(int, hi)                                     \
    X(int, sink)                                   \
    X(int, first)                                  \
    X(int, stride)
struct TileSpan {
    APA_FIELDS_TileSpan(APA_MEMBER)
    __device__ __forceinline__ long long slot(int t) const { return t < sink ? t : sink + t - first; }
};

// The rows of the calling warp in CTA qb of one (b, hk) (numerics.md §6.2–6.3), in the m16n8k16
// fragment layout: lane = 4 g + t0 holds rows row0 + g ("lo") and row0 + g + 8 ("hi"). Padding rows
// (≥ R) are invalid; their key limit is the last real row's, which the validity masks make moot.
struct WarpRows {
    int lane, wl, g, t0, w, row0;
    bool warp_active;
    int r_lo, r_hi;
    bool v_lo, v_hi;
    bool run_lo, run_hi;  // rows that vote in pass 1: the real ones, every row under pad_vote (§6.2)
    int lim_lo, lim_hi;
    int lo_lo, lo_hi;  // first visible keys (§6.1)
    int Fw, Tw;  // the warp's first and last active tiles; Tw = -1 for a warp past the rows
    int wlast;   // the CTA's last real warp
    int Fmin;    // the CTA's first active tile (its first warp's)
    int Tmax;    // the CTA's last active tile
    int steps;   // the CTA's visiting order has Tmax - Fmin + 1 steps (§6.4)
};

__device__ __forceinline__ WarpRows warp_rows(const Geom& geo, int qb) {
    WarpRows x;
    x.lane = threadIdx.x & 31;
    x.wl = threadIdx.x >> 5;
    x.g = x.lane >> 2;
    x.t0 = x.lane & 3;
    x.w = qb * WARPS + x.wl;
    x.row0 = 16 * x.w;
    x.warp_active = x.row0 < geo.R;
    x.r_lo = x.row0 + x.g;
    x.r_hi = x.row0 + x.g + 8;
    x.v_lo = x.r_lo < geo.R;
    x.v_hi = x.r_hi < geo.R;
    x.run_lo = x.v_lo, x.run_hi = x.v_hi;
    x.lim_lo = geo.lim(x.v_lo ? x.r_lo : geo.R - 1);
    x.lim_hi = geo.lim(x.v_hi ? x.r_hi : geo.R - 1);
    x.lo_lo = geo.lo(x.v_lo ? x.r_lo : geo.R - 1);
    x.lo_hi = geo.lo(x.v_hi ? x.r_hi : geo.R - 1);
    x.Fw = x.warp_active ? geo.first_tile(x.w) : 0;
    x.Tw = x.warp_active ? geo.last_tile(x.w) : -1;
    x.wlast = min(qb * WARPS + WARPS - 1, geo.nw - 1);
    x.Fmin = geo.first_tile(qb * WARPS);
    x.Tmax = geo.last_tile(x.wlast);
    x.steps = x.Tmax - x.Fmin + 1;
    return x;
}

// The tile of step i of the CTA's visiting order (§6.4) over tiles F .. Tmax: diagonal (tile 0 first
// when F = 0, then Tmax, Tmax - 1, ... down to max(F, 1)) or ascending (F .. Tmax). A warp skips the
// steps outside its own F_w .. T_w, which leaves it exactly its own order: the CTA's first warp has
// the smallest F.
__device__ __forceinline__ int visit_tile(int i, int F, int Tmax, bool ascending) {
    if (ascending) return F + i;
    if (F == 0) return i == 0 ? 0 : Tmax + 1 - i;
    return Tmax - i;
}

// The CTA's steps i0 .. i1-1 of the visiting order over F .. Tmax (visit_tile) whose tiles lie in
// lo .. hi-1: a contiguous run, since the order is monotone after its first step. The diagonal
// order's step 0 (tile 0, when F = 0) comes first, so it belongs to the run that holds Tmax (§6.7).
__device__ __forceinline__ void step_range(int F, int Tmax, bool ascending, int lo, int hi, int& i0, int& i1) {
    const int first = ascending || F > 0 ? F : 1;  // the monotone part's lowest tile
    const int a = max(lo, first), b = min(hi, Tmax + 1);
    i0 = i1 = 0;
    if (ascending) {
        if (a < b) i0 = a - F, i1 = b - F;
        return;
    }
    const int top = F > 0 ? Tmax : Tmax + 1;  // step of tile t: top - t
    if (a < b) i0 = top - (b - 1), i1 = top - a + 1;
    if (F == 0 && lo <= Tmax && Tmax < hi) i0 = 0, i1 = max(i1, 1);
}

// Key of slot j (0..63) within a tile under the P grouping (numerics.md §7.3). Pass-1 tiles are
// stored in slot order, so P group g is slots 16g..16g+15 for both groupings.
//   consecutive: slot j is key j.
//   interleaved: group g = j >> 4, i = j & 15 (keys of the group in increasing order):
//                key = 32 (g >> 1) + 8 (i >> 2) + 4 (g & 1) + (i & 3),
//                which satisfies g(key) = 2 (key div 32) + ((key div 4) mod 2) = g.
__device__ __forceinline__ int slot_key(int j, bool interleaved) {
    if (!interleaved) return j;
    const int g = j >> 4, i = j & 15;
    return 32 * (g >> 1) + 8 * (i >> 2) + 4 * (g & 1) + (i & 3);
}

}  // namespace apa
