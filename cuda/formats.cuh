// formats.cuh: E2M1, E4M3/UE4M3 and the block quantizer quant16 (docs/numerics.md §4).
#pragma once

#include "fpmath.cuh"
#ifndef APA_SIM
#include <cuda_fp8.h>
#endif

namespace apa {

// ---------------------------------------------------------------------------------------------
// E2M1 (numerics.md §4.1): clamp to [-6, 6], then RNE to the grid {0, .5, 1, 1.5, 2, 3, 4, 6} (ties
// 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). sm_90 has no e2m1 cvt instruction
// (research/peers.md §0.1). Only values are formed: every E2M1 value times a UE4M3 scale is exact in
// binary32 and binary16 (§4.5), so the kernel never needs the codes.
// ---------------------------------------------------------------------------------------------
// e2m1(x) as a binary32 value, sign kept (-0 for small negative x): |x| clamped at 6 (NaN too, as the
// clamp reads it), then ⊕ C ⊖ C with C = 2^(max(e, 0) + 22) for |x| = 1.m·2^e, whose ulp is the E2M1
// spacing at x (0.5 below 2, then 1, then 2): the add rounds to the grid RNE, as e2m1 ties, and the
// subtraction is exact. Subnormal x has e < 0: C = 2^22.
__device__ __forceinline__ float e2m1_round(float x) {
    const float a = fminf(fabsf(x), 6.0f);
    const float c = fmaxf(__uint_as_float((__float_as_uint(a) & 0x7F800000u) + (22u << 23)), f32_from_bits(0x4A800000u));
    return __uint_as_float(__float_as_uint(fsub(fadd(a, c), c)) | (__float_as_uint(x) & 0x80000000u));
}

// e2m1 of a pair of non-negative binary16 x < 2^22 (§4.1, clamp excepted: values above 6 stay above it)
// in binary16: e2m1_round's x ⊕ C ⊖ C with C = 2^(max(e, 0) + 9).
__device__ __forceinline__ uint32_t e2m1_grid_x2(uint32_t x) {
    const uint32_t c = hmax2((x & 0x7C007C00u) + 0x24002400u, 0x60006000u);  // exponent + 9, no carry out
    return hsub2(hadd2(x, c), c);
}

// e2m1(exp2s(y)) ⊗ sc from y alone (numerics.md §7.5, "thresholds"): exp2s splits the binary32 line
// at seven points, exp2s(y) crosses the k-th E2M1 midpoint exactly when y > T_k (verified over every
// binary32 y in [-2.5, 3] and by range outside it: tests/kernel/test_thresholds.py). So no exp2 per element.
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
// saturated at 6, times sc2 = (dec(kb), dec(kb)); the products are exact binary16.
__device__ __forceinline__ uint32_t e2m1_exp2_fast_x2(float y0, float y1, uint32_t sc2) {
#ifdef APA_SIM
    auto one = [](float y, __half sc) {
        const float x = f32h(f16(exp2_hw(f32h(f16(fminf(y, 4.0f))))));
        return h_bits(f16(fmul(e2m1_round(x), f32h(sc))));
    };
    return (uint32_t)one(y0, h2_lo(sc2)) | ((uint32_t)one(y1, h2_hi(sc2)) << 16);
#else
    uint32_t x;
    asm("ex2.approx.f16x2 %0, %1;" : "=r"(x) : "r"(hmin2(f16x2(y0, y1), 0x44004400u)));
    return hmul2(hmin2(e2m1_grid_x2(x), 0x46004600u), sc2);  // x ≤ 16; saturate at 6
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
// quant16 (numerics.md §4.4): 16 binary32 values (already divided by their global scale) to one UE4M3
// block scale sb, returned, and the values their E2M1 codes represent, q[i] = e2m1(code_i) ⊗ dec(sb)
// (exact, §4.5).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t quant16(const float (&x)[16], float (&q)[16], bool lsq) {
    // step 1
    float am = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) am = fmaxf(am, fabsf(x[i]));
    const uint32_t c0 = e4m3_code(fdiv(am, 6.0f));
    // step 2
    if (am == 0.0f) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = 0.0f;
        return 0;
    }
    uint32_t sb;
    if (!lsq) {
        // step 3, nearest
        sb = c0 == 0 ? 1u : c0;
    } else {
        // step 3, lsq: candidates c0+0, c0-1, c0+1, c0-2, c0+3, c0+4, c0+5, c0+6
        // The low and high halves of step 3 as the two elements of packed pairs, and |xh| for xh: a
        // sign flips a and e2m1(a) together, so d² is the same (e2m1 rounds ties symmetrically). The
        // clamp at 6 comes before the grid rounding, which keeps a finite a's exponent in its range.
        uint32_t xh2[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) xh2[j] = f16x2(x[2 * j], x[2 * j + 1]) & 0x7FFF7FFFu;
        // offsets {0, -1, 1, -2, 3, 4, 5, 6} + 2 as nibbles (no local-memory array)
        constexpr uint32_t OFFS = 0x87650312u;
        float best = pos_inf();
        sb = c0 == 0 ? 1u : c0;  // never kept: some candidate always has a finite error
#pragma unroll 1
        for (int k = 0; k < 8; ++k) {
            const int c = (int)c0 + (int)((OFFS >> (4 * k)) & 0xFu) - 2;
            if (c < 1 || c > 0x7E) continue;
            const float sc = ue4m3_dec((uint32_t)c);
            const uint32_t ivh2 = h_bits(f16(fdiv(1.0f, sc))) * 0x10001u;
            uint32_t e = 0u;  // (e_low, e_high)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const uint32_t a = hmul2(xh2[j], ivh2);
                const uint32_t d = hsub2(e2m1_grid_x2(hmin2(a, 0x46004600u)), a);
                e = hfma2(d, d, e);
            }
            const float err = fmul(fmul(fadd(f32h(h2_lo(e)), f32h(h2_hi(e))), sc), sc);
            if (err < best) {
                best = err;
                sb = (uint32_t)c;
            }
        }
    }
    // step 4
    const float sc = ue4m3_dec(sb), inv = fdiv(1.0f, sc);
#pragma unroll
    for (int i = 0; i < 16; ++i) q[i] = fmul(e2m1_round(fmul(x[i], inv)), sc);
    return sb;
}

}  // namespace apa
