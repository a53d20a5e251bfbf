// prep.cuh: K mean, head scales, and the quantized pass-1 operands (docs/numerics.md §5).
//
// Layouts (all contiguous):
//   q   [B, n, H, D] f16        k, v [B, S, Hkv, D] f16          (inputs)
//   ksum [B, Hkv, D] u64 (two's complement int64 sums in units of 2^-24; zeroed by the host)
//   amax [B, Hkv, 2] u32 (float bits of max|K|, max|V|; zeroed by the host)
//   kmean [B, Hkv, D] f32; scales [B, Hkv, 2] f32 = (kg, vg)
//   qhat [B, Hkv, Rp, D] f16 (pass-1 operand Q̂), cq [B, Hkv, Rp] f32, sh [B, Hkv, Rp] f32
//   qstat [B, Hkv, Rp, 3] f32 = (qn, eq, q2n); kvstat [B, Hkv, KV_STATS] u32 = float bits of (kn, ek, k2n,
//   vn, ev) (§5.7's maxima; zeroed by the host) and (km, ekm, vm, evm) (its means, prep_means)
//   kvsum [B, Hkv, ntkv_buf, KV_SUMS] u64: per tile, the integer sums of §5.7's means (prep_k, prep_v)
//   khat, vhat [B, Hkv, stride, 64 * D] f16: K̂ and V̂ as scale-folded FP16 values (§4.5), tile t at
//   slot span.slot(t) (common.cuh TileSpan: every tile, or the bounded schedule's sink and segment), keys of a
//   tile in slot order (§7.3; common.cuh slot_key), keys >= S zero. Each tile is the wgmma operand
//   image pass 1 copies to shared memory as it is (mma.cuh sw128_half): K̂ with 64 rows (slots) of
//   D channels, V̂ᵀ with D rows (channels) of 64 slots.
#pragma once

#include "common.cuh"
#include "formats.cuh"
#include "mma.cuh"

