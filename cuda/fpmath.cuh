// fpmath.cuh: binary32/binary16 arithmetic of the APA numerics (docs/numerics.md §1, §2).
//
// Every operation here is one IEEE operation with round-to-nearest-even and no flush to zero
// (numerics.md §1.1, §1.2). The build uses --fmad=false --ftz=false --prec-div=true, and in
// addition every arithmetic operation on a bit-exact path is written with an explicit rounding
// intrinsic (__fadd_rn, __fmul_rn, ...) or a PTX instruction with an explicit .rn and without
// .ftz, so neither the compiler nor ptxas may contract or flush it.
#pragma once

#include <stdint.h>
#ifdef APA_SIM
#include "sim/cuda_sim.h"  // host build of the same sources (apa_gpu simulator)
#else
#include <cuda_fp16.h>
#endif

namespace apa {

// ---------------------------------------------------------------------------------------------
// binary32 (numerics.md §1.1, §1.3)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fsub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fdiv(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float fsqrt(float a) { return __fsqrt_rn(a); }  // correctly rounded
// §1.8: a ⊗ b ⊕ c, or at the seed's FMA sites under config fma (`fused`) one rounding of a·b + c.
// The PTX comment marks these FMAs for the audit of tests/kernel/test_gpu_build.py.
__device__ __forceinline__ float madd(float a, float b, float c, bool fused) {
    if (!fused) return fadd(fmul(a, b), c);
#ifdef APA_SIM
    return __fmaf_rn(a, b, c);
#else
    float d;
    asm("fma.rn.f32 %0, %1, %2, %3; // madd\n" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
#endif
}
// §8.4: fma(p, p, acc), pass 2's Σp², the one rounding binary32 fma outside the seed's sites (numerics.md
// §1.1); marked in the PTX as madd's are, for the audit of tests/kernel/test_gpu_build.py.
__device__ __forceinline__ float fma_sq(float p, float acc) {
#ifdef APA_SIM
    return __fmaf_rn(p, p, acc);
#else
    float d;
    asm("fma.rn.f32 %0, %1, %1, %2; // sq\n" : "=f"(d) : "f"(p), "f"(acc));
    return d;
#endif
}
// IEEE maxNum / minNum (numerics.md notation: max/min are exact).
__device__ __forceinline__ float fmax_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float fmin_(float a, float b) { return fminf(a, b); }

__device__ __forceinline__ float f32_from_bits(uint32_t u) { return __uint_as_float(u); }

constexpr uint32_t NEG_INF_BITS = 0xFF800000u;
__device__ __forceinline__ float neg_inf() { return __uint_as_float(NEG_INF_BITS); }
__device__ __forceinline__ float pos_inf() { return __uint_as_float(0x7F800000u); }

// ---------------------------------------------------------------------------------------------
// exp2 (numerics.md §2)
// ---------------------------------------------------------------------------------------------
// Horner coefficients C0..C6 as binary32 bit patterns (numerics.md §2, step 4).
#define APA_EXP2_C0 0x3F800000u
#define APA_EXP2_C1 0x3F317218u
#define APA_EXP2_C2 0x3E75FDEEu
#define APA_EXP2_C3 0x3D63576Bu
#define APA_EXP2_C4 0x3C1D9662u
#define APA_EXP2_C5 0x3AAFA26Eu
#define APA_EXP2_C6 0x39212C6Cu

// Steps 2-4 of exp2s for x in [-126, 128): p(f) and ji = j = round(x) as an integer.
__device__ __forceinline__ float exp2s_poly(float x, int& ji) {
    const float RND = 12582912.0f;               // 1.5 * 2^23
    float j = fsub(fadd(x, RND), RND);           // step 2: nearest integer, ties to even
    float f = fsub(x, j);                        // step 3: exact
    float p = f32_from_bits(APA_EXP2_C6);        // step 4: Horner without FMA
    p = fadd(fmul(p, f), f32_from_bits(APA_EXP2_C5));
    p = fadd(fmul(p, f), f32_from_bits(APA_EXP2_C4));
    p = fadd(fmul(p, f), f32_from_bits(APA_EXP2_C3));
    p = fadd(fmul(p, f), f32_from_bits(APA_EXP2_C2));
    p = fadd(fmul(p, f), f32_from_bits(APA_EXP2_C1));
    p = fadd(fmul(p, f), f32_from_bits(APA_EXP2_C0));
    // j as an integer without a conversion instruction: x + 1.5*2^23 lies in [2^23, 2^24), where the
    // binary32 quantum is 1, so its low mantissa bits hold round(x) + 2^22 (exact, equal to j).
    ji = (int)__float_as_uint(fadd(x, RND)) - 0x4B400000;
    return p;
}

// exp2s: the specified software exp2 (numerics.md §2 "soft").
__device__ __forceinline__ float exp2s(float x) {
    if (x != x) return x;                        // step 1: NaN -> NaN
    if (x < -126.0f) return 0.0f;                // step 1: includes -inf -> +0
    if (x >= 128.0f) return pos_inf();           // step 1
    int ji;
    const float p = exp2s_poly(x, ji);
    float r;
    if (ji == 128) {                             // step 5: 2^128 is not a binary32
        r = fmul(fmul(p, 2.0f), f32_from_bits(0x7F000000u));
    } else {
        r = fmul(p, f32_from_bits((uint32_t)(ji + 127) << 23));
    }
    if (r < f32_from_bits(0x00800000u)) return 0.0f;   // step 6: subnormal result -> +0
    return r;
}

// exp2s where steps 1, 5 and 6 cannot apply, x in [-126, 127.5): j ≤ 127, and p ≥ 1 when
// j = -126, so the result is normal. The P-scale mantissa of §7.4 (x in [0, 1)) calls it directly:
// no special-case branches for the warp.
__device__ __forceinline__ float exp2s_core(float x) {
    int ji;
    const float p = exp2s_poly(x, ji);
    return fmul(p, f32_from_bits((uint32_t)(ji + 127) << 23));
}

// §2 step 6 on a product: a ⊗ b, a subnormal result flushed to a zero of its sign (the kernel's one
// flushing instruction, marked in the PTX for the audit of tests/kernel/test_gpu_build.py; a subnormal input,
// which exp2s_nonpos never passes, would be flushed too).
__device__ __forceinline__ float fmul_step6(float a, float b) {
#ifdef APA_SIM
    const float r = a * b;
    return fabsf(r) < f32_from_bits(0x00800000u) ? copysignf(0.0f, r) : r;
#else
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2; // step 6\n" : "=f"(r) : "f"(a), "f"(b));
    return r;
#endif
}

// exp2s on x ≤ 0 or NaN (frame rescales, pass-2 probabilities; an FP16 score overflow makes
// inf - inf): steps 1 and 6 reduce to NaN → x, a select, and x < -126 → +0, which needs none: x is
// clamped to -127, where j = -127 makes the scale 2^(j + 127)'s bits 0 (+0), and on [-126.5, -126)
// j = -126 with p < 1 makes p ⊗ 2^j subnormal, which the flushing multiply returns as +0 (step 6).
// From -126 up p ⊗ 2^j is normal (p ≥ 1 when j = -126): the flush never acts there.
__device__ __forceinline__ float exp2s_nonpos(float x) {
    int ji;
    const float p = exp2s_poly(fmaxf(x, -127.0f), ji);
    const float r = fmul_step6(p, f32_from_bits((uint32_t)(ji + 127) << 23));
    return x != x ? x : r;
}

// Hardware exp2 of the fast mode (numerics.md §2 "fast", §13.2): MUFU.EX2 with flush to zero.
__device__ __forceinline__ float exp2_hw(float x) {
#ifdef APA_SIM
    // Not MUFU: the simulator has no special-function unit and refuses the fast mode
    // (apa_gpu/plan.py check_config); this stands in only so that the fast variants build.
    const float r = exp2f(x);
    return (r < f32_from_bits(0x00800000u)) ? 0.0f : r;
#else
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#endif
}

// The exp2 of the build: APA_EXP2_FAST=1 selects the hardware approximation.
#ifndef APA_EXP2_FAST
#define APA_EXP2_FAST 0
#endif
// SOFT: exp2s or one of its range-restricted forms above, for what the call site knows of x.
template <float (*SOFT)(float) = exp2s>
__device__ __forceinline__ float exp2x(float x) {
#if APA_EXP2_FAST
    return exp2_hw(x);
#else
    return SOFT(x);
#endif
}

// LG2[mi] = f32(log2(1 + mi/8)), mi = 0..8 (numerics.md §2.2): float64 log2 rounded once to
// binary32 (tests/kernel/test_gpu_formats.py compares this table with the emulator's).
__device__ __forceinline__ float lg2_table(int mi) {
    switch (mi) {
        case 0: return f32_from_bits(0x00000000u);
        case 1: return f32_from_bits(0x3E2E00D2u);
        case 2: return f32_from_bits(0x3EA4D3C2u);
        case 3: return f32_from_bits(0x3EEB3A9Fu);
        case 4: return f32_from_bits(0x3F15C01Au);
        case 5: return f32_from_bits(0x3F335004u);
        case 6: return f32_from_bits(0x3F4EAED0u);
        case 7: return f32_from_bits(0x3F6829FBu);
        default: return 1.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// binary16 (numerics.md §1.2, §1.6, §4.4): explicit .rn PTX, never contracted, subnormals kept.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint16_t h_bits(__half h) { return __half_as_ushort(h); }
__device__ __forceinline__ __half h_from_bits(uint16_t u) { return __ushort_as_half(u); }

// f16(x) from binary32: RNE, overflow to inf, subnormals kept (cvt.rn.f16.f32).
__device__ __forceinline__ __half f16(float x) {
#ifdef APA_SIM
    return h_from_bits(apa_sim::f16_bits_rn((double)x));
#else
    uint16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return h_from_bits(r);
#endif
}
// float(h): exact.
__device__ __forceinline__ float f32h(__half h) {
#ifdef APA_SIM
    return (float)apa_sim::f16_value(h_bits(h));
#else
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h_bits(h)));
    return r;
#endif
}
__device__ __forceinline__ __half hmul(__half a, __half b) {
#ifdef APA_SIM  // binary64 holds the exact product; one RNE to binary16
    return h_from_bits(apa_sim::f16_bits_rn(apa_sim::f16_value(h_bits(a)) * apa_sim::f16_value(h_bits(b))));
#else
    uint16_t r;
    asm("mul.rn.f16 %0, %1, %2;" : "=h"(r) : "h"(h_bits(a)), "h"(h_bits(b)));
    return h_from_bits(r);
#endif
}
__device__ __forceinline__ __half hsub(__half a, __half b) {
#ifdef APA_SIM  // binary64 holds the exact difference; one RNE to binary16
    return h_from_bits(apa_sim::f16_bits_rn(apa_sim::f16_value(h_bits(a)) - apa_sim::f16_value(h_bits(b))));
#else
    uint16_t r;
    asm("sub.rn.f16 %0, %1, %2;" : "=h"(r) : "h"(h_bits(a)), "h"(h_bits(b)));
    return h_from_bits(r);
#endif
}
// a*b + c rounded once to binary16 (numerics.md §4.4 step 3).
__device__ __forceinline__ __half hfma(__half a, __half b, __half c) {
#ifdef APA_SIM  // exact product, binary64 sum, one RNE to binary16: equal to the fused result (§4.4)
    return h_from_bits(apa_sim::f16_bits_rn(apa_sim::f16_value(h_bits(a)) * apa_sim::f16_value(h_bits(b)) +
                                            apa_sim::f16_value(h_bits(c))));
#else
    uint16_t r;
    asm("fma.rn.f16 %0, %1, %2, %3;" : "=h"(r) : "h"(h_bits(a)), "h"(h_bits(b)), "h"(h_bits(c)));
    return h_from_bits(r);
#endif
}
// Packed f16x2 helpers (u32 holds lo = element 0, hi = element 1).
__device__ __forceinline__ uint32_t pack_h2(__half lo, __half hi) {
    return (uint32_t)h_bits(lo) | ((uint32_t)h_bits(hi) << 16);
}
// Two f16(x) in one instruction (cvt.rn.f16x2.f32: the same RNE, element by element).
__device__ __forceinline__ uint32_t f16x2(float lo, float hi) {
#ifdef APA_SIM
    return pack_h2(f16(lo), f16(hi));
#else
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}
__device__ __forceinline__ __half h2_lo(uint32_t u) { return h_from_bits((uint16_t)(u & 0xFFFFu)); }
__device__ __forceinline__ __half h2_hi(uint32_t u) { return h_from_bits((uint16_t)(u >> 16)); }
// Elementwise binary16 operations on packed pairs, one rounding each: the scalar operations above,
// two per instruction (mul/sub/add/fma.rn.f16x2; min/max.f16x2 return the other operand of a NaN). The
// simulator applies the scalar operation to each half.
#ifdef APA_SIM
__device__ __forceinline__ __half sim_hadd(__half a, __half b) { return hsub(a, h_from_bits(h_bits(b) ^ 0x8000u)); }
__device__ __forceinline__ __half sim_hmin(__half a, __half b) { return f32h(a) != f32h(a) || f32h(b) < f32h(a) ? b : a; }
__device__ __forceinline__ __half sim_hmax(__half a, __half b) { return f32h(a) != f32h(a) || f32h(b) > f32h(a) ? b : a; }
#define APA_H2_OP(name, ptx, scalar)                                            \
    __device__ __forceinline__ uint32_t name(uint32_t a, uint32_t b) {          \
        return pack_h2(scalar(h2_lo(a), h2_lo(b)), scalar(h2_hi(a), h2_hi(b))); \
    }
#else
#define APA_H2_OP(name, ptx, scalar)                                   \
    __device__ __forceinline__ uint32_t name(uint32_t a, uint32_t b) { \
        uint32_t r;                                                    \
        asm(ptx " %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));            \
        return r;                                                      \
    }
#endif
APA_H2_OP(hmul2, "mul.rn.f16x2", hmul)
APA_H2_OP(hsub2, "sub.rn.f16x2", hsub)
APA_H2_OP(hadd2, "add.rn.f16x2", sim_hadd)
APA_H2_OP(hmin2, "min.f16x2", sim_hmin)
APA_H2_OP(hmax2, "max.f16x2", sim_hmax)
#undef APA_H2_OP
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
#ifdef APA_SIM
    return pack_h2(hfma(h2_lo(a), h2_lo(b), h2_lo(c)), hfma(h2_hi(a), h2_hi(b), h2_hi(c)));
#else
    uint32_t r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#endif
}

}  // namespace apa
