"""Log-sum-exp merge of the pass-1 partial and the pass-2 state, and the output-error certificate
(numerics.md §9).

Every step is an elementwise binary32 operation on arrays of rows, so the vectorised form rounds
exactly as the per-row statements of the spec.
"""

from __future__ import annotations

import numpy as np

from . import fpmath
from .constants import CertConsts, EstConsts

F32 = np.float32
P16, P20, P25 = F32(2.0**-16), F32(2.0**-20), F32(2.0**-25)
K_E, G, ONE, SIXTEEN = F32(1 + 2.0**-20), F32(2.0**-12), F32(1), F32(16)
DEN_LO, DEN_HI, FIN, K_B = F32(1 - 2.0**-16), F32(1 + 2.0**-16), F32(2.0**-11 + 2.0**-20), F32(1 + 2.0**-12)
V_FLOOR, FLUSHED, F16_MAX = F32(2.0**-14), F32(2.0**-100), F32(65504)


def _weight(sum_, m, big, soft: bool):
    """(sum > 0) ? exp2(m ⊖ M) : 0 per row (§9.2, §9.7 step 1). exp2 of (−inf) − M is 0 either way; the
    guard also covers m = −inf with M = −inf."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(sum_ > 0, fpmath.exp2_np(np.where(sum_ > 0, m - big, F32(0)), soft), F32(0)).astype(F32)


def merge_weights(m1, l1, m2, l2, soft: bool):
    """§9.1–9.3 for arrays of rows: M, w1, w2 and the denominator (w1 ⊗ l1) ⊕ (w2 ⊗ l2)."""
    big = np.maximum(np.where(l1 > 0, m1, -np.inf), np.where(l2 > 0, m2, -np.inf)).astype(F32)  # §9.1
    w1, w2 = _weight(l1, m1, big, soft), _weight(l2, m2, big, soft)  # §9.2
    return big, w1, w2, w1 * l1 + w2 * l2


def merge(m1, l1, part, m2, l2, o2, soft: bool, fma: bool = False) -> np.ndarray:
    """§9 (every warp, §9.5) for arrays of rows: m/l [R], part/o2 [R, d] (binary32). Returns the FP16
    output [R, d]. ``fma``: the seed's fused denominator and numerator (§1.8)."""
    return merge_y(m1, l1, part, m2, l2, o2, soft, fma).astype(np.float16)  # §9.4


def merge_y(m1, l1, part, m2, l2, o2, soft: bool, fma: bool = False) -> np.ndarray:
    """§9.1–9.4 before the output's FP16 rounding: the binary32 rows y [R, d] that ``merge`` rounds."""
    _, w1, w2, den = merge_weights(m1, l1, m2, l2, soft)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # padding rows: 0/0
        if fma:
            den = fpmath.fma32_arrays(w1, l1, w2 * l2)
        inv = F32(1) / den  # §9.3
        if fma:
            w1b = np.ascontiguousarray(np.broadcast_to(w1[:, None], part.shape))
            num = fpmath.fma32_arrays(w1b, np.ascontiguousarray(part, F32), w2[:, None] * o2)
        else:
            num = w1[:, None] * part + w2[:, None] * o2
        return (num * inv[:, None]).astype(F32)


def _expm1_up(x, soft: bool):
    """§9.7 X(x) = ((exp2(x) ⊗ K_E) ⊖ 1) ⊕ 2⁻²⁰, an upper bound of 2ˣ − 1."""
    return (fpmath.exp2_np(x, soft) * K_E - ONE) + P20


def score_bounds(cq, qstat, kvstat, qmul, nt, nh, k: CertConsts):
    """§9.7 steps 3–4: Δ1 and Δ2 (log₂ units), bounds of a cold key's (pass 1) and a hot key's
    (pass 2) score error, per row."""
    qn, eq, q2n = (qstat[..., i] for i in range(3))
    kn, ek, k2n = (F32(x) for x in kvstat[:3])
    b1 = cq * ((qn + eq) * (kn + ek))
    d1 = (cq * ((qn * ek) + (eq * (kn + ek))) + G * ((b1 + k.delta) + SIXTEEN)) + (nt * P20 + k.fast)
    b2 = qmul * (q2n * k2n)
    d2 = (b2 * k.cs + G * ((b2 + b2) + SIXTEEN)) + (nh * P20 + k.fast)
    return d1, d2