namespace apa {

// An FP16 value as an exact integer in units of 2^-24 (numerics.md §1.4, §5.1).
__device__ __forceinline__ long long f16_units(uint16_t bits) {
    const int e = (bits >> 10) & 31, m = bits & 1023;
    const long long mag = e == 0 ? (long long)m : ((long long)(1024 + m) << (e - 1));
    return (bits & 0x8000u) ? -mag : mag;
}

// §5.7 nrm: squares summed in order, then √(ss ⊕ 2⁻¹²⁶) ⊗ (1 + 2⁻¹⁰).
__device__ __forceinline__ float nrm_add(float ss, float a) { return fadd(ss, fmul(a, a)); }
__device__ __forceinline__ float nrm_end(float ss) {
    return fmul(fsqrt(fadd(ss, f32_from_bits(0x00800000u))), f32_from_bits(0x3F802000u));
}

// The block's threads set rows[i] = kv_row of key key0 + i (−1 past S) for i < n: one table lookup
// per key and block, where prep_stats reads each key's row from D/8 threads. The caller syncs.
template <bool PAGED>
__device__ __forceinline__ void kv_rows(long long* rows, const KvPages& p, const Geom& g, int b, int hk, int key0,
                                        int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        rows[i] = key0 + i < g.S ? kv_row<PAGED>(p, g, b, key0 + i, hk) : -1;
}

// §5.1, §5.2 statistics: exact integer column sums of K and the absolute maxima of K and V.
// grid (ceil(S / KEYS_PER_CHUNK), Hkv, B), block 256. Thread t: channels c0 = 8 (t % (D/8)) .. c0 + 7 as one
// 16-byte load per key, keys chunk*KEYS_PER_CHUNK + t / (D/8) + j * (256 / (D/8)). Integer sums and maxima
// are order-free, so each thread leaves its channels' sums in shared memory (red: STATS_THREADS * 8
// values) and one thread per channel adds them up before one global atomic each.
constexpr int STATS_THREADS = 256;
constexpr int KEYS_PER_CHUNK = 256;
template <bool PAGED>
__device__ __forceinline__ void prep_stats(long long* red, long long* rows, const uint16_t* __restrict__ k,
                                           const uint16_t* __restrict__ v, unsigned long long* __restrict__ ksum,
                                           unsigned int* __restrict__ amax, const KvPages& pg, const Geom& g) {
    constexpr int NO = D / 8;  // channel octets
    const int b = blockIdx.z, hk = blockIdx.y, chunk = blockIdx.x;
    const int c0 = 8 * (threadIdx.x % NO);
    const int s0 = chunk * KEYS_PER_CHUNK + threadIdx.x / NO;
    const int s1 = min(g.S, (chunk + 1) * KEYS_PER_CHUNK);
    kv_rows<PAGED>(rows, pg, g, b, hk, chunk * KEYS_PER_CHUNK, KEYS_PER_CHUNK);
    __syncthreads();
    long long sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float ak = 0.0f, av = 0.0f;
    for (int s = s0; s < s1; s += STATS_THREADS / NO) {
        const long long row = rows[s - chunk * KEYS_PER_CHUNK];
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        const uint4 kw = PAGED && row < 0 ? zero : *reinterpret_cast<const uint4*>(k + row + c0);
        const uint4 vw = PAGED && row < 0 ? zero : *reinterpret_cast<const uint4*>(v + row + c0);
        const uint32_t kk[4] = {kw.x, kw.y, kw.z, kw.w}, vv[4] = {vw.x, vw.y, vw.z, vw.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint16_t kb = (uint16_t)(kk[j / 2] >> (16 * (j % 2))), vb = (uint16_t)(vv[j / 2] >> (16 * (j % 2)));
            sum[j] += f16_units(kb);
            ak = fmaxf(ak, fabsf(f32h(h_from_bits(kb))));
            av = fmaxf(av, fabsf(f32h(h_from_bits(vb))));
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) red[(threadIdx.x / NO) * D + c0 + j] = sum[j];  // [key lane][channel]
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ak = fmaxf(ak, __shfl_xor_sync(0xFFFFFFFFu, ak, o));
        av = fmaxf(av, __shfl_xor_sync(0xFFFFFFFFu, av, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&amax[((size_t)b * g.Hkv + hk) * 2 + 0], __float_as_uint(ak));
        atomicMax(&amax[((size_t)b * g.Hkv + hk) * 2 + 1], __float_as_uint(av));
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += STATS_THREADS) {
        long long total = 0;
        for (int kl = 0; kl < STATS_THREADS / NO; ++kl) total += red[kl * D + c];
        atomicAdd(&ksum[((size_t)b * g.Hkv + hk) * D + c], (unsigned long long)total);
    }
}

// up2 (numerics.md §5.2): the next power of two above x unless x is one (x positive, normal).
__device__ __forceinline__ float up2(float x) {
    uint32_t u = __float_as_uint(x);
    if (u & 0x7FFFFFu) u = ((u >> 23) + 1u) << 23;
    return __uint_as_float(u);
}

// §5.1 K mean and §5.2 head scales. grid (Hkv, B), block D.
__device__ __forceinline__ void prep_finalize(const unsigned long long* __restrict__ ksum,
                                              const unsigned int* __restrict__ amax, float* __restrict__ kmean,
                                              float* __restrict__ scales, const Geom& g) {
    __shared__ float red[D];
    const int b = blockIdx.y, hk = blockIdx.x, c = threadIdx.x;
    const size_t bh = (size_t)b * g.Hkv + hk;
    const long long sum = (long long)ksum[bh * D + c];
    // f32( f64( f64(sum) ⊘64 f64(S) ) ·64 2^-24 )
    const double q = __ddiv_rn(__ll2double_rn(sum), (double)g.S);
    const float km = __double2float_rn(__dmul_rn(q, 5.9604644775390625e-08));
    kmean[bh * D + c] = km;
    red[c] = fabsf(km);
    __syncthreads();
    if (c == 0) {
        float mk = 0.0f;
        for (int i = 0; i < D; ++i) mk = fmaxf(mk, red[i]);  // exact, order-free
        const float amaxK = __uint_as_float(amax[bh * 2 + 0]);
        const float amaxV = __uint_as_float(amax[bh * 2 + 1]);
        const float tiny = f32_from_bits(0x1E3CE508u);  // f32(1e-20)
        const float kg = up2(fdiv(fmul(4.0f, fmaxf(fadd(amaxK, mk), tiny)), 2688.0f));
        const float vg = up2(fdiv(fmul(4.0f, fmaxf(amaxV, tiny)), 2688.0f));
        scales[bh * 2 + 0] = kg;
        scales[bh * 2 + 1] = vg;
    }
}

// §5.7: the block's per-key statistics st[i0 ..] (maxima of non-negative floats are maxima of their
// bits: order-free) folded into kvstat, one atomic per warp and statistic. Every lane of the warp calls it.
template <int N>
__device__ __forceinline__ void kvstat_max(unsigned int* __restrict__ kvstat, size_t bh, int i0, float (&st)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) st[i] = fmaxf(st[i], __shfl_xor_sync(0xFFFFFFFFu, st[i], o));
    }
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) atomicMax(&kvstat[bh * KV_STATS + i0 + i], __float_as_uint(st[i]));
    }
}

