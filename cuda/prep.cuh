// prep.cuh: K mean, head scales, and the quantized pass-1 operands (docs/numerics.md §5).
//
// Layouts (all contiguous):
//   q   [B, n, H, D] f16        k, v [B, S, Hkv, D] f16          (inputs)
//   ksum [B, Hkv, D] u64 (two's complement int64 sums in units of 2^-24; zeroed by the host)
//   amax [B, Hkv, 2] u32 (float bits of max|K|, max|V|; zeroed by the host)
//   kmean [B, Hkv, D] f32; scales [B, Hkv, 2] f32 = (kg, vg)
//   qhat [B, Hkv, Rp, D] f16 (pass-1 operand Q̂), cq [B, Hkv, Rp] f32, sh [B, Hkv, Rp] f32
//   qstat [B, Hkv, Rp, 3] f32 = (qn, eq, q2n); kvstat [B, Hkv, 5] u32 = float bits of (kn, ek, k2n, vn,
//   ev) (§5.7; zeroed by the host)
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
// per key and block, where the steps below read each key's row many times. The caller syncs.
template <bool PAGED>
__device__ __forceinline__ void kv_rows(long long* rows, const KvPages& p, const Geom& g, int b, int hk, int key0,
                                        int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        rows[i] = key0 + i < g.S ? kv_row<PAGED>(p, g, b, key0 + i, hk) : -1;
}

// A thread of the per-element prep kernels, grid (x, Hkv, B): its (b, hk) and flat index along x,
// from ``base`` (the elements of the tiles a KV state already holds, §5.9, are not launched).
struct PrepThread {
    int b, hk;
    size_t bh;
    long long idx;
};
__device__ __forceinline__ PrepThread prep_thread(const Geom& g, long long base = 0) {
    const int b = blockIdx.z, hk = blockIdx.y;
    return {b, hk, (size_t)b * g.Hkv + hk, base + (long long)blockIdx.x * blockDim.x + threadIdx.x};
}

// §5.1, §5.2 statistics: exact integer column sums of K and the absolute maxima of K and V.
// grid (ceil(S / KEYS_PER_CHUNK), Hkv, B), block 256. Thread t: channels c0 = 8 (t % (D/8)) .. c0 + 7 as one
// 16-byte load per key, keys chunk*KEYS_PER_CHUNK + t / (D/8) + j * (256 / (D/8)). Integer sums and maxima
// are order-free, so the block sums its channels in shared memory before one global atomic each.
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
    for (int c = threadIdx.x; c < D; c += STATS_THREADS) red[c] = 0;
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
    for (int j = 0; j < 8; ++j) atomicAdd(reinterpret_cast<unsigned long long*>(&red[c0 + j]), (unsigned long long)sum[j]);
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
    for (int c = threadIdx.x; c < D; c += STATS_THREADS)
        atomicAdd(&ksum[((size_t)b * g.Hkv + hk) * D + c], (unsigned long long)red[c]);
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

