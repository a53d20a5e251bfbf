// formats.cuh: E2M1, E4M3/UE4M3 and the block quantizer quant16 (docs/numerics.md §4).
#pragma once

#include "fpmath.cuh"
#ifndef APA_SIM
#include <cuda_fp8.h>
#endif

namespace apa {

// ---------------------------------------------------------------------------------------------
// E2M1 (numerics.md §4.1). Code: bit 3 sign, bits 2..0 index into {0, .5, 1, 1.5, 2, 3, 4, 6}.
// Clamp to [-6, 6], then RNE to the grid: encoded by thresholds (ties 0.25->0, 0.75->1,
// 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; everything above 5 -> 6, which is the clamp).
// sm_90 has no e2m1 cvt instruction (research/peers.md §0.1).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t e2m1_code(float x) {
    uint32_t sign = __float_as_uint(x) >> 31;
    float a = fabsf(x);
    uint32_t idx;
    if (a <= 0.25f) idx = 0;
    else if (a < 0.75f) idx = 1;
    else if (a <= 1.25f) idx = 2;
    else if (a < 1.75f) idx = 3;
    else if (a <= 2.5f) idx = 4;
    else if (a < 3.5f) idx = 5;
    else if (a <= 5.0f) idx = 6;
    else idx = 7;
    return (sign << 3) | idx;
}

// The value of an E2M1 code as binary32 (exact; -0 for code 0x8).
__device__ __forceinline__ float e2m1_value(uint32_t code) {
    // magnitudes x2: {0, 1, 2, 3, 4, 6, 8, 12}
    const uint32_t twice = (0xC8643210u >> (4u * (code & 7u))) & 0xFu;
    float v = __fmul_rn((float)twice, 0.5f);
    return (code & 8u) ? -v : v;
}

// e2m1(x) as a value: the nearest grid value (numerics.md §4.1), sign kept (-0 for small negative x).
// The same thresholds as e2m1_code, selecting the value directly (no integer-to-float conversion).
__device__ __forceinline__ float e2m1_round(float x) {
    const float a = fabsf(x);
    const float v = a <= 0.25f ? 0.0f
                  : a < 0.75f  ? 0.5f
                  : a <= 1.25f ? 1.0f
                  : a < 1.75f  ? 1.5f
                  : a <= 2.5f  ? 2.0f
                  : a < 3.5f   ? 3.0f
                  : a <= 5.0f  ? 4.0f
                               : 6.0f;
    return __uint_as_float(__float_as_uint(v) | (__float_as_uint(x) & 0x80000000u));
}

// e2m1(exp2s(y)) ⊗ sc from y alone (numerics.md §7.5, "thresholds"): exp2s splits the binary32 line
// at seven points, exp2s(y) crosses the k-th E2M1 midpoint exactly when y > T_k (verified over every
// binary32 y in [-2.5, 3] and by range outside it: tests/test_thresholds.py). So no exp2 per element.
#define APA_E2M1_EXP2S_T0 0xC0000000u
#define APA_E2M1_EXP2S_T1 0xBED47FCFu
#define APA_E2M1_EXP2S_T2 0x3EA4D3C5u
#define APA_E2M1_EXP2S_T3 0x3F4EAECEu
#define APA_E2M1_EXP2S_T4 0x3FA934F1u
#define APA_E2M1_EXP2S_T5 0x3FE75767u
#define APA_E2M1_EXP2S_T6 0x40149A78u

// [y > t] as 0.0 or 1.0 in one saturated FMA, sat(y·2³⁰ − t·2³⁰): the FMA pipe issues twice as fast
// as the compare/select (ALU) pipe, which the rest of pass 1 already loads. Exact: one rounding of
// 2³⁰(y − t) keeps its sign and is 0 only when y == t, and a binary32 y above any T_k is at least
// 2⁻²⁵ above it (the spacing at T₂), so the product is ≥ 32 and saturates to 1.
__device__ __forceinline__ float step_above(float y, uint32_t t_bits) {
    const float big = f32_from_bits(0x4E800000u);               // 2^30
    const float nt = -__fmul_rn(f32_from_bits(t_bits), big);   // exact: a power-of-two scaling
#ifdef APA_SIM
    const float r = std::fmaf(y, big, nt);
    return r != r ? 0.0f : r < 0.0f ? 0.0f : r > 1.0f ? 1.0f : r;
#else
    float r;
    asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(y), "f"(big), "f"(nt));
    return r;