// The keys some row sees (§5.7): the certificate's statistics are maxima over them, the estimate's means.
__device__ __forceinline__ bool cert_key(const Geom& g, int key) { return key < g.S && key >= g.lo(0); }

// The block's sums of its NT threads' u[i] (integers: order-free), returned to thread i < N (0 to the
// others): each warp's by shuffles, then one shared word per warp and sum. Shared atomics instead (one
// per thread and sum, on N words) serialized prep_k's and prep_v's blocks at their end (docs/results/performance-log.md).
// Every thread of the block calls it, once per launch.
template <int NT, int N>
__device__ __forceinline__ unsigned long long block_sums(const unsigned long long (&u)[N]) {
    static_assert(NT % 32 == 0, "whole warps");
    constexpr int NW = NT / 32;
    __shared__ unsigned long long acc[NW][N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        unsigned long long x = u[i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
        if ((threadIdx.x & 31) == 0) acc[threadIdx.x >> 5][i] = x;
    }
    __syncthreads();
    unsigned long long total = 0ull;
    if (threadIdx.x < N) {
#pragma unroll
        for (int w = 0; w < NW; ++w) total += acc[w][threadIdx.x];
    }
    return total;
}

// §5.7: a key's norm h as its FP16 value's integer units of 2⁻²⁴, what the means sum (h ≥ 0).
__device__ __forceinline__ unsigned long long norm_units(float h) {
    return (unsigned long long)f16_units(h_bits(f16(h)));
}

// §5.7's integer sums of tile t into its kvsum entries i0 .. i0 + N − 1: stored, not added, so that a
// tile formed again (a KV state's partial last tile, §5.9) replaces its sums. Every thread calls it.
template <int NT, int N>
__device__ __forceinline__ void tile_sums(unsigned long long* __restrict__ kvsum, const Geom& g, size_t bh, int t,
                                          int i0, const unsigned long long (&u)[N]) {
    const unsigned long long total = block_sums<NT>(u);
    if (threadIdx.x < N) kvsum[(bh * g.ntkv_buf + t) * KV_SUMS + i0 + threadIdx.x] = total;
}

// §5.4 K̂ as FP16 (§5.6), §5.7's kn, ek, k2n and the tile's sums of km, ekm. One thread per tile slot,
// its key's blocks in channel order, so that the statistics' sums of squares (in channel order, §5.7)
// run alongside the blocks with the values the image holds, without reading K or K̂ again: grid
// (span.hi − span.lo, Hkv, B), block K_THREADS = TILE. Tiles below every window (§5.5) or past a shorter
// varlen sequence are never read.
constexpr int K_THREADS = TILE;
template <bool PAGED>
__device__ __forceinline__ void prep_k(const uint16_t* __restrict__ k, const float* __restrict__ kmean,
                                       const float* __restrict__ scales, uint16_t* __restrict__ khat,
                                       unsigned int* __restrict__ kvstat, unsigned long long* __restrict__ kvsum,
                                       const KvPages& pg, const Geom& g,
                                       const TileSpan& span, bool quant, bool lsq, bool interleaved) {
    const int b = blockIdx.z, hk = blockIdx.y, tile = span.lo + blockIdx.x, slot = threadIdx.x;
    if (tile < g.first_tile(0) || tile >= min(span.hi, g.ntkv)) return;  // the whole block
    const size_t bh = (size_t)b * g.Hkv + hk;
    const int key = tile * TILE + slot_key(slot, interleaved);
    const bool in = key < g.S;
    uint16_t* img = khat + (bh * span.stride + span.slot(tile)) * TILE * D;
    const long long src = in ? kv_row<PAGED>(pg, g, b, key, hk) : -1;  // a hole or past S: zeros
    const float inv = fdiv(1.0f, scales[bh * 2 + 0]);                    // exact power of two
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f;
#pragma unroll 1
    for (int cb = 0; cb < D / 16; ++cb) {
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
        if (src >= 0) {  // the block's 16 halves in two 16-byte loads
            lo = *reinterpret_cast<const uint4*>(k + src + 16 * cb);
            hi = *reinterpret_cast<const uint4*>(k + src + 16 * cb + 8);
        }
        const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        float kv[16], x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            kv[i] = f32h(h_from_bits((uint16_t)(w[i / 2] >> (16 * (i % 2)))));
            x[i] = in ? fmul(fsub(kv[i], kmean[bh * D + 16 * cb + i]), inv) : 0.0f;
        }
        uint32_t out[8];
        if (quant && in) {
            float qv[16];
            quant16(x, qv, lsq);
#pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = f16x2(qv[2 * i], qv[2 * i + 1]);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = in ? f16x2(x[2 * i], x[2 * i + 1]) : 0u;
        }
        *reinterpret_cast<uint4*>(img + sw128_half(slot, 16 * cb, TILE)) = make_uint4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<uint4*>(img + sw128_half(slot, 16 * cb + 8, TILE)) = make_uint4(out[4], out[5], out[6], out[7]);
#pragma unroll
        for (int i = 0; i < 16; ++i) {  // kh: the image's value, which pass 1 multiplies
            const float kh = f32h(i % 2 ? h2_hi(out[i / 2]) : h2_lo(out[i / 2]));
            s0 = nrm_add(s0, kh);
            s1 = nrm_add(s1, fsub(x[i], kh));
            s2 = nrm_add(s2, kv[i]);
        }
    }
    const bool counted = cert_key(g, key);
    float st[3] = {counted ? nrm_end(s0) : 0.0f, counted ? nrm_end(s1) : 0.0f, counted ? nrm_end(s2) : 0.0f};
    unsigned long long u[2] = {norm_units(st[0]), norm_units(st[1])};  // before kvstat_max reduces st
    tile_sums<K_THREADS>(kvsum, g, bh, tile, 0, u);
    kvstat_max(kvstat, bh, 0, st);
}

