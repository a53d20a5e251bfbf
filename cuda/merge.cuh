// merge.cuh: the log-sum-exp merge of pass 1's and pass 2's results of one row, the row's
// output-error certificate and its error estimate (docs/numerics.md §9).
#pragma once

#include "fpmath.cuh"
#include "params.cuh"

namespace apa {

struct MergeWeights {
    float M, w1, w2, den, inv;
};

// §9.1–9.3: the weights of pass 1's (m1, l1) and pass 2's (m2, l2), their denominator (which the
// certificate reads) and the inverse of the output's, fused under config fma (§1.8).
__device__ __forceinline__ MergeWeights merge_weights(float m1, float l1, float m2, float l2, bool fused) {
    const float M = fmaxf(l1 > 0.0f ? m1 : neg_inf(), l2 > 0.0f ? m2 : neg_inf());  // §9.1: states with mass
    const float w1 = (l1 > 0.0f) ? exp2x(fsub(m1, M)) : 0.0f;         // §9.2
    const float w2 = (l2 > 0.0f) ? exp2x(fsub(m2, M)) : 0.0f;
    const float den = fadd(fmul(w1, l1), fmul(w2, l2));             // §9.3
    return {M, w1, w2, den, fdiv(1.0f, fused ? madd(w1, l1, fmul(w2, l2), true) : den)};
}

// §9.4 before its FP16 rounding: two adjacent output channels y from pass 1's part and pass 2's o2.
__device__ __forceinline__ float2 merge_y2(const MergeWeights& mw, float2 part, float o2a, float o2b, bool fused) {
    return make_float2(fmul(madd(mw.w1, part.x, fmul(mw.w2, o2a), fused), mw.inv),
                       fmul(madd(mw.w1, part.y, fmul(mw.w2, o2b), fused), mw.inv));
}

// §9.7 constants of a call (apa_emu.constants.CertConsts, by the same names).
#define APA_FIELDS_CertConsts(X)                                               \
    X(float, sd)    /* ≥ √d: 8, 12, 16 */                                      \
    X(float, cs)    /* (d/16)·(2⁻¹¹ + 2⁻²⁰): pass 2's FP16 score chain */      \
    X(float, c2)    /* pass 2's output arithmetic per hot tile, times log₂e */ \
    X(float, fast)  /* 2⁻⁶ in the fast exp2 mode, else 0 */                    \
    X(float, delta) /* §7.8 δ */
struct CertConsts {
    APA_FIELDS_CertConsts(APA_MEMBER)
};

// §9.7 inputs of one row besides its merge weights: pass 1's m1, l1, ad1 and pass 2's l2; the row's
// c_q and §5.7 statistics; the head's kn, ek, k2n, vn, ev; the row's first and last keys, the warp's
// hot tiles, and whether every channel of the FP16 output is finite.
struct CertRow {
    float m1, l1, ad1, l2, cq, qn, eq, q2n;
    float kn, ek, k2n, vn, ev;
    int lo, lim, nh;
    bool finite;
};

// §9.7 X(x) = ((exp2(x) ⊗ K_E) ⊖ 1) ⊕ 2⁻²⁰ ≥ 2ˣ − 1.
__device__ __forceinline__ float cert_expm1_up(float x) {
    return fadd(fsub(fmul(exp2x(x), f32_from_bits(0x3F800008u)), 1.0f), f32_from_bits(0x35800000u));
}

// §9.7 steps 1–11: the bound of ‖out − O‖₂.
__device__ __forceinline__ float merge_bound(const MergeWeights& mw, const CertRow& r, const CertConsts& k,
                                             float qmul) {
    const float one = 1.0f, p16 = f32_from_bits(0x37800000u), p20 = f32_from_bits(0x35800000u);
    const float G = f32_from_bits(0x39800000u);  // 2⁻¹²
    const float nt = (float)(r.lim / 64 - r.lo / 64 + 1), nv = (float)(r.lim - r.lo + 1), nh = (float)r.nh;
    const float lc = fmul(mw.w1, r.l1), lh = fmul(mw.w2, r.l2);  // step 1
    const float wa = (r.ad1 > 0.0f) ? exp2x(fsub(r.m1, mw.M)) : 0.0f;
    const float ad = fmul(wa, r.ad1);
    const float a1 = cert_expm1_up(fmul(fadd(nt, one), p16));  // step 2
    const float a2 = cert_expm1_up(fmul(nh, k.c2));
    const float b2 = cert_expm1_up(fmul(fadd(nh, one), p16));
    const float lcu = fmul(lc, fadd(one, a1)), lhu = fmul(lh, fadd(one, b2));
    const float e_d = fadd(fmul(a1, lc), fmul(b2, lh));
    const float b1 = fmul(r.cq, fmul(fadd(r.qn, r.eq), fadd(r.kn, r.ek)));  // step 3
    const float d1 = fadd(fadd(fmul(r.cq, fadd(fmul(r.qn, r.ek), fmul(r.eq, fadd(r.kn, r.ek)))),
                               fmul(G, fadd(fadd(b1, k.delta), 16.0f))),
                          fadd(fmul(nt, p20), k.fast));
    const float bb2 = fmul(qmul, fmul(r.q2n, r.k2n));  // step 4
    const float d2 = fadd(fadd(fmul(bb2, k.cs), fmul(G, fadd(fadd(bb2, bb2), 16.0f))), fadd(fmul(nh, p20), k.fast));
    const float g1 = cert_expm1_up(d1), g2 = cert_expm1_up(d2);  // step 5
    const float e = fadd(fadd(fadd(fmul(g1, lcu),
                                   fmul(fadd(g1, one), fadd(fmul(lcu, 0.25f), fmul(fmul(ad, 4.0f), fadd(one, a1))))),
                              fmul(g2, lhu)),
                         fmul(nv, f32_from_bits(0x0D800000u)));  // 2⁻¹⁰⁰ per key flushed by an exp2
    const float et = fadd(e, e_d);
    const float e_n = fadd(fmul(a1, fmul(lc, fadd(r.vn, r.ev))),  // step 6
                           fmul(a2, fadd(fmul(lh, r.vn), fmul(mw.w2, fmul(k.sd, f32_from_bits(0x38800000u))))));
    const float on = fdiv(fadd(fadd(fmul(lcu, fadd(r.vn, r.ev)), fmul(lhu, r.vn)), e_n), mw.den);  // step 7
    const float num = fadd(fadd(fmul(et, fadd(r.vn, on)), fmul(lcu, r.ev)), e_n);  // step 8
    const float den = fsub(fmul(mw.den, f32_from_bits(0x3F7FFF00u)), fmul(et, f32_from_bits(0x3F800080u)));
    const float fin = fadd(fmul(on, f32_from_bits(0x3A004000u)), fmul(k.sd, f32_from_bits(0x33000000u)));  // step 9
    const float triv = fadd(fadd(on, fin), r.vn);
    const float bound = fmul(den > 0.0f ? fminf(fadd(fdiv(num, den), fin), triv) : triv,  // step 10
                             f32_from_bits(0x3F800800u));
    const bool lost = !r.finite || (r.nh > 0 && fmul(r.q2n, r.k2n) >= 65504.0f);  // step 11
    return lost ? pos_inf() : bound;
}

// §9.8 constants of a call (apa_emu.constants.EstConsts, by the same names).
#define APA_FIELDS_EstConsts(X)                                                         \
    X(float, rho) /* E2M1 rounding variance of P̂ per P̂²: 2⁻⁷ (quant_p), else 2⁻²⁵ */    \
    X(float, cs)  /* pass 2's score chain per (log₂ score)² */                          \
    X(float, cp)  /* P16 = f16(p) per p² */                                             \
    X(float, ca)  /* pass 2's O accumulation per hot tile and ‖o2‖² */                  \
    X(float, z)   /* standard deviations: 2 */
struct EstConsts {
    APA_FIELDS_EstConsts(APA_MEMBER)
};

// §9.8 inputs of one row besides its merge weights: pass 1's ws1, pass 2's m2, l2, P2, the row's c_q,
// qn, eq, sh, the head's means km, ekm, vm, evm, the warp's hot tiles, the channel sums Q2 = ssq4(o2)
// and F2 = ssq4(out ⊖ y), and whether every channel of the FP16 output is finite.
struct EstRow {
    float ws1, m2, l2, p2, cq, qn, eq, sh;
    float km, ekm, vm, evm;
    float q2, f2;
    int nh;
    bool finite;
};

// §9.8 steps 1–2 (apa_emu/merge.py cold_kappa) for head dim DIM: κ, a cold key's numerator variance per
// unit P̂², and X = vm ⊗ vm; the estimate's, and the budget hot test's (§7.7, pass1.cuh p1_budget_beta).
template <int DIM>
__device__ __forceinline__ float est_cold_kappa(float cq, float qn, float eq, float km, float ekm, float vm, float evm,
                                                float rho, float& x) {
    const float a1 = fmul(eq, km), b1 = fmul(qn, ekm), cl = fmul(cq, f32_from_bits(0x3F317218u));  // step 1
    const float s1 = fmul(fmul(fadd(fmul(a1, a1), fmul(b1, b1)), fmul(cl, cl)), 2.0f / (float)DIM);  // exact: a power of two
    x = fmul(vm, vm);  // step 2
    return fadd(fmul(fadd(s1, rho), x), fmul(evm, evm));
}

// §9.8 steps 1–7: err_est, Z standard deviations of ‖out − O‖₂, for head dim DIM.
template <int DIM>
__device__ __forceinline__ float merge_estimate(const MergeWeights& mw, const EstRow& r, const EstConsts& k) {
    const float ln2 = f32_from_bits(0x3F317218u);
    float x;
    const float kappa = est_cold_kappa<DIM>(r.cq, r.qn, r.eq, r.km, r.ekm, r.vm, r.evm, k.rho, x);  // steps 1-2
    const float sc = r.l2 > 0.0f ? fabsf(fadd(r.m2, r.sh)) : 0.0f;  // step 3
    const float ls = fmul(ln2, sc);
    const float kappa2 = fmul(fadd(fmul(fmul(ls, ls), k.cs), k.cp), x);
    const float vc = fmul(fmul(mw.w1, mw.w1), fmul(r.ws1, kappa));  // step 5
    const float vh = fmul(fmul(mw.w2, mw.w2), fadd(fmul(r.p2, kappa2), fmul(fmul((float)r.nh, k.ca), r.q2)));
    const float est = fmul(k.z, fsqrt(fadd(fdiv(fadd(vc, vh), fmul(mw.den, mw.den)), r.f2)));  // step 6
    return r.finite && est == est ? est : pos_inf();  // step 7 (est != est: NaN)
}

}  // namespace apa
