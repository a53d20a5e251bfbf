"""The spec's binary32 constants, by bit pattern, and the per-call constants both the emulator and
the kernel derive from a Config (numerics.md §5.3, §7.4, §7.10). Written once; the launcher passes
the same values to the kernel."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

F32 = np.float32


def f32_bits(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(F32)[0]


LOG2E = f32_bits(0x3FB8AA3B)  # §5.3: qmul = f32(scale ⊗ LOG2E)
LOG2_1536 = f32_bits(0x41295C02)  # §7.4: f32(log2 1536)


class Pass1Consts(NamedTuple):
    """§7.4–7.10 constants of one config, as binary32 (the kernel's Pass1Params carries the same)."""

    eps: np.float32  # §7.7
    delta: np.float32  # §7.8
    tau: np.float32  # §7.2
    A: np.float32  # §7.4: 8 ⊖ τ
    L: np.float32  # §7.4: f32(log2 1536) ⊖ τ
    Kf: np.float32  # §7.10: f32(2^τ ⊘ 1536)


def pass1_consts(eps: float, delta: float, tau: int) -> Pass1Consts:
    t = F32(tau)
    return Pass1Consts(F32(eps), F32(delta), t, F32(8) - t, LOG2_1536 - t, F32(F32(2.0**tau) / F32(1536)))


def qmul(scale: np.float32) -> np.float32:
    """§5.3: the score multiplier f32(scale ⊗ LOG2E)."""
    return F32(F32(scale) * LOG2E)


class CertConsts(NamedTuple):
    """§9.7 constants of one config and head dim, as binary32 (the kernel's Pass2Args carries the same)."""

    sd: np.float32  # ≥ √d: 8, 12, 16
    cs: np.float32  # (d/16)·(2⁻¹¹ + 2⁻²⁰): pass 2's FP16 score chain
    c2: np.float32  # pass 2's output arithmetic per hot tile, times log₂e: 2⁻⁷ (FP16 O), 2⁻⁹ (binary32), 2⁻¹⁶ (exact)
    fast: np.float32  # 2⁻⁶ in the fast exp2 mode, else 0
    delta: np.float32  # §7.8 δ


class EstConsts(NamedTuple):
    """§9.8 constants of one config and head dim, powers of two as binary32 (Pass2Args carries the same)."""

    rho: np.float32  # E2M1 rounding variance of P̂ per P̂²: 2⁻⁷ (quantized P'), else 2⁻²⁵
    cs: np.float32  # pass 2's score chain per (log₂ score)²: (d/16)·2⁻²⁶, exact (d/16)·2⁻⁵⁰
    cp: np.float32  # P16 = f16(p) per p²: 2⁻²⁵, exact 0
    ca: np.float32  # pass 2's O accumulation per hot tile and ‖o2‖²: 2⁻²¹ (FP16 O), 2⁻⁴⁷ (binary32, exact)
    z: np.float32  # standard deviations: 2


def est_consts(d: int, p2_out: str, f16_scores: bool, quant_p: bool) -> EstConsts:
    """§9.8: p2_out is the pass-2 output format, "f16", "f32" or "exact"; f16_scores: §8.1's FP16 chain."""
    exact = p2_out == "exact"
    return EstConsts(F32(2.0**-7 if quant_p else 2.0**-25), F32(d // 16 * 2.0**(-26 if f16_scores else -50)),
                     F32(0.0 if exact else 2.0**-25), F32(2.0**(-21 if p2_out == "f16" else -47)), F32(2))


SQRT_D_UP = {64: 8, 128: 12, 256: 16}


def cert_consts(d: int, p2_out: str, f16_scores: bool, fast: bool, delta: float) -> CertConsts:
    """§9.7: p2_out is the pass-2 output format, "f16", "f32" or "exact"; f16_scores: §8.1's FP16 chain."""
    c2 = {"f16": 2.0**-7, "f32": 2.0**-9, "exact": 2.0**-16}[p2_out]
    cs = d // 16 * ((2.0**-11 if f16_scores else 0.0) + 2.0**-20)
    return CertConsts(F32(SQRT_D_UP[d]), F32(cs), F32(c2),
                      F32(2.0**-6 if fast else 0.0), F32(delta))


def _lower(flags, mode, *more, **rest):
    """The NamedTuple class ``mode`` (an emulator pass's switches) with each field these flags, or the
    flag tuples ``more``, name taken from them, the others from ``rest``: a flag reaches the emulator
    without being passed on."""
    named = {f: getattr(t, f) for t in (flags, *more) for f in t._fields if f in mode._fields}
    return mode(**named, **rest)


# The toggles a kernel reads at run time, lowered from a Config once (Config.prep_flags, pass1_flags,
# pass2_flags): the field names are the kernel structs' members (cuda/apa.cu PrepParams, cuda/pass1.cuh
# Pass1Args, cuda/pass2.cuh Pass2Args), and the emulator's P1Mode and P2Mode take theirs by name
# (``flags.lower(P1Mode, ...)``).
class PrepFlags(NamedTuple):
    """§5 toggles of the prep steps."""

    q_mode: int  # prep_q: 0 = NVFP4, 1 = FP8 E4M3, 2 = quantization off (§5.3)
    q_terms: int  # NVFP4 terms of Q: 1 or 2
    quant_k: bool  # §5.4
    quant_v: bool  # §5.5
    lsq: bool  # block scales by least squares, else nearest (§4.3)
    interleaved: bool  # P groups (§7.3): the keys' slot order in the images
    v_f16: bool  # §5.5: V ⊗ (1/vg) rounded to FP16 before quant16
    p2_lanes: bool  # §5.3: the pass-2 row shift in the seed's four lane sums (config p2_shift)
    pad_vote: bool  # §6.2: padding rows get row R − 1's Q̂ and c_q, to vote with
    fma: bool  # §1.8: the seed's FMA sites

    lower = _lower


Q_NVFP4, Q_FP8, Q_OFF = 0, 1, 2  # PrepFlags.q_mode


class Pass1Flags(NamedTuple):
    """§7 toggles of pass 1."""

    ascending: bool  # tile order (§6.4): diagonal, or ascending
    pow2: bool  # P scale kind (§7.4): ue4m3, or pow2
    interleaved: bool  # P groups (§7.3)
    quant_p: bool  # §7.5
    output: bool  # hot test (§7.7): the output test
    budget: bool  # hot test (§7.7): the budget test (neither: the mass test)
    fma: bool  # the seed's FMA sites (§1.8): §7.4 u₀, §7.5 y, §7.7, §7.8's la and lv
    pad_vote: bool  # padding rows vote (§6.2)
    direct: bool  # direct_store with pass 1 run (§9.5): a warp with no hot tile exports o ⊗ (vg ⊘ lc)

    lower = _lower


class Pass2Flags(NamedTuple):
    """§8–9 toggles of pass 2 and the merge."""

    all_hot: bool  # ε < 0 (§9.6): no pass 1, every active tile hot
    fma: bool  # the seed's FMA sites (§1.8): §8.1 x, §9.3–9.4
    direct: bool  # Pass1Flags.direct: a warp with no hot tile stores f16(part), not the merge (§9.5)

    lower = _lower


SM90, SM120, EXACT = 0, 1, 2  # ModelFlags.model: the MMA models of §3
MODELS = {"sm90": SM90, "sm120": SM120, "exact": EXACT}


class ModelFlags(NamedTuple):
    """The arithmetic models no kernel struct carries (Config.model_flags): the MMA, which only the
    emulator varies (apa_gpu runs SM90 alone), and the three the kernel is built with (apa_gpu/build.py
    Variant). P1Mode and P2Mode take them by name too (``flags.lower(P1Mode, model_flags, ...)``)."""

    model: int  # §3: SM90, SM120 (FP4 block-scaled, its codes kept) or EXACT (binary32 throughout)
    soft: bool  # §2: exp2s, else the fast mode (Variant exp2_fast)
    f32_out: bool  # §8.5: pass 2's O in binary32 (p2_accum "f32", Variant p2_f32), else FP16
    f32_scores: bool  # §8.1: pass 2's scores in binary32 (p2_scores "f32", Variant p2_s32), else FP16


class Flags(NamedTuple):
    """Every toggle of one Config, lowered once (Config.flags): what the emulator's prep and passes read."""

    prep: PrepFlags
    pass1: Pass1Flags
    pass2: Pass2Flags
    model: ModelFlags