// §5.5 V̂ per channel and P group of 16 keys (slot order) as FP16 (§5.6), §5.7's vn, ev and the tile's
// sums of vm ⊘ vg, evm ⊘ vg (and §5.8's ν under the output hot test, nu not null). One block of
// V_THREADS threads per tile, thread (group, 8 channels): it loads its 16 keys' 8 channels as 16-byte
// rows and quantizes each channel's 16 values as one block. The statistics are sums over a key's channels in order, across the tile's threads: each
// thread stages its raw values and the image's in shared memory (rows padded by one word, so that the
// key threads' row reads hit distinct banks), and thread j then sums slot j's key. Grid
// (span.hi − span.lo, Hkv, B); dynamic shared memory V_SMEM bytes.
constexpr int V_THREADS = 4 * (D / 8);
constexpr int V_ROW = D + 2;  // halves per staged row
constexpr int V_SMEM = 2 * TILE * V_ROW * 2;
template <bool PAGED>
__device__ __forceinline__ void prep_v(uint16_t* smem, const uint16_t* __restrict__ v, const float* __restrict__ scales,
                                       uint16_t* __restrict__ vhat, unsigned int* __restrict__ kvstat,
                                       unsigned long long* __restrict__ kvsum, uint16_t* __restrict__ nu,
                                       const KvPages& pg, const Geom& g, const TileSpan& span,
                                       bool quant, bool lsq, bool interleaved, bool v_f16) {
    constexpr int NO = D / 8;  // channel octets
    const int b = blockIdx.z, hk = blockIdx.y, t = span.lo + blockIdx.x;
    if (t < g.first_tile(0) || t >= min(span.hi, g.ntkv)) return;  // the whole block
    const size_t bh = (size_t)b * g.Hkv + hk;
    const int c0 = 8 * (threadIdx.x % NO), grp = threadIdx.x / NO;
    uint16_t* raw_s = smem;               // [slot][V_ROW]: v
    uint16_t* hat_s = smem + TILE * V_ROW;  // [slot][V_ROW]: the image's V̂
    const float vg = scales[bh * 2 + 1], inv = fdiv(1.0f, vg);  // exact power of two
    uint4 raw[16];
    bool in[16], any = false;  // key < S; a hole inside S reads as zeros and counts
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int key = t * TILE + slot_key(16 * grp + i, interleaved);
        in[i] = key < g.S;
        any |= in[i];
        const long long row = in[i] ? kv_row<PAGED>(pg, g, b, key, hk) : -1;
        raw[i] = row >= 0 ? *reinterpret_cast<const uint4*>(v + row + c0) : make_uint4(0u, 0u, 0u, 0u);
        uint32_t* dst = reinterpret_cast<uint32_t*>(raw_s + (16 * grp + i) * V_ROW + c0);  // 4-byte aligned rows
        dst[0] = raw[i].x;
        dst[1] = raw[i].y;
        dst[2] = raw[i].z;
        dst[3] = raw[i].w;
    }
    uint16_t* img = vhat + (bh * span.stride + span.slot(t)) * TILE * D;
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // channel c0 + j
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint32_t w = j < 2 ? raw[i].x : j < 4 ? raw[i].y : j < 6 ? raw[i].z : raw[i].w;
            x[i] = in[i] ? fmul(f32h(h_from_bits((uint16_t)(w >> (16 * (j % 2))))), inv) : 0.0f;
            if (v_f16) x[i] = f32h(f16(x[i]));  // the seed's f16(v/vg) (§5.5)
        }
        const bool qz = quant && any;
        float qv[16];
        if (qz) quant16(x, qv, lsq);
        uint32_t out[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            out[i] = f16x2(in[2 * i] ? (qz ? qv[2 * i] : x[2 * i]) : 0.0f, in[2 * i + 1] ? (qz ? qv[2 * i + 1] : x[2 * i + 1]) : 0.0f);
        *reinterpret_cast<uint4*>(img + sw128_half(c0 + j, 16 * grp, D)) = make_uint4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<uint4*>(img + sw128_half(c0 + j, 16 * grp + 8, D)) = make_uint4(out[4], out[5], out[6], out[7]);
#pragma unroll
        for (int i = 0; i < 16; ++i)
            hat_s[(16 * grp + i) * V_ROW + c0 + j] = (uint16_t)(out[i / 2] >> (16 * (i % 2)));
    }
    __syncthreads();
    float st[2] = {0.0f, 0.0f};
    unsigned long long u[2] = {0ull, 0ull};
    for (int j = threadIdx.x; j < TILE; j += V_THREADS) {  // slot j's key: every channel in order
        const int key = t * TILE + slot_key(j, interleaved);
        float s3 = 0.0f, s4 = 0.0f;
        for (int c = 0; c < D; ++c) {
            const float vv = f32h(h_from_bits(raw_s[j * V_ROW + c]));
            const float vh = f32h(h_from_bits(hat_s[j * V_ROW + c]));
            s3 = nrm_add(s3, vv);
            s4 = nrm_add(s4, fsub(vv, fmul(vh, vg)));
        }
        const bool counted = cert_key(g, key);
        const float vn = counted ? nrm_end(s3) : 0.0f, ev = counted ? nrm_end(s4) : 0.0f;
        st[0] = fmaxf(st[0], vn);
        st[1] = fmaxf(st[1], ev);
        const uint16_t nu_s = h_bits(f16(fmul(vn, inv)));  // §5.8's ν, +0 for a key not counted
        u[0] += f16_units(nu_s);
        u[1] += norm_units(fmul(ev, inv));
        if (nu != nullptr) nu[(bh * span.stride + span.slot(t)) * TILE + j] = nu_s;
    }
    tile_sums<V_THREADS>(kvsum, g, bh, t, 2, u);
    kvstat_max(kvstat, bh, 3, st);
}