#endif
}

// The E2M1 value is the sum of its steps, 0.5 each up to 2, then 1, 1, 2: n/2 with n = Σ s_k w_k,
// w = 1, 1, 1, 1, 2, 2, 4. Every partial sum below is an integer ≤ 12 and n·(sc/2) with
// sc = dec(kb) ≥ 2⁻⁹ has at most 8 significant bits, so each operation is exact whatever the
// association: the tree (depth 4 instead of a chain of 7) is e2m1(exp2s(y)) ⊗ sc bit for bit.
// y is never NaN here (c_q > 0 is finite; a masked key has s = −inf, so y = −inf and every step
// is 0).
__device__ __forceinline__ float e2m1_exp2s_scaled(float y, float sc) {
    const float a = __fadd_rn(step_above(y, APA_E2M1_EXP2S_T0), step_above(y, APA_E2M1_EXP2S_T1));
    const float b = __fadd_rn(step_above(y, APA_E2M1_EXP2S_T2), step_above(y, APA_E2M1_EXP2S_T3));
    const float c = __fadd_rn(step_above(y, APA_E2M1_EXP2S_T4), step_above(y, APA_E2M1_EXP2S_T5));
    const float n = __fmaf_rn(step_above(y, APA_E2M1_EXP2S_T6), 4.0f, __fmaf_rn(c, 2.0f, __fadd_rn(a, b)));
    return __fmul_rn(n, __fmul_rn(sc, 0.5f));
}

// Fast mode (numerics.md §2, §7.5): the E2M1 values of a pair of y (two elements of one row and
// group) from the hardware exp2 of f16(min(y, 4)), rounded to the E2M1 grid in binary16 and
// saturated at 6, times sc2 = (dec(kb), dec(kb)); the products are exact binary16. Rounding:
// x ⊕ C ⊖ C with C = 2^(max(e, 0) + 9) for x = 1.m·2^e, whose ulp is the E2M1 spacing at x (0.5 below
// 2, then 1, then 2), RNE like e2m1(); x ≤ 16 keeps C's exponent field in range.
__device__ __forceinline__ uint32_t e2m1_exp2_fast_x2(float y0, float y1, uint32_t sc2) {
#ifdef APA_SIM
    auto one = [](float y, __half sc) {
        const float x = f32h(f16(exp2_hw(f32h(f16(fminf(y, 4.0f))))));
        return h_bits(f16(fmul(e2m1_round(x), f32h(sc))));
    };
    return (uint32_t)one(y0, h2_lo(sc2)) | ((uint32_t)one(y1, h2_hi(sc2)) << 16);
#else
    uint32_t y, x, c, r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(y1), "f"(y0));
    asm("min.f16x2 %0, %1, %2;" : "=r"(y) : "r"(y), "r"(0x44004400u));
    asm("ex2.approx.f16x2 %0, %1;" : "=r"(x) : "r"(y));
    c = (x & 0x7C007C00u) + 0x24002400u;  // exponent + 9 in each half: no carry out (x ≤ 16)
    asm("max.f16x2 %0, %1, %2;" : "=r"(c) : "r"(c), "r"(0x60006000u));  // at least 2^9
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(c));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(c));
    asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(0x46004600u));  // 6
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(sc2));
    return r;
#endif
}

