// cuda_sim.h: a host (CPU) stand-in for the CUDA built-ins the APA kernels use, so that the very
// same kernel sources compile with g++ (-DAPA_SIM) into a shared library that apa_gpu can run
// without a GPU (APA_GPU_BACKEND=sim, see apa_gpu/device.py). Every GPU thread is a host thread; warp
// collectives (shuffles, votes, ldmatrix, mma.sync) exchange values through a per-warp buffer and
// barrier; __syncthreads is a per-CTA barrier.
//
// What it checks: indexing, fragment layouts, control flow, synchronisation structure, trace
// layout and the binary32/binary16 arithmetic (host SSE arithmetic is IEEE RNE with subnormals,
// compiled with -ffp-contract=off). What it cannot check: the tensor cores themselves (mma.sync is
// computed with a C++ port of the emulator's sm90 model, numerics.md §3.1; the hardware is checked
// by tests/kernel/test_gpu_mma.py), true concurrency and memory-model behaviour, and ex2.approx.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <math.h>

#include <cmath>

#ifndef APA_SIM
#error "cuda_sim.h is only for host builds with -DAPA_SIM"
#endif

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define __grid_constant__

struct dim3s {
    unsigned x, y, z;
};
struct uint4 {
    uint32_t x, y, z, w;
};
struct float2 {
    float x, y;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

namespace apa_sim {
struct ThreadCtx {
    dim3s tid, bid, bdim, gdim;
};
ThreadCtx& ctx();
void syncthreads();
void* dynamic_smem();
// Warp exchange: every lane of the warp publishes `bytes` bytes and gets the whole warp's values.
void warp_exchange(const void* mine, void* all32, int bytes);
void syncwarp();
// mbarrier (pipeline.cuh): the 64-bit word holds the phase (bit 63), the pending bytes (bits
// 40..62), the expected arrivals (bits 20..39) and the pending arrivals (bits 0..19).
void mbar_init(uint64_t* bar, uint32_t count);
void mbar_arrive(uint64_t* bar);
void mbar_arrive_expect_tx(uint64_t* bar, uint32_t tx);
void mbar_complete_tx(uint64_t* bar, uint32_t tx);
void mbar_wait(uint64_t* bar, uint32_t parity);
// The simulator's stand-in for a CUtensorMap (apa_gpu/device.py _Sim.tensor_map): a 3-D tensor of
// 16-bit elements, dims and byte strides innermost first, loaded in boxes with the 128-byte swizzle.
struct TensorMap {
    uint64_t base;
    uint64_t dim[3];
    uint64_t stride[2];  // bytes, of dims 1 and 2
    uint32_t box[3];
};
// cp.async.bulk.tensor.3d ... .tile: the box at (c0, c1, c2), rows past the tensor zero, each
// 128-byte row's 16-byte chunk j stored at chunk j ^ (row mod 8); complete_tx of its bytes on bar.
void tma_load_3d(void* smem, const void* map, int c0, int c1, int c2, uint64_t* bar);
}  // namespace apa_sim

#define threadIdx (::apa_sim::ctx().tid)
#define blockIdx (::apa_sim::ctx().bid)
#define blockDim (::apa_sim::ctx().bdim)
#define gridDim (::apa_sim::ctx().gdim)

inline void __syncthreads() { apa_sim::syncthreads(); }
inline void __syncwarp() { apa_sim::syncwarp(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
[[noreturn]] inline void __trap() { abort(); }
void __nanosleep(unsigned);

inline int ctx_lane_() { return (int)(threadIdx.x & 31u); }
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "4- and 8-byte shuffles, as CUDA's");
    T all[32];
    apa_sim::warp_exchange(&v, all, sizeof(T));
    return all[src & 31];
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "4- and 8-byte shuffles, as CUDA's");
    T all[32];
    apa_sim::warp_exchange(&v, all, sizeof(T));
    return all[(ctx_lane_()) ^ mask];
}
inline int __any_sync(unsigned, int pred) {
    int all[32];
    apa_sim::warp_exchange(&pred, all, 4);
    for (int i = 0; i < 32; ++i)
        if (all[i]) return 1;
    return 0;
}