// §5.7's means of (b, hk) from the sums of the tiles prep formed, F₀ .. ntkv − 1 (a KV state's earlier
// tiles keep theirs, §5.9): f32(f64(f64(sum) ⊘₆₄ f64(n)) ·₆₄ 2⁻²⁴) with n = S − lo₀, as prep_finalize's
// K mean; vm and evm then ⊗ vg (exact: a power of two). grid (Hkv, B), block MEAN_THREADS.
constexpr int MEAN_THREADS = 128;
__device__ __forceinline__ void prep_means(const unsigned long long* __restrict__ kvsum,
                                           const float* __restrict__ scales, unsigned int* __restrict__ kvstat,
                                           const Geom& g) {
    const int b = blockIdx.y, hk = blockIdx.x, i = threadIdx.x;
    const size_t bh = (size_t)b * g.Hkv + hk;
    unsigned long long u[KV_SUMS] = {0ull, 0ull, 0ull, 0ull};
    for (int t = g.first_tile(0) + i; t < g.ntkv; t += MEAN_THREADS) {
#pragma unroll
        for (int j = 0; j < KV_SUMS; ++j) u[j] += kvsum[(bh * g.ntkv_buf + t) * KV_SUMS + j];
    }
    const unsigned long long total = block_sums<MEAN_THREADS>(u);
    if (i >= KV_SUMS) return;
    const double q = __ddiv_rn(__ll2double_rn((long long)total), (double)max(g.S - g.lo(0), 1));
    const float mean = __double2float_rn(__dmul_rn(q, 5.9604644775390625e-08));
    kvstat[bh * KV_STATS + 5 + i] = __float_as_uint(i < 2 ? mean : fmul(mean, scales[bh * 2 + 1]));
}