// §5.4 K̂ per key and 16-channel block, as FP16 (§5.6). One thread per (tile slot row, block):
// grid (ceil((span.hi-span.lo)*64*D/16 / 128), Hkv, B), block 128.
template <bool PAGED>
__device__ __forceinline__ void prep_k(const uint16_t* __restrict__ k, const float* __restrict__ kmean,
                                       const float* __restrict__ scales, uint16_t* __restrict__ khat,
                                       const KvPages& pg, const Geom& g, const TileSpan& span, bool quant, bool lsq,
                                       bool interleaved) {
    constexpr int NB = D / 16;
    const auto [b, hk, bh, idx] = prep_thread(g, (long long)span.lo * TILE * NB);
    if (idx >= (long long)min(span.hi, g.ntkv) * TILE * NB) return;
    const int row = (int)(idx / NB), cb = (int)(idx % NB);
    if (row / TILE < g.first_tile(0)) return;  // below every window (§5.5): never read
    const int key = (row / TILE) * TILE + slot_key(row % TILE, interleaved);
    uint16_t* img = khat + (bh * span.stride + span.slot(row / TILE)) * TILE * D;
    const int slot = row % TILE;
    float x[16];
    if (key < g.S) {
        const float inv = fdiv(1.0f, scales[bh * 2 + 0]);  // exact power of two
        const long long src = kv_row<PAGED>(pg, g, b, key, hk);
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;  // a hole: zeros
        if (!PAGED || src >= 0) {  // the block's 16 halves in two 16-byte loads
            lo = *reinterpret_cast<const uint4*>(k + src + 16 * cb);
            hi = *reinterpret_cast<const uint4*>(k + src + 16 * cb + 8);
        }
        const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const uint16_t h = (uint16_t)(w[i / 2] >> (16 * (i % 2)));
            x[i] = fmul(fsub(f32h(h_from_bits(h)), kmean[bh * D + 16 * cb + i]), inv);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = 0.0f;
    }
    uint32_t out[8];
    if (quant && key < g.S) {
        float qv[16];
        quant16(x, qv, lsq);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = f16x2(qv[2 * i], qv[2 * i + 1]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = key < g.S ? f16x2(x[2 * i], x[2 * i + 1]) : 0u;
    }
    *reinterpret_cast<uint4*>(img + sw128_half(slot, 16 * cb, TILE)) = make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(img + sw128_half(slot, 16 * cb + 8, TILE)) = make_uint4(out[4], out[5], out[6], out[7]);
}

// §5.5 V̂ per channel and P group of 16 keys (slot order), as FP16 (§5.6). One thread per (tile, group,
// 8 channels): it loads its 16 keys' 8 channels as 16-byte rows (a warp reads 512 contiguous bytes per
// load where one thread per channel issued 2-byte loads) and quantizes each channel's 16 values as one
// block: grid (ceil((span.hi-span.lo)*4*D/8 / 128), Hkv, B), block 128.
template <bool PAGED>
__device__ __forceinline__ void prep_v(const uint16_t* __restrict__ v, const float* __restrict__ scales,
                                       uint16_t* __restrict__ vhat, const KvPages& pg, const Geom& g, const TileSpan& span,
                                       bool quant, bool lsq, bool interleaved, bool v_f16) {
    constexpr int NO = D / 8;  // channel octets
    const auto [b, hk, bh, idx] = prep_thread(g, (long long)span.lo * 4 * NO);
    if (idx >= (long long)min(span.hi, g.ntkv) * 4 * NO) return;
    const int c0 = 8 * (int)(idx % NO);
    const int grp = (int)((idx / NO) % 4);
    const int t = (int)(idx / (4 * NO));
    if (t < g.first_tile(0)) return;  // below every window (§5.5): never read
    const float inv = fdiv(1.0f, scales[bh * 2 + 1]);  // exact power of two
    uint4 raw[16];
    bool in[16], any = false;  // key < S; a hole inside S reads as zeros and counts
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int key = t * TILE + slot_key(16 * grp + i, interleaved);
        in[i] = key < g.S;
        any |= in[i];
        const long long row = in[i] ? kv_row<PAGED>(pg, g, b, key, hk) : -1;
        raw[i] = row >= 0 ? *reinterpret_cast<const uint4*>(v + row + c0) : make_uint4(0u, 0u, 0u, 0u);
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
    }
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
    const auto [b, hk, bh, idx] = prep_thread(g);
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
    uint32_t out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = formed ? f16x2(qh[2 * j], qh[2 * j + 1]) : 0u;
    // §5.7 qn, eq, q2n: one sum of squares per statistic in channel order, handed from block to block
    // along the row's NB lanes (a row never straddles a warp, and warps are wholly in range: Rp is a
    // multiple of 16).
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
        float* st = qstat + (bh * g.Rp_buf + r) * 3;
        st[0] = valid ? nrm_end(s_qn) : 0.0f;
        st[1] = valid ? nrm_end(s_eq) : 0.0f;
        st[2] = valid ? nrm_end(s_q2) : 0.0f;
    }
    uint4* d4 = reinterpret_cast<uint4*>(qhat + (bh * g.Rp_buf + r) * D + 16 * cb);
    d4[0] = make_uint4(out[0], out[1], out[2], out[3]);
    d4[1] = make_uint4(out[4], out[5], out[6], out[7]);
    if (cb == 0) {
        float s = 0.0f;
        if (valid) {
            // Row shift, then times qmul (§5.3, §12 #9): sequential over channels, or the seed's per-lane
            // sums of channel pairs c, c + 1 (c = 16k + 8h + 2·t0, lane t0) added in pairs.
            const float* km = kmean + bh * D;
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
            s = fmul(s, qmul);
        }
        cq[bh * g.Rp_buf + r] = formed ? fmul(qr, scales[bh * 2 + 0]) : 1.0f;
        sh[bh * g.Rp_buf + r] = s;
    }
}

