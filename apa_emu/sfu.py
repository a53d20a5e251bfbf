"""The GPU's approximate special-function instructions, bit for bit (numerics.md §13).

An instruction the hardware approximates is one op of its special-function unit (SFU), MUFU.EX2,
MUFU.EX2.F16 or MUFU.RCP, with IEEE binary32 multiplies and selects around it that ptxas adds (read
from the SASS of sm_90a, §13.1). Each op is a table of the hardware's own results over the few bits
it reads, measured on the GPU (apa_gpu/sfu.py, ``tools/sfu_check.py``); the ops around it are plain
binary32 arithmetic, as everywhere in the emulator. ``tools/sfu_check.py`` checks every function
against a GPU on every input (the binary32 unary ones on all 2³², the binary16 one on all 2¹⁶) and
division on 2³⁰ random pairs plus its special classes; ``tests/emu/test_sfu.py`` checks stored hardware
samples. numerics.md §13.6 says what has been confirmed on which GPU.

Scalar functions are Numba-compiled for the emulator's loops and take the table they read as an
argument (a module-level array would be frozen into every compiled caller); ``*_array`` apply one
to a NumPy array and give NaN results the hardware's NaN bits.
"""

from __future__ import annotations

import math
import os
import warnings
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
from numba import njit, prange

DATA = Path(__file__).with_name("data") / "sfu_sm90.npz"
FRACTION_BITS = 23  # MUFU.EX2 reads x as a fixed-point number with this many fraction bits (§13.2)
_NEG = 1 << FRACTION_BITS  # where the ex2 table's negative half starts
NAN_BITS = np.uint32(0x7FFFFFFF)  # every NaN the three ops and the multiplies around them return
F16_NAN_BITS = np.uint16(0x7FFF)

_TWO23 = 8388608.0
_MIN_NORMAL = 2.0**-126
_BIG = np.float32(2.0**126)
_SMALL = np.float32(2.0**-126)
_QUARTER = np.float32(0.25)
_HALF = np.float32(0.5)
_TWO24 = np.float32(16777216.0)
_ONE = np.float32(1.0)
_M126 = np.float32(-126.0)


class Tables(NamedTuple):
    """The measured tables (§13.2–13.4), as the functions below take them."""

    ex2: np.ndarray  # float32 [2²⁴]: MUFU.EX2 of f·2⁻²³, then of −k·2⁻²³; f, k = 0 .. 2²³ − 1
    rcp: np.ndarray  # float32 [2²³]: MUFU.RCP of 1 + m·2⁻²³, m = 0 .. 2²³ − 1
    ex2_f16: np.ndarray  # uint16 [2¹⁶]: MUFU.EX2.F16 of every binary16 bit pattern


_STORED = {"ex2": lambda t: t.ex2[:_NEG], "ex2n": lambda t: t.ex2[_NEG:], "rcp": lambda t: t.rcp}


def pack(t: Tables) -> dict:
    """The arrays of ``t`` as DATA stores them: the three monotone binary32 runs (EX2 on the positive
    and on the negative grid, RCP) as the int8 differences of their bits (a few MB compressed
    instead of 96)."""
    out = {"ex2_f16": t.ex2_f16}
    for name, run in _STORED.items():
        bits = run(t).view(np.uint32).astype(np.int64)
        step = np.diff(bits, prepend=0)
        if np.abs(step[1:]).max() > 127:
            raise ValueError(f"sfu: the {name} table is not smooth enough to store as int8 steps")
        out[name + "_first"], out[name + "_steps"] = bits[:1], step[1:].astype(np.int8)
    return out


def unpack(arrays) -> Tables:
    if "ex2n_first" not in arrays:
        raise ValueError("sfu: these tables lack MUFU.EX2 on negative inputs (ex2n, §13.2); measure them anew "
                         "with tools/sfu_check.py --measure")
    runs = {}
    for name in _STORED:
        first, steps = arrays[name + "_first"], arrays[name + "_steps"].astype(np.int64)
        runs[name] = np.concatenate([first, first + np.cumsum(steps)]).astype(np.uint32).view(np.float32)
    return Tables(np.concatenate([runs["ex2"], runs["ex2n"]]), runs["rcp"], np.asarray(arrays["ex2_f16"], np.uint16))