// §5.3 Q̂'s values of one 16-channel block x (apa_emu/prep.py prep_q): q_mode 0 = NVFP4, q_terms 1 or
// 2 (the second quantizes the first's residual), 1 = FP8 E4M3, 2 = quantization off.
__device__ __forceinline__ void prep_q_quant(const float (&x)[16], float (&qh)[16], int q_mode, int q_terms, bool lsq) {
    if (q_mode == 0) {
        quant16(x, qh, lsq);
        if (q_terms == 2) {
            float res[16], q2[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) res[j] = fsub(x[j], qh[j]);
            quant16(res, q2, lsq);
#pragma unroll
            for (int j = 0; j < 16; ++j) qh[j] = fadd(qh[j], q2[j]);  // exact in binary32
        }
    } else if (q_mode == 1) {
#pragma unroll
        for (int j = 0; j < 16; ++j) qh[j] = e4m3_value(e4m3_code(x[j]));
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) qh[j] = x[j];
    }
}

// §5.7 qn, eq, q2n of a row into qstat's row qr (lane cb = 0; +0 for a padding row): one sum of squares per
// statistic in channel order, handed from block to block along the row's NB lanes (a row never
// straddles a warp, and warps are wholly in range: Rp is a multiple of 16).
__device__ __forceinline__ void prep_q_stats(const float (&x)[16], const float (&qh)[16],
                                             const uint16_t* __restrict__ qrow, int cb, bool valid,
                                             float* __restrict__ qstat, size_t qr) {
    constexpr int NB = D / 16;
    float s_qn = 0.0f, s_eq = 0.0f, s_q2 = 0.0f;
    const int lane0 = (int)(threadIdx.x & 31) - cb;
    for (int blk = 0; blk < NB; ++blk) {
        if (cb == blk) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float qv = f32h(f16(qh[j]));  // the operand's value (§5.6)
                s_qn = nrm_add(s_qn, qv);
                s_eq = nrm_add(s_eq, fsub(x[j], qv));
                s_q2 = nrm_add(s_q2, valid ? f32h(h_from_bits(qrow[16 * cb + j])) : 0.0f);
            }
        }
        s_qn = __shfl_sync(0xFFFFFFFFu, s_qn, lane0 + blk);
        s_eq = __shfl_sync(0xFFFFFFFFu, s_eq, lane0 + blk);
        s_q2 = __shfl_sync(0xFFFFFFFFu, s_q2, lane0 + blk);
    }
    if (cb == 0) {
        float* st = qstat + qr * 3;
        st[0] = valid ? nrm_end(s_qn) : 0.0f;
        st[1] = valid ? nrm_end(s_eq) : 0.0f;
        st[2] = valid ? nrm_end(s_q2) : 0.0f;
    }
}