// §5.7 per-key statistics of the certificate: kn, ek, k2n, vn, ev, maxima over the keys lo₀ ≤ s < S of
// norms in channel order. One block of CERT_THREADS = 64 threads per tile, thread j the tile's slot j
// (key 64t + slot_key(j)): grid (span.hi − span.lo, Hkv, B). The tile's K rows and K̂ image, then its V rows and
// V̂ image, are staged in shared memory with coalesced loads (rows padded by one word, so that the
// threads' row reads hit distinct banks); each thread then sums its key's channels in order. K̂ and V̂
// are read back from their images, so they are the values pass 1 multiplies; y is recomputed as
// prep_k computes it. Maxima of non-negative floats are maxima of their bits: order-free. Under the
// output hot test (nu not null) the same per-key norm of v gives §5.8's ν, stored in slot order.
constexpr int CERT_THREADS = TILE;
constexpr int CERT_ROW = D + 2;  // halves per staged row
constexpr int CERT_BATCH = 8;    // staged 16-byte chunks in flight per thread (TILE·D/8 / CERT_THREADS is a multiple):
                                 // the loads, not the sums, bound this kernel
// The block's staging buffers, declared once by the kernel: a __shared__ array inside prep_cert would be
// allocated once per layout instantiation, twice the shared memory, half the resident blocks.
struct CertSmem {
    uint32_t rows_w[TILE * CERT_ROW / 2];    // the tile's K (then V) rows, by key
    alignas(16) uint32_t img_w[TILE * D / 2];  // its K̂ (then V̂ᵀ) image
    long long key_rows[TILE];
};
template <bool PAGED>
__device__ __forceinline__ void prep_cert(CertSmem& sm, const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                                          const float* __restrict__ kmean, const float* __restrict__ scales,
                                          const uint16_t* __restrict__ khat, const uint16_t* __restrict__ vhat,
                                          unsigned int* __restrict__ kvstat, uint16_t* __restrict__ nu,
                                          const KvPages& pg, const Geom& g, const TileSpan& span,
                                          bool interleaved) {
    uint32_t* rows_w = sm.rows_w;
    uint32_t* img_w = sm.img_w;
    uint16_t* rows = reinterpret_cast<uint16_t*>(rows_w);
    uint16_t* img = reinterpret_cast<uint16_t*>(img_w);
    const int b = blockIdx.z, hk = blockIdx.y, tile = span.lo + blockIdx.x, j = threadIdx.x;
    if (tile < g.first_tile(0) || tile >= min(span.hi, g.ntkv)) return;  // the whole block: below every window (§5.5), or
                                                            // past a shorter varlen sequence's keys
    const size_t bh = (size_t)b * g.Hkv + hk;
    const int kk = slot_key(j, interleaved), key = tile * TILE + kk;
    const bool valid = key < g.S && key >= g.lo(0);  // the keys some row sees (§5.7)
    float st[KV_STATS] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    long long* key_rows = sm.key_rows;  // ordered by the first __syncthreads below
    kv_rows<PAGED>(key_rows, pg, g, b, hk, tile * TILE, TILE);
    for (int phase = 0; phase < 2; ++phase) {  // 0: K and K̂; 1: V and V̂ᵀ
        const uint16_t* src = phase ? v : k;
        const uint16_t* im = (phase ? vhat : khat) + (bh * span.stride + span.slot(tile)) * TILE * D;
        __syncthreads();  // the previous phase's reads are done
        // Chunk e: key e / (D/8), channels 8 (e % (D/8)) on. CERT_BATCH chunks' loads are issued
        // before their shared-memory stores, which the compiler would not move the loads across.
        for (int e0 = j; e0 < TILE * D / 8; e0 += CERT_BATCH * CERT_THREADS) {
            uint4 w[CERT_BATCH], wi[CERT_BATCH];
#pragma unroll
            for (int u = 0; u < CERT_BATCH; ++u) {
                const int e = e0 + u * CERT_THREADS, r = e / (D / 8), c = 8 * (e % (D / 8));
                const long long row = key_rows[r];  // past S or a hole: zeros
                w[u] = row >= 0 ? *reinterpret_cast<const uint4*>(src + row + c) : make_uint4(0u, 0u, 0u, 0u);
                wi[u] = reinterpret_cast<const uint4*>(im)[e];
            }
#pragma unroll
            for (int u = 0; u < CERT_BATCH; ++u) {
                const int e = e0 + u * CERT_THREADS, r = e / (D / 8), c = 8 * (e % (D / 8));
                uint32_t* dst = rows_w + (r * CERT_ROW + c) / 2;  // rows padded by a word: 4-byte stores
                dst[0] = w[u].x;
                dst[1] = w[u].y;
                dst[2] = w[u].z;
                dst[3] = w[u].w;
                reinterpret_cast<uint4*>(img_w)[e] = wi[u];
            }
        }
        __syncthreads();
        if (!valid) {
            if (phase && nu != nullptr) nu[(bh * span.stride + span.slot(tile)) * TILE + j] = 0;  // §5.8: +0
            continue;
        }
        const uint16_t* row = rows + kk * CERT_ROW;
        if (phase == 0) {
            const float inv = fdiv(1.0f, scales[bh * 2 + 0]);  // exact power of two
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f;
            for (int c = 0; c < D; ++c) {
                const float kv = f32h(h_from_bits(row[c]));
                const float kh = f32h(h_from_bits(img[sw128_half(j, c, TILE)]));
                s0 = nrm_add(s0, kh);
                s1 = nrm_add(s1, fsub(fmul(fsub(kv, kmean[bh * D + c]), inv), kh));
                s2 = nrm_add(s2, kv);
            }
            st[0] = nrm_end(s0);
            st[1] = nrm_end(s1);
            st[2] = nrm_end(s2);
        } else {
            const float vg = scales[bh * 2 + 1];
            float s3 = 0.0f, s4 = 0.0f;
            for (int c = 0; c < D; ++c) {
                const float vv = f32h(h_from_bits(row[c]));
                const float vh = f32h(h_from_bits(img[sw128_half(c, j, D)]));
                s3 = nrm_add(s3, vv);
                s4 = nrm_add(s4, fsub(vv, fmul(vh, vg)));
            }
            st[3] = nrm_end(s3);
            st[4] = nrm_end(s4);
            if (nu != nullptr) nu[(bh * span.stride + span.slot(tile)) * TILE + j] = h_bits(f16(fmul(st[3], fdiv(1.0f, vg))));
        }
    }
#pragma unroll
    for (int i = 0; i < KV_STATS; ++i) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) st[i] = fmaxf(st[i], __shfl_xor_sync(0xFFFFFFFFu, st[i], o));
    }
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int i = 0; i < KV_STATS; ++i) atomicMax(&kvstat[bh * KV_STATS + i], __float_as_uint(st[i]));
    }
}

}  // namespace apa
