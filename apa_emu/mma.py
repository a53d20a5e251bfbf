"""Bit-exact models of the tensor-core MMA instructions (numerics.md §3).

One arithmetic primitive, the truncated fused dot-product-add `_fdpa` (docs/mma_models.md §1), is kept
apart from the table `INSTRUCTIONS` that binds each instruction to its parameters (F, e_zero, output
conversion, k per step, k per group). The chain drivers decode operands into (value, exponent) terms
for one step and hand them to the primitive; a chain is a left fold over steps in increasing k, each
step's rounded output being the next step's C (numerics.md §3).

Public entry points (all ``@njit``, callable from other njit code; they write into ``out``, and ``C``
may be the same array as ``out``):

* ``mma_sm90_f32(A, B, C, out)``  Hopper ``mma.sync.m16n8k16.f32.f16.f16.f32`` (numerics.md §3.1)
* ``mma_sm90_f16(A, B, C, out)``  Hopper ``mma.sync.m16n8k16.f16.f16.f16.f16`` (numerics.md §3.1)
* ``mma_sm90_e4m3(A, B, C, out)``  Hopper ``wgmma … k32.f32.e4m3.e4m3`` (numerics.md §16.7)
* ``mma_sm120(Acodes, Ascales, Bcodes, Bscales, C, out)``  sm_120 ``mxf4nvf4 … scale_vec::4X …
  ue4m3`` (numerics.md §3.2)
* ``mma_exact(A, B, C, out)``  binary64 chain rounded once (numerics.md §3.3)

Layout: ``out[m, n] = C[m, n] + Σ_k A[m, k]·B[n, k]``: B is stored row n = column n of the math B,
so both operands are read along contiguous k.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

# Output conversions ρ of mma_models.md §1.7.
RHO_RZ_FP32 = 0
RHO_RNE_FP16 = 1
RHO_RZ_E8M13 = 2  # Hopper FP8 wgmma: RZ to binary32 keeping 13 fraction bits (mma_models research note §5)


class Instr(NamedTuple):
    """Parameters of one instruction for the `_fdpa` primitive (mma_models.md §2)."""

    F: int  # fractional bits kept below the largest term exponent
    e_zero: int  # exponent given to a zero term
    rho: int  # output conversion, RHO_*
    L: int  # k per fused step
    G: int  # k per exactly-summed group (GST); 1 = every product is its own term


SM90_F32 = Instr(F=25, e_zero=-133, rho=RHO_RZ_FP32, L=16, G=1)
SM90_F16 = Instr(F=25, e_zero=-21, rho=RHO_RNE_FP16, L=16, G=1)
SM120_NVF4 = Instr(F=35, e_zero=-139, rho=RHO_RZ_FP32, L=64, G=16)
# Hopper wgmma e4m3·e4m3 → f32: one fused step of 32 products and C, F = 13, RZ-E8M13 (MMA-Sim's
# parameters; the note's §5, left out of docs/mma_models.md as not probed here: numerics.md §16.7).
SM90_E4M3 = Instr(F=13, e_zero=-133, rho=RHO_RZ_E8M13, L=32, G=1)

INSTRUCTIONS = {
    "sm90_f32": SM90_F32,  # mma.sync.m16n8k16.f32.f16.f16.f32
    "sm90_f16": SM90_F16,  # mma.sync.m16n8k16.f16.f16.f16.f16
    "sm90_e4m3": SM90_E4M3,  # wgmma.mma_async.sync.aligned.m64nNk32.f32.e4m3.e4m3
    "sm120_nvf4": SM120_NVF4,  # mma.sync.m16n8k64.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3
}

# Marks a zero term; `_fdpa` replaces any exponent below _ZERO_LIMIT by the instruction's e_zero. A
# zero operand carries _ZERO_TERM as its exponent, so a product's exponent sum marks itself without a
# test in the hot loop (the sum of two marks still fits easily in int64).
_ZERO_TERM = -(1 << 30)
_ZERO_LIMIT = -(1 << 28)

_TWO128 = np.float64(2.0**128)
_BIG = np.float64(1.0e300)  # above every finite term value, below inf
_F16_OVERFLOW = np.float64(65536.0)  # the first binade that FP16 cannot hold
_NAN32_BITS = 0x7FFFFFFF  # canonical FP32 NaN
_NAN16_AS32_BITS = 0x7FFFE000  # canonical FP16 NaN 0x7FFF, widened exactly to binary32

# E2M1 magnitudes in units of 1/2, indexed by code bits 2..0 (numerics.md §4.1).
_E2M1_HALVES = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Bit-level helpers. libm's frexp/ldexp/nextafter are opaque calls that cost more than the whole
# step, so exponents and powers of two are read and built from the bit patterns.
# ---------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _pow2(e):
    """2^e as binary64 for −1022 ≤ e ≤ 1023, exactly."""
    return np.uint64((e + 1023) << 52).view(np.float64)


@njit(cache=True, inline="always")
def _exp32(x, e_min):
    """Exponent of a nonzero finite binary32 x, at least the format's subnormal exponent e_min.

    mma_models.md §1.1: a subnormal keeps its smaller significand and takes the minimum normal
    exponent, so a binary32 subnormal (biased exponent 0) reads −127 and is lifted to e_min ≥ −126.
    """
    e = np.int64((np.float32(x).view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)) - 127
    return max(e, e_min)


@njit(cache=True, inline="always")
def _exp64(x):
    """floor(log2 |x|) of a nonzero normal binary64 x."""
    return np.int64((np.float64(x).view(np.uint64) >> np.uint64(52)) & np.uint64(0x7FF)) - 1023


# ---------------------------------------------------------------------------------------------
# Output conversions
# ---------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _rz_f32(x):
    """RZ of an exact nonzero binary64 value to binary32, overflow to ±inf at 2^128 (mma_models.md §1.7).

    IEEE RZ saturates at FLT_MAX; the tensor-core model normalises first and only then finds the
    exponent too large, hence the explicit 2^128 test.
    """
    if abs(x) >= _TWO128:
        return np.float32(np.inf) if x > 0 else np.float32(-np.inf)
    f = np.float32(x)
    # RNE and RZ differ by one step exactly when RNE moved away from zero; one step toward zero is
    # the magnitude bits minus one (this also takes +-inf back to +-FLT_MAX).
    if abs(np.float64(f)) > abs(x):
        f = np.uint32(f.view(np.uint32) - np.uint32(1)).view(np.float32)
    return f + np.float32(0.0)


@njit(cache=True, inline="always")
def _rne_f16(x):
    """RNE of an exact nonzero binary64 value to binary16, returned widened to binary32 (mma_models.md §4).

    Done on the exponent directly: a binary64 → binary32 → binary16 route would round twice.
    """
    e = max(_exp64(x), -14)  # FP16 subnormal quantum 2^-24
    # x / 2^(e-10) is exact and below 2^11; rint is ties-to-even.
    y = np.rint(x * _pow2(10 - e)) * _pow2(e - 10)
    if abs(y) >= _F16_OVERFLOW:
        return np.float32(np.inf) if y > 0 else np.float32(-np.inf)
    return np.float32(y) + np.float32(0.0)


@njit(cache=True, inline="always")
def _rz_e8m13(x):
    """RZ of an exact nonzero binary64 value to 14 significant bits (13 fraction bits, the low 10 of
    the binary32 result zero; Hopper FP8 wgmma), the quantum 2^(max(e, −126) − 13), then `_rz_f32`
    (exact here) for the overflow to ±inf."""
    e = max(_exp64(x), -126)
    return _rz_f32(np.trunc(x * _pow2(13 - e)) * _pow2(e - 13))


# ---------------------------------------------------------------------------------------------
# The primitive
# ---------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _fdpa(val, ex, n, F, e_zero, rho, may_be_special):
    """One truncated fused dot-product-add step (numerics.md §3.1, §3.2; mma_models.md §1).

    ``val[i]`` is the exact value of term i (binary64), ``ex[i]`` its alignment exponent as the
    instruction defines it (unnormalised), or anything below ``_ZERO_LIMIT`` for a term the
    instruction treats as zero, which then gets ``e_zero``. Every term is truncated toward zero to a multiple of 2^(E−F),
    E the largest exponent, the truncated terms are summed exactly and the sum is converted by ``rho``.
    Requires |val[i]| < 2^(ex[i]+63−F) for the integer sum (true for every instruction in the table).
    ``may_be_special`` False promises that every term is finite: the caller scans its operands once
    per call instead of every term being tested in the hot loop. Returns binary32 (FP16 results
    widened exactly).
    """
    E = _ZERO_TERM
    for i in range(n):
        e = ex[i]
        if e < _ZERO_LIMIT:
            e = e_zero
        E = max(E, e)
    if may_be_special:
        # A NaN or infinite term decides the result (inf + -inf and inf * 0 are NaN); the finite
        # terms are far too small to overflow binary64.
        naive = np.float64(0.0)
        for i in range(n):
            naive += val[i]
        if not math.isfinite(naive):
            if math.isnan(naive):
                if rho == RHO_RNE_FP16:
                    return np.uint32(_NAN16_AS32_BITS).view(np.float32)
                return np.uint32(_NAN32_BITS).view(np.float32)
            return np.float32(naive)
    scale = _pow2(F - E)
    s = 0
    for i in range(n):
        # Power-of-two scaling is exact; int() truncates toward zero, i.e. on the magnitude.
        s += int(val[i] * scale)
    if s == 0:
        return np.float32(0.0)
    x = np.float64(s) * _pow2(E - F)  # exact: |s| < 2^53, no underflow
    if rho == RHO_RNE_FP16:
        return _rne_f16(x)
    if rho == RHO_RZ_E8M13:
        return _rz_e8m13(x)
    return _rz_f32(x)


# ---------------------------------------------------------------------------------------------
# sm_90 f16 mma.sync (T-FDPA)
# ---------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _check_shapes(M, N, K, C, out, L):
    if K % L != 0:
        raise ValueError("mma: K must be a multiple of the instruction's k per step")
    if C.shape[0] != M or C.shape[1] != N or out.shape[0] != M or out.shape[1] != N:
        raise ValueError("mma: C and out must be [M, N]")


@njit(cache=True, inline="always")
def _t_fdpa_chain(A, B, C, out, F, e_zero, rho, L, c_emin, op_emin=-14):
    """Chain of T-FDPA steps of L products plus C (numerics.md §3.1; mma_models.md §3, §4).

    Products of FP16 (or E4M3) values are exact in binary64; each gets exponent e_a + e_b (not
    renormalised), a subnormal operand counting as ``op_emin`` (FP16 −14, E4M3 −6). C is decoded with
    subnormal exponent ``c_emin``.
    """
    M, K = A.shape
    N = B.shape[0]
    if B.shape[1] != K:
        raise ValueError("mma: A is [M, K] and B is [N, K]")
    _check_shapes(M, N, K, C, out, L)
    ea = np.empty((M, K), np.int64)
    eb = np.empty((N, K), np.int64)
    special = False
    for m in range(M):
        for k in range(K):
            ea[m, k] = _ZERO_TERM if A[m, k] == np.float32(0.0) else _exp32(A[m, k], op_emin)
            special |= not abs(A[m, k]) <= _BIG
    for j in range(N):
        for k in range(K):
            eb[j, k] = _ZERO_TERM if B[j, k] == np.float32(0.0) else _exp32(B[j, k], op_emin)
            special |= not abs(B[j, k]) <= _BIG
    val = np.empty(L + 1, np.float64)
    ex = np.empty(L + 1, np.int64)
    for m in range(M):
        for j in range(N):
            c = C[m, j]
            for k0 in range(0, K, L):
                for i in range(L):
                    # FP16 products are exact in binary64 and never underflow it.
                    val[i] = np.float64(A[m, k0 + i]) * np.float64(B[j, k0 + i])
                    ex[i] = ea[m, k0 + i] + eb[j, k0 + i]
                val[L] = np.float64(c)
                ex[L] = _ZERO_TERM if c == np.float32(0.0) else _exp32(c, c_emin)
                # C can turn infinite inside a chain (FP16 overflow), so it is tested every step.
                c = _fdpa(val, ex, L + 1, F, e_zero, rho, special or not abs(c) <= _BIG)
            out[m, j] = c


@njit(cache=True)
def mma_sm90_f32(A, B, C, out):
    """Hopper f16 ``mma.sync`` with FP32 accumulation, chained in k steps of 16 (numerics.md §3.1).

    A float32 [M, K] and B float32 [N, K] hold FP16 values (not checked); C, out float32 [M, N]
    (C may alias out); out[m, n] = C[m, n] + Σ_k A[m, k]·B[n, k]. K a multiple of 16.
    """
    _t_fdpa_chain(A, B, C, out, SM90_F32.F, SM90_F32.e_zero, SM90_F32.rho, SM90_F32.L, -126)


@njit(cache=True)
def mma_sm90_f16(A, B, C, out):
    """Hopper f16 ``mma.sync`` with FP16 accumulation, chained in k steps of 16 (numerics.md §3.1).

    As `mma_sm90_f32`, but C and out hold FP16 values in float32 arrays (C is decoded as FP16, subnormal
    exponent −14); each step rounds once RNE to FP16, 65520 and above to inf. A NaN result is written as
    0x7FFFE000, the exact widening of the canonical 0x7FFF.
    """
    _t_fdpa_chain(A, B, C, out, SM90_F16.F, SM90_F16.e_zero, SM90_F16.rho, SM90_F16.L, -14)


@njit(cache=True)
def mma_sm90_e4m3(A, B, C, out):
    """Hopper ``wgmma … k32.f32.e4m3.e4m3`` chained in k steps of 32 (numerics.md §16.7): A float32
    [M, K] and B float32 [N, K] hold E4M3 values (not checked), C, out float32 [M, N] (C may alias
    out); each step truncates every term to 13 bits below the largest and the sum RZ-E8M13.
    K a multiple of 32."""
    _t_fdpa_chain(A, B, C, out, SM90_E4M3.F, SM90_E4M3.e_zero, SM90_E4M3.rho, SM90_E4M3.L, -126, -6)


# ---------------------------------------------------------------------------------------------
# sm_120 mxf4nvf4 block-scale mma.sync (GST-FDPA)
# ---------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _decode_ue4m3(code):
    """UE4M3 scale → (value, exponent); the sign bit is ignored and 0x7F is NaN (numerics.md §4.2).

    The exponent is the scale's own (subnormal −6), which is what a GST group term is aligned by.
    """
    c = code & 0x7F
    if c == 0x7F:
        return np.float64(np.nan), np.int64(0)
    e = c >> 3
    mt = c & 7
    if e == 0:
        return np.float64(mt) * _pow2(-9), np.int64(-6)
    return np.float64(8 + mt) * _pow2(e - 10), np.int64(e - 7)


@njit(cache=True, inline="always")
def _gst_fdpa_chain(Acodes, Ascales, Bcodes, Bscales, C, out, F, e_zero, rho, L, G):
    """Chain of GST-FDPA steps: L/G groups of G E2M1 products plus C (numerics.md §3.2; mma_models.md §6).

    A group's products are summed exactly (integers in units of 1/4) and multiplied by the two scale
    values; the group term is aligned by the sum of the scale exponents only. A group whose products are
    all zero, or whose scale product is zero, is a zero term; a group that cancels to 0 is not.
    """
    M, K = Acodes.shape
    N = Bcodes.shape[0]
    if Bcodes.shape[1] != K:
        raise ValueError("mma_sm120: Acodes is [M, K] and Bcodes is [N, K]")
    _check_shapes(M, N, K, C, out, L)
    ng = K // G
    if Ascales.shape[0] != M or Ascales.shape[1] != ng or Bscales.shape[0] != N or Bscales.shape[1] != ng:
        raise ValueError("mma_sm120: scales must be [M, K/16] and [N, K/16]")
    qa = np.empty((M, K), np.int64)
    qb = np.empty((N, K), np.int64)
    for m in range(M):
        for k in range(K):
            c = Acodes[m, k]
            qa[m, k] = -_E2M1_HALVES[c & 7] if c & 8 else _E2M1_HALVES[c & 7]
    for j in range(N):
        for k in range(K):
            c = Bcodes[j, k]
            qb[j, k] = -_E2M1_HALVES[c & 7] if c & 8 else _E2M1_HALVES[c & 7]
    special = False  # a NaN scale (0x7F) is the only non-finite operand
    sa = np.empty((M, ng), np.float64)
    xa = np.empty((M, ng), np.int64)
    sb = np.empty((N, ng), np.float64)
    xb = np.empty((N, ng), np.int64)
    for m in range(M):
        for g in range(ng):
            sa[m, g], xa[m, g] = _decode_ue4m3(Ascales[m, g])
            special |= math.isnan(sa[m, g])
    for j in range(N):
        for g in range(ng):
            sb[j, g], xb[j, g] = _decode_ue4m3(Bscales[j, g])
            special |= math.isnan(sb[j, g])
    nt = L // G
    val = np.empty(nt + 1, np.float64)
    ex = np.empty(nt + 1, np.int64)
    for m in range(M):
        for j in range(N):
            c = C[m, j]
            for k0 in range(0, K, L):
                for t in range(nt):
                    g = k0 // G + t
                    s = 0
                    nonzero = False
                    for i in range(g * G, g * G + G):
                        p = qa[m, i] * qb[j, i]
                        s += p
                        nonzero = nonzero or p != 0
                    sc = sa[m, g] * sb[j, g]
                    val[t] = np.float64(s) * np.float64(0.25) * sc  # exact: ≤ 12 + 8 significant bits
                    ex[t] = xa[m, g] + xb[j, g] if nonzero and sc != np.float64(0.0) else _ZERO_TERM
                val[nt] = np.float64(c)
                ex[nt] = _ZERO_TERM if c == np.float32(0.0) else _exp32(c, -126)
                c = _fdpa(val, ex, nt + 1, F, e_zero, rho, special or not abs(c) <= _BIG)
            out[m, j] = c


@njit(cache=True)
def mma_sm120(Acodes, Ascales, Bcodes, Bscales, C, out):
    """sm_120 ``mma.sync.m16n8k64.kind::mxf4nvf4.block_scale.scale_vec::4X …ue4m3`` chained in k steps of 64.

    numerics.md §3.2. Acodes uint8 [M, K] and Bcodes uint8 [N, K] hold one E2M1 code per byte (bit 3
    sign, bits 7..4 ignored); Ascales uint8 [M, K/16], Bscales uint8 [N, K/16] UE4M3 codes (sign bit ignored); C, out
    float32 [M, N] (C may alias out). K a multiple of 64.
    """
    _gst_fdpa_chain(
        Acodes, Ascales, Bcodes, Bscales, C, out,
        SM120_NVF4.F, SM120_NVF4.e_zero, SM120_NVF4.rho, SM120_NVF4.L, SM120_NVF4.G,
    )


# ---------------------------------------------------------------------------------------------
# exact
# ---------------------------------------------------------------------------------------------


@njit(cache=True)
def mma_exact(A, B, C, out):
    """The ``exact`` model (numerics.md §3.3): binary64 chain in k order after C, one RNE to binary32.

    A float32 [M, K], B float32 [N, K] (any binary32 values, K any), C, out float32 [M, N] (C may alias
    out). A binary32 × binary32 product is exact in binary64; each addition rounds RNE in binary64.
    """
    M, K = A.shape
    N = B.shape[0]
    if B.shape[1] != K:
        raise ValueError("mma_exact: A is [M, K] and B is [N, K]")
    _check_shapes(M, N, K, C, out, 1)
    for m in range(M):
        for j in range(N):
            acc = np.float64(C[m, j])
            for k in range(K):
                acc = acc + np.float64(A[m, k]) * np.float64(B[j, k])
            out[m, j] = np.float32(acc)