// §5.3 row shift of a valid row, then times qmul (§12 #9; apa_emu/prep.py row_shift): sequential over
// channels, or (lanes) the seed's per-lane sums of channel pairs c, c + 1 (c = 16k + 8h + 2·t0, lane
// t0) added in pairs. km: the head's K mean.
__device__ __forceinline__ float row_shift(const uint16_t* __restrict__ qrow, const float* __restrict__ km, float qmul,
                                           bool lanes, bool fused) {
    float s = 0.0f;
    auto qc = [&](int c) { return f32h(h_from_bits(qrow[c])); };
    if (lanes) {
        float ls[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k16 = 0; k16 < D; k16 += 16)
            for (int h8 = 0; h8 < 16; h8 += 8)
#pragma unroll
                for (int t0 = 0; t0 < 4; ++t0) {
                    const int c = k16 + h8 + 2 * t0;
                    ls[t0] = fadd(ls[t0], madd(qc(c), km[c], fmul(qc(c + 1), km[c + 1]), fused));
                }
        s = fadd(fadd(ls[0], ls[1]), fadd(ls[2], ls[3]));
    } else {
        for (int c = 0; c < D; ++c) s = fadd(s, fmul(qc(c), km[c]));
    }
    return fmul(s, qmul);
}

// §5.3 Q̂ (as FP16, §5.6), c_q and the row shift sh. D/16 threads per packed row (one per
// 16-channel block): grid (ceil(Rp * D/16 / 128), Hkv, B), block 128.
// q_mode: 0 = NVFP4 (q_terms 1 or 2), 1 = FP8 E4M3, 2 = quantization off.
__device__ __forceinline__ void prep_q(const uint16_t* __restrict__ q, const float* __restrict__ kmean,
                                       const float* __restrict__ scales, uint16_t* __restrict__ qhat,
                                       float* __restrict__ cq, float* __restrict__ sh, float* __restrict__ qstat,
                                       const Geom& g, float qmul, int q_mode, int q_terms, bool lsq, bool lanes,
                                       bool fused, bool pad_vote) {
    constexpr int NB = D / 16;
    const int b = blockIdx.z, hk = blockIdx.y;
    const size_t bh = (size_t)b * g.Hkv + hk;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // All lanes of a row group stay alive for the shuffles (128 is a multiple of NB).
    const int r = (int)(idx / NB), cb = (int)(idx % NB);
    const bool in_range = r < g.Rp;
    const bool valid = r < g.R;
    // Q̂ and c_q of a padding row: zero, or under pad_vote row R − 1's (§6.2); its statistics stay +0.
    const bool formed = valid || (pad_vote && in_range);
    const int rs = valid ? r : g.R - 1;
    const int i = formed ? rs / g.G : 0;
    const int h = hk * g.G + (formed ? rs % g.G : 0);
    const uint16_t* qrow = q + ((g.q0 + i) * g.H + h) * D;
    float x[16];
    float am = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        x[j] = formed ? fmul(f32h(h_from_bits(qrow[16 * cb + j])), qmul) : 0.0f;
        am = fmaxf(am, fabsf(x[j]));
    }
    // Row maximum over the NB lanes of the row (exact, order-free).
#pragma unroll
    for (int o = 1; o < NB; o <<= 1) am = fmaxf(am, __shfl_xor_sync(0xFFFFFFFFu, am, o));
    if (!in_range) return;
    const float tiny = f32_from_bits(0x1E3CE508u);  // f32(1e-20)
    const float qr = fdiv(fmaxf(am, tiny), q_mode == 1 ? 448.0f : 2688.0f);
#pragma unroll
    for (int j = 0; j < 16; ++j) x[j] = fdiv(x[j], qr);
    float qh[16];
    prep_q_quant(x, qh, q_mode, q_terms, lsq);
    uint32_t out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = formed ? f16x2(qh[2 * j], qh[2 * j + 1]) : 0u;
    prep_q_stats(x, qh, qrow, cb, valid, qstat, bh * g.Rp_buf + r);
    uint4* d4 = reinterpret_cast<uint4*>(qhat + (bh * g.Rp_buf + r) * D + 16 * cb);
    d4[0] = make_uint4(out[0], out[1], out[2], out[3]);
    d4[1] = make_uint4(out[4], out[5], out[6], out[7]);
    if (cb == 0) {
        float s = 0.0f;
        if (valid) s = row_shift(qrow, kmean + bh * D, qmul, lanes, fused);
        cq[bh * g.Rp_buf + r] = formed ? fmul(qr, scales[bh * 2 + 0]) : 1.0f;
        sh[bh * g.Rp_buf + r] = s;
    }
}

}  // namespace apa
