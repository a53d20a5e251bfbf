"""E2M1, E4M3/UE4M3 and UE8M0 codes and the NVFP4 block quantizer ``quant16`` (numerics.md §4).

Codes are plain uint8 values, one per element (E2M1 in the low nibble, bit 3 the sign), never
packed. The scalar functions are ``@njit(cache=True)`` so that the jitted prep can call them; the
block wrappers at the end take NumPy arrays. Binary32 arithmetic follows numerics.md §1 (one RNE
operation each, no FMA, float32 constants only).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .fpmath import f16_fma, f16r

# numerics.md §4.1: bit 3 is the sign, bits 2..0 index the magnitudes.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def _ue4m3_table():
    c = np.arange(128)
    e, m = c >> 3, c & 7
    v = np.where(e >= 1, np.ldexp(8.0 + m, e - 10), np.ldexp(m.astype(np.float64), -9))
    v[0x7F] = np.nan  # S.1111.111 is E4M3 (fn) NaN; UE4M3 stops at 0x7E (numerics.md §4.2)
    return v.astype(np.float32)


# dec(c) of numerics.md §4.2 for c = 0..0x7F.
_UE4M3_VALUES = _ue4m3_table()

_F32_SIX = np.float32(6.0)
_F32_ONE = np.float32(1.0)
_F32_ZERO = np.float32(0.0)
_F32_INF = np.float32(np.inf)
# Midpoints between neighbouring E2M1 magnitudes (numerics.md §4.1).
_T025, _T075, _T125, _T175, _T250, _T350, _T500 = (
    np.float32(t) for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
)
_RINT64 = 2.0**52  # adding 2⁵² rounds a binary64 in [0, 2⁵²) to an integer, ties to even

# numerics.md §4.4 step 3: the lsq candidates, in the order that decides ties.
_CANDIDATE_OFFSETS = np.array([0, -1, 1, -2, 3, 4, 5, 6], dtype=np.int64)


@njit(cache=True)
def e2m1_code(x):
    """e2m1(x) of numerics.md §4.1 as a code: clamp to ±6, RNE to the E2M1 grid, sign kept.

    The thresholds are the midpoints between grid values; ``<=`` at a midpoint sends it down and
    ``<`` sends it up, which is ties-to-even because the even neighbour alternates (0, 1, 2, 4, 4).
    """
    ax = abs(x)
    if ax <= _T025:
        m = 0
    elif ax < _T075:
        m = 1
    elif ax <= _T125:
        m = 2
    elif ax < _T175:
        m = 3
    elif ax <= _T250:
        m = 4
    elif ax < _T350:
        m = 5
    elif ax <= _T500:
        m = 6
    else:
        m = 7
    if math.copysign(1.0, x) < 0.0:
        m += 8
    return np.uint8(m)


@njit(cache=True)
def e2m1_round(x):
    """The value e2m1(x) of numerics.md §4.1, as float32."""
    return E2M1_VALUES[e2m1_code(x)]


@njit(cache=True)
def e4m3_code(x):
    """e4m3(x) of numerics.md §4.2 as a code: clamp to ±448, RNE with subnormals, sign bit kept.

    Rounding is done on binary64 by scaling with the power-of-two quantum (exact), so a binade
    carry (y = 16) lands on the next exponent's code by plain addition.
    """
    xd = np.float64(x)
    ax = min(abs(xd), 448.0)
    if ax < 2.0**-6:
        code = int((ax * 512.0 + _RINT64) - _RINT64)
    else:
        e = math.frexp(ax)[1]  # ax ∈ [2^(e−1), 2^e); biased exponent e + 6, quantum 2^(e−4)
        y = int((math.ldexp(ax, 4 - e) + _RINT64) - _RINT64)
        code = ((e + 6) << 3) + y - 8
    if math.copysign(1.0, xd) < 0.0:
        code |= 0x80
    return np.uint8(code)


@njit(cache=True)
def _e4m3_code_loop(x, out):
    for i in range(x.size):
        out[i] = e4m3_code(x[i])


def e4m3_codes(x):
    """``e4m3_code`` (numerics.md §4.2) of every element of a float32 array, same shape, uint8."""
    x = np.asarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.uint8)
    _e4m3_code_loop(np.ascontiguousarray(x).reshape(-1), out.reshape(-1))
    return out


def e4m3_values(codes):
    """E4M3 values of codes with their sign (numerics.md §4.2) as float32; 0x7F/0xFF are NaN."""
    codes = np.asarray(codes, dtype=np.uint8)
    v = _UE4M3_VALUES[codes & 0x7F]
    return np.where(codes & 0x80, -v, v)


@njit(cache=True)
def ue4m3_value(code):
    """dec(c) of numerics.md §4.2 as float32 (code 0..0x7E; the sign bit is ignored)."""
    return _UE4M3_VALUES[code & 0x7F]


@njit(cache=True)
def ue8m0_value(code):
    """UE8M0 value 2^(c−127) as float32, 0xFF NaN (numerics.md §4.3)."""
    if code == 0xFF:
        return np.float32(np.nan)
    return np.float32(math.ldexp(1.0, int(code) - 127))


@njit(cache=True)
def ue8m0_code(x):
    """UE8M0 code of the smallest power of two ≥ x, clamped to 2⁻¹²⁷..2¹²⁷; NaN → 0xFF (numerics.md §4.3).

    This is a ceiling, not the nearest power (ml_dtypes' cast rounds to nearest with ties up).
    """
    xd = np.float64(x)
    if xd != xd:
        return np.uint8(0xFF)
    if xd <= 2.0**-127:
        return np.uint8(0)
    if xd > 2.0**127:
        return np.uint8(0xFE)
    m, e = math.frexp(xd)
    k = e - 1 if m == 0.5 else e
    return np.uint8(k + 127)


@njit(cache=True)
def _lsq_error(xh, c):
    """err of candidate c in numerics.md §4.4 step 3, from the binary16 values xh."""
    sc = _UE4M3_VALUES[c]
    ivh = f16r(_F32_ONE / sc)
    e_low = _F32_ZERO
    e_high = _F32_ZERO
    for j in range(8):
        # xh·ivh has at most 22 significant bits and stays inside binary32's normal range, so the
        # float32 product is exact and f16r rounds it once, as the binary16 multiply does.
        a = f16r(xh[2 * j] * ivh)
        d = f16r(np.float64(e2m1_round(a)) - np.float64(a))
        e_low = f16_fma(d, d, e_low)
        a = f16r(xh[2 * j + 1] * ivh)
        d = f16r(np.float64(e2m1_round(a)) - np.float64(a))
        e_high = f16_fma(d, d, e_high)
    return ((e_low + e_high) * sc) * sc


@njit(cache=True)
def quant16(x, lsq, codes_out):
    """quant16 of numerics.md §4.4: writes 16 E2M1 codes into ``codes_out`` and returns sb.

    x: float32[16] (any 1-D view), lsq: True for ``lsq`` mode, False for ``nearest``.
    """
    am = _F32_ZERO
    for i in range(16):
        am = max(am, abs(x[i]))
    if am == _F32_ZERO:
        for i in range(16):
            codes_out[i] = 0
        return np.uint8(0)
    c0 = int(e4m3_code(am / _F32_SIX))
    sb = max(c0, 1)
    if lsq:
        xh = np.empty(16, dtype=np.float32)
        for i in range(16):
            xh[i] = f16r(x[i])
        best = _F32_INF
        for k in range(8):
            c = c0 + _CANDIDATE_OFFSETS[k]
            if c < 1 or c > 0x7E:
                continue
            err = _lsq_error(xh, c)
            if err < best:
                best = err
                sb = c
    inv = _F32_ONE / _UE4M3_VALUES[sb]
    for i in range(16):
        codes_out[i] = e2m1_code(x[i] * inv)
    return np.uint8(sb)


@njit(cache=True)
def _quantize_rows(x, lsq, codes, scales):
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 16):
            scales[r, b] = quant16(x[r, 16 * b : 16 * b + 16], lsq, codes[r, 16 * b : 16 * b + 16])


def quantize_blocks(x, lsq=True):
    """quant16 (numerics.md §4.4) over consecutive 16-element blocks of the last axis.

    x: float32 [..., 16k]. Returns (codes uint8 [..., 16k], scales uint8 [..., k]).
    """
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"quantize_blocks: expected float32, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % 16:
        raise ValueError(f"quantize_blocks: last axis must be a multiple of 16, got shape {x.shape}")
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = np.ascontiguousarray(x.reshape(-1, n))
    codes = np.empty(x2.shape, dtype=np.uint8)
    scales = np.empty((x2.shape[0], n // 16), dtype=np.uint8)
    _quantize_rows(x2, bool(lsq), codes, scales)
    return codes.reshape(*lead, n), scales.reshape(*lead, n // 16)


@njit(cache=True)
def _dequantize_rows(codes, scales, out):
    for r in range(codes.shape[0]):
        for i in range(codes.shape[1]):
            out[r, i] = E2M1_VALUES[codes[r, i] & 0xF] * _UE4M3_VALUES[scales[r, i // 16] & 0x7F]


def dequantize_blocks(codes, scales):
    """e2m1(code)·dec(sb) per element as float32 (numerics.md §4.4); exact (numerics.md §4.5).
    Written element by element into the result, so a long K or V needs no full-size temporaries."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    scales = np.ascontiguousarray(scales, dtype=np.uint8)
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] != 16 * scales.shape[-1]:
        raise ValueError(f"dequantize_blocks: codes {codes.shape} do not match scales {scales.shape}")
    out = np.empty(codes.shape, np.float32)
    n = codes.shape[-1] if codes.ndim else 0
    _dequantize_rows(codes.reshape(-1, n), scales.reshape(-1, n // 16), out.reshape(-1, n))
    return out