def tables(path: Path | str | None = None) -> Tables:
    """The tables of ``path``, else of ``$APA_SFU_TABLES`` (a file ``tools/sfu_check.py --measure``
    wrote on a GPU), else the package's (DATA), else, while the package holds none, ``standin()``."""
    given = path or os.environ.get("APA_SFU_TABLES")
    if given is None and not DATA.is_file():
        return _standin()
    return _load(Path(given or DATA))


@lru_cache(maxsize=None)
def _load(path: Path) -> Tables:
    if not path.is_file():
        raise FileNotFoundError(f"sfu: no special-function tables at {path} (tools/sfu_check.py --measure writes them)")
    with np.load(path) as z:
        return unpack(z)


def standin() -> Tables:
    """Tables of the correctly rounded exp2 and reciprocal at each table point: the model's structure
    (§13.2–13.4) with IEEE values in place of the hardware's, which differ by a few ulps."""
    f = np.arange(1 << FRACTION_BITS, dtype=np.float64) * 2.0**-FRACTION_BITS
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        ex2_f16 = np.exp2(h).astype(np.float16).view(np.uint16)
    ex2 = np.exp2(np.concatenate([f, -f])).astype(np.float32)
    return Tables(ex2, (1.0 / (1.0 + f)).astype(np.float32), ex2_f16)


@lru_cache(maxsize=None)
def _standin() -> Tables:
    warnings.warn("apa_emu.sfu: no measured special-function tables in the package: exp2='fast' runs on "
                  "stand-in tables (correctly rounded values; tools/sfu_check.py --measure writes real ones)",
                  stacklevel=3)
    return standin()


# ---- §13.2: MUFU.EX2 ------------------------------------------------------------------------


@njit(cache=True)
def mufu_ex2(x, ex2):
    """MUFU.EX2 (``ex2.approx.ftz.f32``): a subnormal x reads as 0; x ≥ 128 gives +inf; else |x| is
    truncated to a multiple of 2⁻²³, n + f·2⁻²³ with 0 ≤ f < 2²³, and the result is ex2[f]·2ⁿ for
    x ≥ 0, ex2[2²³ + f]·2⁻ⁿ (the table of −f·2⁻²³) for x < 0, flushed to +0 below 2⁻¹²⁶."""
    x = np.float32(x)
    if x != x:
        return x
    if abs(x) < _SMALL:
        return _ONE
    if x >= np.float32(128):
        return np.float32(np.inf)
    if x < np.float32(-127):
        return np.float32(0)
    fx = int(math.floor(abs(np.float64(x)) * _TWO23))
    n, f = fx >> FRACTION_BITS, fx & (_NEG - 1)
    r = np.float64(ex2[f]) * math.ldexp(1.0, n) if x >= 0 else np.float64(ex2[_NEG + f]) * math.ldexp(1.0, -n)
    return np.float32(r) if r >= _MIN_NORMAL else np.float32(0)


@njit(cache=True)
def ex2_approx(x, ex2):
    """``ex2.approx.f32``, as ptxas expands it: below −126 MUFU.EX2 of x ⊗ 0.5, squared,
    so that subnormal results are kept."""
    x = np.float32(x)
    if x >= _M126 or x != x:  # FSETP.GEU: NaN takes the unscaled path
        return mufu_ex2(x, ex2)
    r = mufu_ex2(x * _HALF, ex2)
    return r * r


# ---- §13.3: MUFU.RCP and division -----------------------------------------------------------


@njit(cache=True)
def mufu_rcp(x, rcp):
    """MUFU.RCP (``rcp.approx.ftz.f32``): ±0 and subnormals give ±inf, ±inf gives ±0; a normal
    x = ±2ᵉ·(1 + m·2⁻²³) gives ±rcp[m]·2⁻ᵉ, flushed to ±0 below 2⁻¹²⁶."""
    x = np.float32(x)
    if x != x:
        return x
    ax = abs(np.float64(x))
    if ax < _MIN_NORMAL:
        return np.float32(math.copysign(np.inf, x))
    if ax == np.inf:
        return np.float32(math.copysign(0.0, x))
    mant, e = math.frexp(ax)  # ax = mant·2^e, mant in [0.5, 1)
    m = int((mant * 2.0 - 1.0) * _TWO23)
    r = np.float64(rcp[m]) * math.ldexp(1.0, 1 - e)
    return np.float32(math.copysign(r if r >= _MIN_NORMAL else 0.0, x))


