"""The constants and head scales both sides take from Python, against the spec's own definitions.

A value the emulator and the kernel both read from ``apa_emu.constants`` (``Pass1Consts`` into
Pass1Args, ``CertConsts`` into Pass2Args, qmul) is invisible to the bitwise kernel-vs-emulator tests:
a wrong one is wrong on both sides alike. So each is pinned here to the formula or table of
``docs/numerics.md``, computed independently (binary64 and exact rationals, then one binary32
rounding). The mutants F4 (§9.7's C2 of FP16 and binary32 swapped) and N7 (kg without its K-mean
term, which a power-of-two scale hides from every comparison of outputs) are the reason."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from apa_emu import Config
from apa_emu.constants import LOG2_1536, LOG2E
from apa_emu.prep import prep_stats

F32 = np.float32


def f32(x: Fraction | float) -> np.float32:
    """A rational rounded to binary32 through binary64: one rounding for the values here, which are exact
    in binary64 or have a periodic binary expansion (a third), so never sit on a binary32 midpoint."""
    return F32(float(x))


def bits(x: np.float32) -> int:
    return int(np.asarray(x, F32).view(np.uint32))


def test_log2e_and_log2_1536_are_the_binary32_roundings():
    """§5.3 LOG2E = f32(log₂ e), §7.4 f32(log₂ 1536) = f32(9 + log₂ 3)."""
    assert bits(LOG2E) == bits(F32(1 / math.log(2)))
    assert bits(LOG2_1536) == bits(F32(9 + math.log2(3)))


@pytest.mark.parametrize("tau", range(9))
def test_pass1_constants_follow_section_7(tau):
    """§7.4 A = 8 ⊖ τ and L = f32(log₂ 1536) ⊖ τ; §7.10 Kf = f32(2^τ ⊘ 1536); ε, δ, τ as given."""
    k = Config(eps=0.003, delta=5.0, tau=tau).pass1_consts()
    assert (k.eps, k.delta, k.tau) == (F32(0.003), F32(5.0), F32(tau))
    assert bits(k.A) == bits(F32(8 - tau))
    assert bits(k.L) == bits(f32(Fraction(float(F32(9 + math.log2(3)))) - tau))
    assert bits(k.Kf) == bits(f32(Fraction(2**tau, 1536)))


def test_qmul_is_scale_times_log2e_rounded_once():
    """§5.3 qmul = f32(scale ⊗ LOG2E), the default scale 1/√d."""
    for d in (64, 128, 256):
        want = f32(Fraction(float(F32(1 / math.sqrt(d)))) * Fraction(float(F32(1 / math.log(2)))))
        assert bits(Config().qmul(d)) == bits(want)


# §9.7's table: SD ≥ √d; CS = (d/16)·(2⁻¹¹ + 2⁻²⁰); C2 = 2⁻⁷ (FP16 O), 2⁻⁹ (binary32 O), 2⁻¹⁶ (`exact`);
# F = 2⁻⁶ in the fast mode.
SPEC_SD = {64: 8, 128: 12, 256: 16}
SPEC_C2 = {"f16": 2.0**-7, "f32": 2.0**-9, "exact": 2.0**-16}


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("cfg,p2_out,fast,f16_scores", [
    (Config(), "f16", False, True),
    (Config(p2_accum="f32"), "f32", False, True),
    (Config(p2_scores="f32"), "f16", False, False),
    (Config(p2_scores="f32", p2_accum="f32"), "f32", False, False),
    (Config(mma="exact"), "exact", False, False),
    (Config(exp2="fast"), "f16", True, True),
    (Config(p2_accum="f32", exp2="fast", delta=3.0), "f32", True, True),
], ids=["f16", "f32", "s32", "s32-f32", "exact", "f16-fast", "f32-fast-delta3"])
def test_certificate_constants_follow_the_table_of_section_9_7(d, cfg, p2_out, fast, f16_scores):
    c = cfg.cert_consts(d)
    assert SPEC_SD[d] >= math.sqrt(d) and c.sd == F32(SPEC_SD[d])
    assert c.cs == f32(Fraction(d, 16) * ((Fraction(1, 2**11) if f16_scores else 0) + Fraction(1, 2**20)))
    assert c.c2 == F32(SPEC_C2[p2_out]), f"C2 of a {p2_out} pass-2 output"
    assert c.fast == F32(2.0**-6 if fast else 0.0)
    assert c.delta == F32(cfg.delta)


def _up2(x: float) -> float:
    """The least power of two ≥ x (§5.2's up2), by exponent arithmetic in binary64."""
    m, e = math.frexp(x)  # x = m·2^e, 0.5 ≤ m < 1
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


def test_key_scale_counts_the_key_mean_with_a_quiet_block():
    """§5.2 kg = up2(4·(amaxK + max|k̄|) ⊘ 2688) by hand: keys 12 + N(0, 1), S = 200, one quiet
    16-channel block (10⁻³·N(0, 1)). amaxK ≈ 15 and max|k̄| ≈ 12 give up2(0.04) = 2⁻⁴; without the mean
    term up2(0.022) = 2⁻⁵. A power-of-two kg cancels through the scores on ordinary keys, but not here:
    the quiet block's E4M3 block scales are subnormal, where RNE does not commute with ×2 — so the key
    image the kernel would see differs too, and only this statistic, checked directly, pins it."""
    rng = np.random.default_rng(7)
    k = (12 + rng.standard_normal((200, 1, 64))).astype(np.float16)
    k[:, :, :16] = (1e-3 * rng.standard_normal((200, 1, 16))).astype(np.float16)
    v = rng.standard_normal((200, 1, 64)).astype(np.float16)
    k64 = k.astype(np.float64)
    want = _up2(4 * (np.abs(k64).max() + np.abs(k64.mean(axis=0)).max()) / 2688)
    without_mean = _up2(4 * np.abs(k64).max() / 2688)
    assert (want, without_mean) == (2.0**-4, 2.0**-5)  # the case that tells them apart happened
    kmean, kg, vg = prep_stats(k, v)
    assert float(kg[0]) == want
    assert float(vg[0]) == _up2(4 * np.abs(v.astype(np.float64)).max() / 2688)
    # the quiet block's block scale am/6 ⊘ kg is subnormal in E4M3 (below 2⁻⁶) at either kg
    quiet = np.abs(k64[:, 0, :16] - k64[:, 0, :16].mean(axis=0)).max() / 6
    assert quiet / want < float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).smallest_normal)


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("quant_p", (True, False))
@pytest.mark.parametrize("cfg,p2_out,f16_scores", [
    (Config(), "f16", True), (Config(p2_accum="f32"), "f32", True), (Config(p2_scores="f32"), "f16", False),
    (Config(mma="exact"), "exact", False), (Config(mma="exact", p2_accum="f32"), "exact", False),
    (Config(mma="exact", p2_scores="f32"), "exact", False)],
    ids=["f16", "f32", "s32", "exact", "exact-f32", "exact-s32"])
def test_estimate_constants_follow_the_table_of_section_9_8(d, quant_p, cfg, p2_out, f16_scores):
    """§9.8's table by hand, exact fractions: ρ by quant_p, C_S by the score chain's format (2⁻²⁶ FP16,
    2⁻⁵⁰ binary32 and exact), C_P by the model, C_A by the pass-2 output format (2⁻²¹ FP16 O, 2⁻⁴⁷
    binary32 and exact O), Z = 2. The emulator and the kernel's Pass2Args take the same EstConsts, so no
    bitwise cross-check can see a wrong entry."""
    c = cfg.replace(quant_p=quant_p).est_consts(d)
    exact = p2_out == "exact"
    assert c.rho == f32(Fraction(1, 2**7) if quant_p else Fraction(1, 2**25))
    assert c.cs == f32(Fraction(d, 16) * Fraction(1, 2**26 if f16_scores else 2**50))
    assert c.cp == f32(Fraction(0) if exact else Fraction(1, 2**25))
    assert c.ca == f32(Fraction(1, 2**21) if p2_out == "f16" else Fraction(1, 2**47)), f"C_A of a {p2_out} output"
    assert c.z == F32(2)