def certificate(m1, l1, ad1, m2, l2, out, lo, lim, nh, cq, qstat, kvstat, qmul, k: CertConsts,
                soft: bool) -> np.ndarray:
    """§9.7 for arrays of rows: the bound of ‖out − O‖₂. out [R, d] is the FP16 output, lo and lim [R]
    the rows' first and last keys (§6.1), nh the warp's hot tiles, qstat [R, 3] = (qn, eq, q2n) and kvstat the
    head's §5.7 statistics (``prep.KV_STATS``; this reads kn, ek, k2n, vn, ev)."""
    X = lambda x: _expm1_up(x, soft)  # noqa: E731
    q2n, k2n, vn, ev = qstat[:, 2], F32(kvstat[2]), F32(kvstat[3]), F32(kvstat[4])
    lo, lim = np.asarray(lo, np.int64), np.asarray(lim, np.int64)
    nt, nv, nh = (lim // 64 - lo // 64 + 1).astype(F32), (lim - lo + 1).astype(F32), F32(nh)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        big, w1, w2, dn = merge_weights(m1, l1, m2, l2, soft)
        lc, lh = w1 * l1, w2 * l2  # step 1
        ad = _weight(ad1, m1, big, soft) * ad1
        a1, a2, b2 = X((nt + ONE) * P16), X(nh * k.c2), X((nh + ONE) * P16)  # step 2
        lcu, lhu, e_d = lc * (ONE + a1), lh * (ONE + b2), a1 * lc + b2 * lh
        d1, d2 = score_bounds(cq, qstat, kvstat, qmul, nt, nh, k)  # steps 3-4
        g1, g2 = X(d1), X(d2)  # step 5
        e = ((g1 * lcu + (g1 + ONE) * (lcu * F32(0.25) + (ad * F32(4)) * (ONE + a1))) + g2 * lhu) + nv * FLUSHED
        et = e + e_d
        e_n = a1 * (lc * (vn + ev)) + a2 * (lh * vn + w2 * (k.sd * V_FLOOR))  # step 6
        on = ((lcu * (vn + ev) + lhu * vn) + e_n) / dn  # step 7
        num = (et * (vn + on) + lcu * ev) + e_n  # step 8
        den = dn * DEN_LO - et * DEN_HI
        fin = on * FIN + k.sd * P25  # step 9
        triv = (on + fin) + vn
        bound = np.where(den > 0, np.minimum(num / den + fin, triv), triv) * K_B  # step 10
        lost = ~np.isfinite(out).all(axis=1) | ((nh > 0) & (q2n * k2n >= F16_MAX))  # step 11
        return np.where(lost, F32(np.inf), bound).astype(F32)


LN2 = F32(np.log(2))  # 0x3F317218


def ssq4(x) -> np.ndarray:
    """§9.8's channel sums of squares per row, in the kernel's fragment order: per lane t0 the channels
    8·dn + 2·t0 + e (dn, then e), then (s₀ ⊕ s₁) ⊕ (s₂ ⊕ s₃)."""
    x = np.asarray(x, F32)
    s = [np.zeros(x.shape[0], F32) for _ in range(4)]
    for t0 in range(4):
        for dn in range(x.shape[1] // 8):
            for e in range(2):
                c = 8 * dn + 2 * t0 + e
                s[t0] = s[t0] + x[:, c] * x[:, c]
    return (s[0] + s[1]) + (s[2] + s[3])


def cold_kappa(cq, qn, eq, kvstat, rho, d: int) -> tuple[np.ndarray, np.ndarray]:
    """§9.8 steps 1–2 for arrays of rows: X = vm ⊗ vm and κ, a cold key's numerator variance per unit P̂²
    (the estimate's, and the budget hot test's, §7.7)."""
    km, ekm, vm, evm = (F32(x) for x in kvstat[5:9])  # §5.7's means
    with np.errstate(over="ignore", invalid="ignore"):
        a1, b1, cl = eq * km, qn * ekm, cq * LN2  # step 1
        s1 = ((a1 * a1 + b1 * b1) * (cl * cl)) * F32(2.0 / d)
        x = vm * vm  # step 2
        return x, (s1 + rho) * x + evm * evm


def budget_beta(eps, cq, qn, eq, kvstat, rho, d: int) -> np.ndarray:
    """§7.7 βr = (ε ⊗ ε) ⊗ (X ⊘ κ) per row, +inf where κ = +0 (a budget nothing spends)."""
    x, kappa = cold_kappa(cq, qn, eq, kvstat, rho, d)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(kappa > 0, (F32(eps) * F32(eps)) * (x / kappa), F32(np.inf)).astype(F32)


def estimate_variances(m1, l1, ws1, m2, l2, p2, o2, nh, cq, qstat, kvstat, sh, k: EstConsts, soft: bool):
    """§9.8 steps 1–5 (less F2) for arrays of rows: the cold and hot keys' variances Vc and Vh and the
    denominator Dn, apart so that ``apa pair`` can say which part of err_est each side holds."""
    x, kappa = cold_kappa(cq, qstat[:, 0], qstat[:, 1], kvstat, k.rho, o2.shape[1])  # steps 1-2
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        _, w1, w2, dn = merge_weights(m1, l1, m2, l2, soft)
        sc = np.where(l2 > 0, np.abs(m2 + sh), F32(0)).astype(F32)  # step 3
        ls = LN2 * sc
        kappa2 = ((ls * ls) * k.cs + k.cp) * x
        q2 = ssq4(o2)  # step 4
        vc = (w1 * w1) * (ws1 * kappa)  # step 5
        vh = (w2 * w2) * (p2 * kappa2 + (F32(nh) * k.ca) * q2)
        return vc, vh, dn


def estimate(m1, l1, ws1, m2, l2, p2, o2, y, out, nh, cq, qstat, kvstat, sh, k: EstConsts, soft: bool) -> np.ndarray:
    """§9.8 for arrays of rows: err_est, Z standard deviations of ‖out − O‖₂ under independent
    zero-mean rounding and quantization errors. y [R, d] is the binary32 output that out rounds; sh
    [R] the rows' shifts (§5.3); qstat and kvstat as ``certificate``'s (this reads km, ekm, vm, evm)."""
    vc, vh, dn = estimate_variances(m1, l1, ws1, m2, l2, p2, o2, nh, cq, qstat, kvstat, sh, k, soft)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        f2 = ssq4(out.astype(F32) - y)  # step 4
        est = k.z * np.sqrt((vc + vh) / (dn * dn) + f2)  # step 6
        return np.where(np.isfinite(out).all(axis=1) & ~np.isnan(est), est, F32(np.inf)).astype(F32)  # step 7
