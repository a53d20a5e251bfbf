"""Scalar floating-point primitives of the APA numerics (numerics.md §1, §2, §4.4, §5.2).

Every helper is an ``@njit(cache=True)`` scalar function meant to be called from the jitted passes;
``exp2s_np`` is the vectorised twin of ``exp2s`` for tests and tools. All binary32 arithmetic is
one IEEE operation with RNE and no FMA (numerics.md §1.1): fastmath stays off and every constant
is a ``np.float32``, because Numba silently widens float32 to float64 next to a Python float or an
integer. Conversions to binary16 are done arithmetically on binary64
(exact scaling by powers of two, then one integer rounding), so nothing depends on Numba's float16
support.

Error of ``exp2s`` against f32 of the float64 exp2 (numerics.md §2.1), measured by
``tests/emu/test_fpmath.py`` (the [−1, 1] row by its ``slow`` test):

===============================================  =========  ===================================
inputs                                           max error  not correctly rounded
===============================================  =========  ===================================
every binary32 in [−1, 1]                        1 ulp      7 086 371 of 2 130 706 434 (0.33 %)
20 000 001 evenly spaced binary32 in [−126, 32]  1 ulp      2 148 552 (10.7 %)
===============================================  =========  ===================================

Integers −126 ≤ n ≤ 127 give 2ⁿ exactly (f = 0 and C0 = 1).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import sfu
from .sfu import mufu_ex2

# numerics.md §2 step 4: C0..C6, given as bits so that the constants are the kernel's exactly.
EXP2_COEFFS = np.array(
    [0x3F800000, 0x3F317218, 0x3E75FDEE, 0x3D63576B, 0x3C1D9662, 0x3AAFA26E, 0x39212C6C],
    dtype=np.uint32,
).view(np.float32)

# numerics.md §2.2: rounded once from binary64, so the table does not depend on a float32 log2.
LG2 = np.array([math.log2(1.0 + mi / 8.0) for mi in range(9)], dtype=np.float64).astype(np.float32)

_C0, _C1, _C2, _C3, _C4, _C5, _C6 = (np.float32(c) for c in EXP2_COEFFS)
_RND = np.float32(12582912.0)  # 1.5·2²³: adding it leaves x rounded to an integer (RNE) in binary32
_MIN_NORMAL = np.float32(2.0**-126)
_LO = np.float32(-126.0)
_HI = np.float32(128.0)
_TWO = np.float32(2.0)
_ZERO = np.float32(0.0)
_INF = np.float32(np.inf)
# 2^j for j = −126..127, exact powers of two: the "exponent bits" of numerics.md §2 step 5.
_POW2 = np.ldexp(np.float32(1.0), np.arange(-126, 128)).astype(np.float32)
_POW2_127 = np.float32(2.0**127)

_F16_MAX_HALFWAY = 65520.0  # the binary16 midpoint between 65504 and 2¹⁶: RNE sends it to inf
_F16_MIN_NORMAL = 2.0**-14
_RINT64 = 2.0**52  # adding 2⁵² rounds a binary64 in [0, 2⁵²) to an integer, ties to even


@njit(cache=True)
def exp2s(x):
    """The bit-exact software exp2 of numerics.md §2 (``soft``), binary32 → binary32."""
    x = np.float32(x)
    if x != x:
        return x
    if x < _LO:
        return _ZERO
    if x >= _HI:
        return _INF
    j = (x + _RND) - _RND
    f = x - j
    p = _C6
    p = (p * f) + _C5
    p = (p * f) + _C4
    p = (p * f) + _C3
    p = (p * f) + _C2
    p = (p * f) + _C1
    p = (p * f) + _C0
    ji = int(j)
    if ji == 128:
        # 2¹²⁸ is not a binary32; p < 1 here (f < 0), so doubling first stays exact.
        r = (p * _TWO) * _POW2_127
    else:
        r = p * _POW2[ji + 126]
    # numerics.md §2 step 6, kept because it is part of the definition the kernel also follows:
    # for x ≥ −126 it cannot fire (p ≥ 1 when j = −126, p > 2^−0.5 otherwise).
    if r < _MIN_NORMAL:
        return _ZERO
    return r


@njit(cache=True)
def exp2(x, ex2):
    """numerics.md §2: ``exp2s`` when ``ex2`` is empty (``soft``), else the fast mode's hardware exp2,
    MUFU.EX2 (§13.2) with its table ``ex2``."""
    if ex2.size == 0:
        return exp2s(x)
    return mufu_ex2(x, ex2)


_NO_TABLE = np.zeros(0, np.float32)


def ex2_tables(soft: bool) -> tuple[np.ndarray, np.ndarray]:
    """The MUFU.EX2 and MUFU.EX2.F16 tables that ``exp2`` and the fast quantized P' read (§13): empty
    for ``soft``."""
    if soft:
        return _NO_TABLE, _NO_TABLE.view(np.uint16)
    t = sfu.tables()
    return t.ex2, t.ex2_f16


def exp2s_np(a):
    """``exp2s`` (numerics.md §2) on a NumPy array, element by element bitwise equal to it.

    NumPy float32 array arithmetic is one RNE operation per element with no contraction, so the
    same sequence of binary32 operations gives the same bits.
    """
    x = np.asarray(a, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        j = (x + _RND) - _RND
        f = x - j
        p = np.full_like(x, _C6)
        for c in (_C5, _C4, _C3, _C2, _C1, _C0):
            p = (p * f) + c
        ji = np.clip(np.nan_to_num(j), -126, 128).astype(np.int64)
        r = np.where(ji == 128, (p * _TWO) * _POW2_127, p * _POW2[np.minimum(ji, 127) + 126])
        r = np.where(r < _MIN_NORMAL, _ZERO, r)
        r = np.where(x < _LO, _ZERO, r)
        r = np.where(x >= _HI, _INF, r)
        r = np.where(np.isnan(x), x, r)
    return r.astype(np.float32)


def exp2_np(a, soft):
    """``exp2`` (numerics.md §2) on a NumPy array: ``exp2s_np`` when ``soft``, else MUFU.EX2 (§13.2),
    element by element equal to the scalar ``exp2``."""
    if soft:
        return exp2s_np(a)
    return sfu.unary_array("ex2.approx.ftz.f32", a)


@njit(cache=True)
def f16r(x):
    """f16(x) of numerics.md §1.6 as a float32: RNE to binary16, overflow to ±inf, subnormals kept.

    The quantum of binary16 at |x| (2⁻²⁴ below 2⁻¹⁴, else 2^(e−11)) is a power of two, so scaling
    by it is exact in binary64 and a single integer RNE does the rounding. Accepts binary32 or
    binary64 input.
    """
    xd = np.float64(x)
    if xd != xd:
        return np.float32(xd)
    ax = abs(xd)
    if ax >= _F16_MAX_HALFWAY:
        return np.float32(math.copysign(np.inf, xd))
    if ax < _F16_MIN_NORMAL:
        quantum = 2.0**-24
    else:
        quantum = math.ldexp(1.0, math.frexp(ax)[1] - 11)
    # ax / quantum < 2¹¹ + 1, far below 2⁵², so the 2⁵² trick rounds it once, ties to even.
    y = (ax / quantum + _RINT64) - _RINT64
    return np.float32(math.copysign(y * quantum, xd))


@njit(cache=True)
def f16_bits(x):
    """The binary16 bits of x, a float32 that holds a binary16 value (f16r's results)."""
    xd = np.float64(x)
    sign = 0x8000 if xd < 0.0 or (xd == 0.0 and math.copysign(1.0, xd) < 0.0) else 0
    a = abs(xd)
    if a != a:
        return sign | 0x7E00
    if a == np.inf:
        return sign | 0x7C00
    if a < _F16_MIN_NORMAL:
        return sign | int(a * 16777216.0)  # 2²⁴: subnormal quanta
    m, e = math.frexp(a)  # a = m·2ᵉ, m in [0.5, 1)
    return sign | ((e + 14) << 10) | int((m * 2.0 - 1.0) * 1024.0)


@njit(cache=True)
def f16_value(h):
    """The binary16 of bits h as a float32 (NaN payloads are not kept)."""
    h = int(h)
    e, m = (h >> 10) & 31, h & 1023
    if e == 31:
        v = np.inf if m == 0 else np.nan
    elif e == 0:
        v = m * 2.0**-24
    else:
        v = math.ldexp(1024.0 + m, e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(cache=True)
def up2(x):
    """numerics.md §5.2 up2 for a normal binary32 x > 0: x if its fraction bits are zero, else the
    next power of two above x.

    For a normal binary32 the fraction bits are zero exactly when the frexp mantissa is 1/2. The
    callers' floor f32(1e−20) keeps x normal.
    """
    m, e = math.frexp(np.float64(x))
    if m == 0.5:
        return np.float32(x)
    return np.float32(math.ldexp(1.0, e))


@njit(cache=True)
def fma32(a, b, c):
    """The correctly rounded binary32 a·b + c, one rounding (numerics.md §1.8: the seed's FMA sites
    under config ``fma``). a·b of two binary32 is exact in binary64. TwoSum gives the binary64 sum s and
    its error; an inexact s is moved to its odd neighbour on the error's side (round to odd, which
    keeps the sticky information), and the one RNE cast to binary32 then rounds as a single
    operation would: binary64 carries more than 24 + 2 bits, also where the result is a binary32
    subnormal (normal in binary64)."""
    p = np.float64(a) * np.float64(b)
    c64 = np.float64(c)
    s = p + c64
    if not np.isfinite(s):
        return np.float32(s)
    v = s - p
    err = (p - (s - v)) + (c64 - v)
    if err != 0.0:
        m, e = math.frexp(s)
        if int(m * 9007199254740992.0) & 1 == 0:  # 2⁵³: the significand's last bit is 0
            s = np.nextafter(s, np.inf if err > 0.0 else -np.inf)
    return np.float32(s)


@njit(cache=True)
def fma32_arrays(a, b, c):
    """fma32 elementwise over three binary32 arrays of one shape (the merge's rows)."""
    out = np.empty(a.shape, np.float32)
    fa, fb, fc, fo = a.ravel(), b.ravel(), c.ravel(), out.ravel()
    for i in range(fa.size):
        fo[i] = fma32(fa[i], fb[i], fc[i])
    return out


@njit(cache=True)
def f16_fma(a, b, c):
    """f16(a·b + c) rounded once, for binary16 values held as float32 (numerics.md §4.4, the
    seed's ``__hfma2``).

    a·b is exact in binary64; the one binary64 rounding of the sum cannot change the binary16
    result (numerics.md §4.4 gives the argument), so f16r of the binary64 sum is the fused value.
    """
    return f16r(np.float64(a) * np.float64(b) + np.float64(c))