inline int __reduce_min_sync(unsigned, int v) {
    int all[32];
    apa_sim::warp_exchange(&v, all, 4);
    int r = all[0];
    for (int i = 1; i < 32; ++i) r = all[i] < r ? all[i] : r;
    return r;
}
inline int __reduce_max_sync(unsigned, int v) {
    int all[32];
    apa_sim::warp_exchange(&v, all, 4);
    int r = all[0];
    for (int i = 1; i < 32; ++i) r = all[i] > r ? all[i] : r;
    return r;
}

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicMax(unsigned* p, unsigned v) {
    unsigned cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return cur;
}

template <typename T>
inline T __ldcg(const T* p) {
    return *p;
}

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

// binary32 / binary64 intrinsics: plain IEEE host arithmetic (round to nearest even, no FTZ).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
inline double __ll2double_rn(long long x) { return (double)x; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __double2float_rn(double x) { return (float)x; }
inline float __uint_as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int u) { return __uint_as_float((uint32_t)u); }
inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

// binary16 storage type and bit casts
struct __half {
    uint16_t x;
};
inline uint16_t __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(uint16_t u) { return __half{u}; }

namespace apa_sim {
// RNE of a finite or infinite binary64 value to binary16 bits: subnormals kept, overflow to inf.
inline uint16_t f16_bits_rn(double x) {
    if (x != x) return 0x7FFF;
    const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    double ax = std::fabs(x);
    if (ax >= 65520.0) return sign | 0x7C00;
    int e;
    std::frexp(ax, &e);  // ax in [2^(e-1), 2^e)
    const int ex = ax < 0x1p-14 ? -14 : e - 1;
    const double q = std::ldexp(1.0, ex - 10);
    double m = std::nearbyint(ax / q);  // exact scaling, one RNE
    if (m == 0) return sign;
    if (ex == -14 && m < 1024) return sign | (uint16_t)m;  // subnormal
    int be = ex + 15;
    if (m >= 2048) {
        m /= 2;
        be += 1;
    }
    if (be >= 31) return sign | 0x7C00;
    return sign | (uint16_t)(be << 10) | (uint16_t)((int)m - 1024);
}
inline double f16_value(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = std::ldexp((double)m, -24);
    else v = std::ldexp((double)(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}
// e4m3 satfinite RNE with subnormals (numerics.md §4.2), the code of __nv_cvt_float_to_fp8.
inline uint8_t e4m3_code(float x) {
    if (x != x) return 0x7F;
    double ax = std::fmin(std::fabs((double)x), 448.0);
    int code;
    if (ax < 0x1p-6) {
        code = (int)std::nearbyint(ax * 512.0);
    } else {
        int e;
        std::frexp(ax, &e);
        const int y = (int)std::nearbyint(std::ldexp(ax, 4 - e));
        code = ((e + 6) << 3) + y - 8;
    }
    if (std::signbit(x)) code |= 0x80;
    return (uint8_t)code;
}
// Port of apa_emu.mma's sm90 fused step (numerics.md §3.1): 16 FP16 products and C, truncation at
// F = 25 bits below the largest term exponent, RZ to binary32 or RNE to binary16.
double mma_step(const double* a, const double* b, double c, bool f16_out);
// mma.sync.m16n8k16 (fragment layout of cuda/mma.cuh) across the calling warp.
void mma_f32(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
void mma_f16(uint32_t (&acc)[2], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
// ldmatrix.x4 (.trans): lanes 8i..8i+7 give the row addresses of matrix i.
void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans);
// The ready flags of the fused launch.
void flag_release(unsigned* p);
unsigned flag_acquire(const unsigned* p);
}  // namespace apa_sim