@njit(cache=True)
def rcp_approx(x, rcp):
    """``rcp.approx.f32``: x scaled by s = 2²⁴ below 2⁻¹²⁶ or 0.25 above 2¹²⁶ (else 1), then
    MUFU.RCP(x ⊗ s) ⊗ s."""
    x = np.float32(x)
    ax = abs(x)
    s = _TWO24 if ax < _SMALL else _ONE  # FSETP.GEU: NaN takes s = 1
    s = _QUARTER if ax > _BIG else s
    return s * mufu_rcp(x * s, rcp)


@njit(cache=True)
def div_full(a, b, rcp):
    """``div.full.f32``: a and b both ⊗ 0.25 when |b| > 2¹²⁶, both ⊗ 2²⁴ when |b| < 2⁻¹²⁶,
    then MUFU.RCP(b) ⊗ a."""
    a, b = np.float32(a), np.float32(b)
    ab = abs(b)
    if ab > _BIG:
        a, b = a * _QUARTER, b * _QUARTER
    if ab < _SMALL:  # FSETP.GEU: a NaN b is not scaled
        a, b = a * _TWO24, b * _TWO24
    return mufu_rcp(b, rcp) * a


# ---- §13.4: MUFU.EX2.F16 --------------------------------------------------------------------


@njit(cache=True)
def mufu_ex2_f16(h, ex2_f16):
    """MUFU.EX2.F16 (``ex2.approx.f16``, each half of ``ex2.approx.f16x2``) of binary16 bits h:
    the measured result's bits."""
    return ex2_f16[h & 0xFFFF]


# ---- arrays ---------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def _unary(x, op, t):
    out = np.empty(x.size, np.float32)
    for i in prange(x.size):
        if op == 0:
            out[i] = mufu_ex2(x[i], t)
        elif op == 1:
            out[i] = ex2_approx(x[i], t)
        elif op == 2:
            out[i] = mufu_rcp(x[i], t)
        else:
            out[i] = rcp_approx(x[i], t)
    return out


@njit(cache=True, parallel=True)
def _div(a, b, t):
    out = np.empty(a.size, np.float32)
    for i in prange(a.size):
        out[i] = div_full(a[i], b[i], t)
    return out


UNARY = {"ex2.approx.ftz.f32": (0, "ex2"), "ex2.approx.f32": (1, "ex2"), "rcp.approx.ftz.f32": (2, "rcp"),
         "rcp.approx.f32": (3, "rcp")}


def _nan_bits(r: np.ndarray) -> np.ndarray:
    bits = r.view(np.uint32)
    bits[np.isnan(r)] = NAN_BITS
    return r


def unary_array(name: str, x, t: Tables | None = None) -> np.ndarray:
    """The instruction ``name`` (a key of UNARY) on every element of a binary32 array."""
    op, table = UNARY[name]
    x = np.ascontiguousarray(x, np.float32)
    t = t or tables()
    return _nan_bits(_unary(x.ravel(), op, getattr(t, table))).reshape(x.shape)


def div_array(a, b, t: Tables | None = None) -> np.ndarray:
    """``div.full.f32`` elementwise over two binary32 arrays of one shape."""
    a, b = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32))
    t = t or tables()
    out = _div(np.ascontiguousarray(a).ravel(), np.ascontiguousarray(b).ravel(), t.rcp)
    return _nan_bits(out).reshape(a.shape)


def ex2_f16_array(h, t: Tables | None = None) -> np.ndarray:
    """``ex2.approx.f16`` of binary16 values (float16 array, or its uint16 bits): float16."""
    bits = np.asarray(h).view(np.uint16) if np.asarray(h).dtype == np.float16 else np.asarray(h, np.uint16)
    return (t or tables()).ex2_f16[bits].view(np.float16)