// ---------------------------------------------------------------------------------------------
// E4M3 / UE4M3 (numerics.md §4.2).
// ---------------------------------------------------------------------------------------------
// e4m3(x): clamp to [-448, 448], RNE with subnormals. __NV_SATFINITE is exactly the clamp
// (research/peers.md §0.2: it equals clip + ml_dtypes on every finite value).
__device__ __forceinline__ uint32_t e4m3_code(float x) {
#ifdef APA_SIM
    return apa_sim::e4m3_code(x);
#else
    return (uint32_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
#endif
}

// dec(c) for UE4M3 codes 0..0x7E: 2^(e-7)(1 + m/8) for e = c>>3 >= 1, else m * 2^-9. Exact.
__device__ __forceinline__ float ue4m3_dec(uint32_t c) {
    uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
    if (e == 0) return __fmul_rn((float)m, f32_from_bits(0x3B000000u));  // m * 2^-9
    return f32_from_bits(((e - 7u + 127u) << 23) | (m << 20));
}

// Signed E4M3 value (sign bit 0x80), for the FP8 Q format (numerics.md §5.3).
__device__ __forceinline__ float e4m3_value(uint32_t c) {
    float v = ue4m3_dec(c & 0x7Fu);
    return (c & 0x80u) ? -v : v;
}

// ---------------------------------------------------------------------------------------------
// quant16 (numerics.md §4.4): 16 binary32 values (already divided by their global scale) to 16
// E2M1 codes and one UE4M3 block scale. Returns sb; codes[i] receive the E2M1 codes.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t quant16(const float (&x)[16], uint32_t (&codes)[16], bool lsq) {
    // step 1
    float am = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) am = fmaxf(am, fabsf(x[i]));
    const uint32_t c0 = e4m3_code(fdiv(am, 6.0f));
    // step 2
    if (am == 0.0f) {
#pragma unroll
        for (int i = 0; i < 16; ++i) codes[i] = 0;
        return 0;
    }
    uint32_t sb;
    if (!lsq) {
        // step 3, nearest
        sb = c0 == 0 ? 1u : c0;
    } else {
        // step 3, lsq: candidates c0+0, c0-1, c0+1, c0-2, c0+3, c0+4, c0+5, c0+6
        __half xh[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) xh[i] = f16(x[i]);
        // offsets {0, -1, 1, -2, 3, 4, 5, 6} + 2 as nibbles (no local-memory array)
        constexpr uint32_t OFFS = 0x87650312u;
        float best = pos_inf();
        sb = c0 == 0 ? 1u : c0;  // never kept: some candidate always has a finite error
#pragma unroll 1
        for (int k = 0; k < 8; ++k) {
            const int c = (int)c0 + (int)((OFFS >> (4 * k)) & 0xFu) - 2;
            if (c < 1 || c > 0x7E) continue;
            const float sc = ue4m3_dec((uint32_t)c);
            const float inv = fdiv(1.0f, sc);
            const __half ivh = f16(inv);
            __half e_lo = h_from_bits(0), e_hi = h_from_bits(0);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                {   // low half: even i
                    const __half a = hmul(xh[2 * j], ivh);
                    const __half q = f16(e2m1_round(f32h(a)));
                    const __half d = hsub(q, a);
                    e_lo = hfma(d, d, e_lo);
                }
                {   // high half: odd i
                    const __half a = hmul(xh[2 * j + 1], ivh);
                    const __half q = f16(e2m1_round(f32h(a)));
                    const __half d = hsub(q, a);
                    e_hi = hfma(d, d, e_hi);
                }
            }
            const float err = fmul(fmul(fadd(f32h(e_lo), f32h(e_hi)), sc), sc);
            if (err < best) {
                best = err;
                sb = (uint32_t)c;
            }
        }
    }
    // step 4
    const float inv = fdiv(1.0f, ue4m3_dec(sb));
#pragma unroll
    for (int i = 0; i < 16; ++i) codes[i] = e2m1_code(fmul(x[i], inv));
    return sb;
}

// The represented value e2m1(code) * dec(sb) (exact in binary32 and in binary16, §4.5).
__device__ __forceinline__ float q_value(uint32_t code, uint32_t sb) {
    return fmul(e2m1_value(code), ue4m3_dec(sb));
}

}  // namespace apa
