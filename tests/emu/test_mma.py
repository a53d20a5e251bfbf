"""Tests of apa_emu.mma (numerics.md §3) against independent oracles.

* mmasim 2.1.1 (off-repo, torch): Hopper ``mma.sync.m16n8k16`` f16→f32 and f16→f16, and sm_120
  ``mxf4nvf4.block16 … ue4m3``, compared bit for bit on many input regimes;
* the targeted probes of ``docs/mma_models.md`` §8 with the values stated there;
* exact rationals (``fractions.Fraction``) for the ``exact`` model.

The default run draws ≥ 10^4 dot products per model; ``-m slow`` draws 10^6.
"""

from __future__ import annotations

import os

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hyp import examples

from apa_emu.mma import (
    INSTRUCTIONS,
    mma_exact,
    mma_sm90_f16,
    mma_sm90_f32,
    mma_sm120,
)

if os.environ.get("CI"):  # in CI a missing or renamed oracle is a failure, never a silent skip
    import mmasim.nv_ptx as mmasim_nv
    import torch
else:
    torch = pytest.importorskip("torch")
    mmasim_nv = pytest.importorskip("mmasim.nv_ptx")

_HOPPER_F32 = mmasim_nv.MMA("Hopper", "m16n8k16.f32.f16.f16.f32")
_HOPPER_F16 = mmasim_nv.MMA("Hopper", "m16n8k16.f16.f16.f16.f16")
_SM120_NVF4 = mmasim_nv.MMABlockScale(
    "RTX Blackwell", "m16n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.f32.ue4m3"
)

SEEDS = st.integers(0, 2**63 - 1)
_DOTS = (32, 32)  # M, N per example: 1024 dot products
_DOTS_SLOW = (128, 160)  # 20480 per example

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def ue4m3(c):
    """UE4M3 decode written independently of apa_emu (numerics.md §4.2), sign bit ignored."""
    c = np.asarray(c).astype(np.int64) & 0x7F
    e, m = c >> 3, c & 7
    return np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))


# ---------------------------------------------------------------------------------------------
# Oracles and runners
# ---------------------------------------------------------------------------------------------


def run_sm90(A16, B16, C, f16_out):
    """(emulator, mmasim) results for out = C + A·Bᵀ; A16 [M,K], B16 [N,K] float16, C f32 or f16."""
    out = np.empty(C.shape, np.float32)
    fn = mma_sm90_f16 if f16_out else mma_sm90_f32
    fn(A16.astype(np.float32), B16.astype(np.float32), np.ascontiguousarray(C, dtype=np.float32), out)
    op = _HOPPER_F16 if f16_out else _HOPPER_F32
    ref = op(torch.from_numpy(A16), torch.from_numpy(np.ascontiguousarray(B16.T)), torch.from_numpy(C)).numpy()
    return out, ref


def assert_same_sm90(A16, B16, C, f16_out):
    out, ref = run_sm90(A16, B16, C, f16_out)
    if f16_out:
        # The FP16 result is stored widened to binary32, so it must survive the round trip exactly.
        back = out.astype(np.float16)
        np.testing.assert_array_equal(back.astype(np.float32).view(np.uint32), out.view(np.uint32))
        got, want = back.view(np.uint16), ref.view(np.uint16)
    else:
        got, want = out.view(np.uint32), ref.view(np.uint32)
    bad = np.argwhere(got != want)
    assert bad.size == 0, (
        f"{len(bad)} of {got.size} differ; first at {tuple(bad[0])}: emulator {got[tuple(bad[0])]:#x} "
        f"mmasim {want[tuple(bad[0])]:#x}"
    )
    return got.size


def _pack_e2m1(codes):
    """mmasim unpacks two E2M1 per byte, the high nibble first."""
    return torch.from_numpy(((codes[:, 0::2] << 4) | codes[:, 1::2]).astype(np.uint8))


def assert_same_sm120(Ac, As, Bc, Bs, C):
    out = np.empty(C.shape, np.float32)
    mma_sm120(Ac, As, Bc, Bs, C, out)
    e4m3 = torch.float8_e4m3fn
    ref = _SM120_NVF4(
        _pack_e2m1(Ac),
        _pack_e2m1(Bc).T,
        torch.from_numpy(C),
        torch.from_numpy(As).view(e4m3),
        torch.from_numpy(np.ascontiguousarray(Bs.T)).view(e4m3),
    ).numpy()
    got, want = out.view(np.uint32), ref.view(np.uint32)
    bad = np.argwhere(got != want)
    assert bad.size == 0, (
        f"{len(bad)} of {got.size} differ; first at {tuple(bad[0])}: emulator {got[tuple(bad[0])]:#x} "
        f"mmasim {want[tuple(bad[0])]:#x}"
    )
    return got.size


# ---------------------------------------------------------------------------------------------
# Input regimes (numpy RNG seeded by Hypothesis)
# ---------------------------------------------------------------------------------------------


def f16_normal(rng, shape):
    return (rng.standard_normal(shape) * 2.0 ** int(rng.integers(-6, 7))).astype(np.float16)


def f16_wide(rng, shape, top=31):
    """Finite FP16 of every binade below biased exponent ``top``, subnormals and ±0 included."""
    bits = (rng.integers(0, 2, shape) << 15) | (rng.integers(0, top, shape) << 10) | rng.integers(0, 1024, shape)
    x = bits.astype(np.uint16).view(np.float16)
    return np.where(rng.random(shape) < 0.05, np.float16(0.0), x)


def f16_bits(rng, shape):
    """Uniform FP16 bit patterns: subnormals, ±0, ±inf and NaNs included."""
    return rng.integers(0, 1 << 16, shape).astype(np.uint16).view(np.float16)


def f16_nvfp4(rng, shape):
    """Scale-folded NVFP4 values e2m1 · ue4m3 per 16-block of k (numerics.md §4.5), exact in FP16."""
    codes = rng.integers(0, 16, shape)
    scales = rng.integers(1, 0x7F, (shape[0], shape[1] // 16))
    x = E2M1[codes] * np.repeat(ue4m3(scales), 16, axis=1)
    h = x.astype(np.float16)
    assert np.array_equal(h.astype(np.float64), x)
    return h


def f16_cancel_pair(rng, M, N, K):
    """A, B whose products cancel in pairs (a' = a, b' = −b), a few perturbed by one FP16 ulp so a
    residue ~2^-11 of the big terms survives, plus tiny terms; columns shuffled within each step."""
    A = f16_normal(rng, (M, K)).astype(np.float64) * 2.0**3
    B = f16_normal(rng, (N, K)).astype(np.float64)
    for k0 in range(0, K, 16):
        for i in range(6):
            a, b = k0 + 2 * i, k0 + 2 * i + 1
            A[:, b] = A[:, a]
            B[:, b] = -B[:, a]
            nudge = rng.random(M) < 0.4
            A[nudge, b] = np.nextafter(A[nudge, a].astype(np.float16), np.float16(np.inf)).astype(np.float64)
        tiny = slice(k0 + 12, k0 + 16)
        A[:, tiny] *= 2.0 ** -int(rng.integers(8, 30))
        perm = k0 + rng.permutation(16)
        A[:, k0:k0 + 16] = A[:, perm]
        B[:, k0:k0 + 16] = B[:, perm]
    return A.astype(np.float16), B.astype(np.float16)


F16_REGIMES = {"normal": f16_normal, "wide": f16_wide, "bits": f16_bits, "nvfp4": f16_nvfp4}


def c_operand(rng, regime, A16, B16, f16_out):
    """C of the given regime; "cancel" is minus the (binary64) value of the products, so the result
    is what the truncation left over."""
    M, N = A16.shape[0], B16.shape[0]
    dt = np.float16 if f16_out else np.float32
    if regime == "zero":
        return np.where(rng.random((M, N)) < 0.5, 0.0, -0.0).astype(dt)
    if regime == "normal":
        return (rng.standard_normal((M, N)) * 2.0 ** int(rng.integers(-8, 9))).astype(dt)
    if regime == "wide":
        if f16_out:
            return f16_wide(rng, (M, N))
        bits = (rng.integers(0, 2, (M, N)) << 31) | (rng.integers(0, 255, (M, N)) << 23) | rng.integers(0, 1 << 23, (M, N))
        return bits.astype(np.uint32).view(np.float32)
    if regime == "bits":
        if f16_out:
            return f16_bits(rng, (M, N))
        return rng.integers(0, 1 << 32, (M, N), dtype=np.uint64).astype(np.uint32).view(np.float32)
    if regime == "tiny":
        if f16_out:
            return (rng.integers(-1023, 1024, (M, N)) * 2.0**-24).astype(np.float16)
        return (rng.integers(-(1 << 23), 1 << 23, (M, N)) * 2.0**-149).astype(np.float32)  # subnormals
    if regime == "cancel":
        # Only input generation: an approximate sum is all this needs.
        with np.errstate(all="ignore"):
            s = A16.astype(np.float64) @ B16.astype(np.float64).T
            return np.nan_to_num(-s, nan=0.0, posinf=0.0, neginf=0.0).astype(dt)
    raise AssertionError(regime)


C_REGIMES = ["zero", "normal", "wide", "bits", "tiny", "cancel"]
C_FINITE = ["zero", "normal", "wide", "tiny", "cancel"]


# ---------------------------------------------------------------------------------------------
# sm90 random equality with mmasim, categories (a)–(f) of the brief
# ---------------------------------------------------------------------------------------------

MODELS90 = pytest.mark.parametrize("f16_out", [False, True], ids=["f32", "f16"])
# Every C regime runs for every operand regime (parametrised, so none is left to chance); Hypothesis
# draws the seeds and K. 2 examples × 1024 dot products per combination.
C_FINITE_P = pytest.mark.parametrize("c_reg", C_FINITE)


@MODELS90
@C_FINITE_P
@settings(deadline=None, max_examples=examples(2))
@given(seed=SEEDS, K=st.sampled_from([16, 32, 64]))
def test_sm90_normal(f16_out, c_reg, seed, K):
    """(a) random normal FP16 operands."""
    rng = np.random.default_rng(seed)
    A, B = f16_normal(rng, (_DOTS[0], K)), f16_normal(rng, (_DOTS[1], K))
    assert_same_sm90(A, B, c_operand(rng, c_reg, A, B, f16_out), f16_out)


@MODELS90
@C_FINITE_P
@pytest.mark.parametrize("top", [31, 4], ids=["all", "subnormal"])
@settings(deadline=None, max_examples=examples(2))
@given(seed=SEEDS, K=st.sampled_from([16, 32, 64]))
def test_sm90_wide(f16_out, c_reg, top, seed, K):
    """(b) finite FP16 operands of every binade, subnormals and zeros included (top = 4: mostly
    subnormals, whose alignment exponent is −14, not their own)."""
    rng = np.random.default_rng(seed)
    A, B = f16_wide(rng, (_DOTS[0], K), top), f16_wide(rng, (_DOTS[1], K), top)
    assert_same_sm90(A, B, c_operand(rng, c_reg, A, B, f16_out), f16_out)


@MODELS90
@C_FINITE_P
@settings(deadline=None, max_examples=examples(2))
@given(seed=SEEDS, K=st.sampled_from([16, 64, 128]))
def test_sm90_nvfp4(f16_out, c_reg, seed, K):
    """(c) scale-folded NVFP4 operands e2m1 · ue4m3 (numerics.md §4.5), as pass 1 feeds them."""
    rng = np.random.default_rng(seed)
    A, B = f16_nvfp4(rng, (_DOTS[0], K)), f16_nvfp4(rng, (_DOTS[1], K))
    assert_same_sm90(A, B, c_operand(rng, c_reg, A, B, f16_out), f16_out)


@MODELS90
@pytest.mark.parametrize("c_reg", C_REGIMES)
@settings(deadline=None, max_examples=examples(2))
@given(seed=SEEDS, K=st.sampled_from([16, 32]))
def test_sm90_random_bits(f16_out, c_reg, seed, K):
    """(d) uniform FP16 bit patterns (inf, NaN, subnormals); NaN results must be canonical."""
    rng = np.random.default_rng(seed)
    A, B = f16_bits(rng, (_DOTS[0], K)), f16_bits(rng, (_DOTS[1], K))
    assert_same_sm90(A, B, c_operand(rng, c_reg, A, B, f16_out), f16_out)


@MODELS90
@pytest.mark.parametrize("c_reg", ["zero", "cancel", "tiny", "normal"])
@settings(deadline=None, max_examples=examples(2))
@given(seed=SEEDS, K=st.sampled_from([16, 32, 64]))
def test_sm90_cancellation(f16_out, c_reg, seed, K):
    """(e) products that cancel in pairs, leaving what the F = 25 truncation decides."""
    rng = np.random.default_rng(seed)
    A, B = f16_cancel_pair(rng, _DOTS[0], _DOTS[1], K)
    assert_same_sm90(A, B, c_operand(rng, c_reg, A, B, f16_out), f16_out)


@MODELS90
@C_FINITE_P
@pytest.mark.parametrize("regime", ["normal", "nvfp4", "cancel"])
@pytest.mark.parametrize("K", [64, 128, 256])  # every chain length, pass 1's 8 steps (d = 128) included
@settings(deadline=None, max_examples=examples(1))
@given(seed=SEEDS)
def test_sm90_chained(f16_out, c_reg, regime, seed, K):
    """(f) chains of K/16 steps (K = 128 is pass 1's 8 steps), each step at its own scale so the
    running C is sometimes the largest term and sometimes truncated."""
    rng = np.random.default_rng(seed)
    M, N = _DOTS
    if regime == "cancel":
        A, B = f16_cancel_pair(rng, M, N, K)
    else:
        A, B = F16_REGIMES[regime](rng, (M, K)), F16_REGIMES[regime](rng, (N, K))
    steps = 2.0 ** rng.integers(-6, 5, K // 16)
    A = (A.astype(np.float64) * np.repeat(steps, 16)).astype(np.float16)
    assert_same_sm90(A, B, c_operand(rng, c_reg, A, B, f16_out), f16_out)


@pytest.mark.slow
@MODELS90
@settings(deadline=None, max_examples=examples(50))
@given(seed=SEEDS, a_reg=st.sampled_from(["normal", "wide", "bits", "nvfp4", "cancel"]),
       c_reg=st.sampled_from(C_REGIMES), K=st.sampled_from([16, 32, 64, 128]))
def test_sm90_sweep_slow(f16_out, seed, a_reg, c_reg, K):
    """10^6 dot products over all regimes (50 examples of 20480)."""
    rng = np.random.default_rng(seed)
    M, N = _DOTS_SLOW
    if a_reg == "cancel":
        A, B = f16_cancel_pair(rng, M, N, K)
    else:
        A, B = F16_REGIMES[a_reg](rng, (M, K)), F16_REGIMES[a_reg](rng, (N, K))
    assert_same_sm90(A, B, c_operand(rng, c_reg, A, B, f16_out), f16_out)


# ---------------------------------------------------------------------------------------------
# sm90 targeted probes (mma_models.md §8), one output element
# ---------------------------------------------------------------------------------------------

U = 2.0**7


def probe(a, b, c, f16_out=False, K=16):
    """Result of one dot product as (emulator value, emulator bits, mmasim bits); a, b padded with 0."""
    A = np.zeros((1, K), np.float16)
    B = np.zeros((1, K), np.float16)
    A[0, : len(a)] = a
    B[0, : len(b)] = b
    assert np.array_equal(A[0, : len(a)].astype(np.float64), np.asarray(a, np.float64), equal_nan=True), "a not FP16"
    assert np.array_equal(B[0, : len(b)].astype(np.float64), np.asarray(b, np.float64), equal_nan=True), "b not FP16"
    C = np.full((1, 1), c, np.float16 if f16_out else np.float32)
    assert C[0, 0] == c or math.isnan(c), "c not representable"
    out, ref = run_sm90(A, B, C, f16_out)
    if f16_out:
        return float(out[0, 0]), int(out.astype(np.float16).view(np.uint16)[0, 0]), int(ref.view(np.uint16)[0, 0])
    return float(out[0, 0]), int(out.view(np.uint32)[0, 0]), int(ref.view(np.uint32)[0, 0])


def check_probe(a, b, c, expected, f16_out=False, K=16):
    value, bits, ref_bits = probe(a, b, c, f16_out, K)
    assert bits == ref_bits, f"emulator {bits:#x} vs mmasim {ref_bits:#x}"
    if isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(value)
    else:
        assert value == expected and math.copysign(1.0, value) == math.copysign(1.0, expected), (value, expected)


@MODELS90
@pytest.mark.parametrize("x, expected", [(2.0**-10, 2.0**-10), (2.0**-11, 2.0**-11), (2.0**-12, 0.0)])
def test_probe1_alignment_width_products(f16_out, x, expected):
    """Probe 1: a = [U, U, x], b = [U, −U, 1], c = 0 keeps x down to 2^-11 only: F = 25."""
    check_probe([U, U, x], [U, -U, 1.0], 0.0, expected, f16_out)


@MODELS90
@pytest.mark.parametrize("c, expected", [(2.0**-11, 2.0**-11), (2.0**-12, 0.0)])
def test_probe2_alignment_width_c(f16_out, c, expected):
    """Probe 2: a = [U, U], b = [U, −U]: C = 2^-11 survives, 2^-12 does not."""
    check_probe([U, U], [U, -U], c, expected, f16_out)


@MODELS90
@pytest.mark.parametrize("frac, ulps", [(0.25, 0), (0.5, 0), (0.75, 0), (1.5, 1)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_probe3_truncation_direction(f16_out, frac, ulps, sign):
    """Probe 3: C = ±{0.25, 0.5, 0.75, 1.5}·2^-11 gives ±{0, 0, 0, 1} units of 2^-11: toward zero."""
    check_probe([U, U], [U, -U], sign * frac * 2.0**-11, sign * ulps * 2.0**-11 + 0.0, f16_out)


@MODELS90
def test_probe4_no_renormalisation(f16_out):
    """Probe 4: products with significand 2.25 keep exponent 14, so 2^-11 survives."""
    check_probe([1.5 * U, -1.5 * U, 2.0**-11], [1.5 * U, 1.5 * U, 1.0], 0.0, 2.0**-11, f16_out)


@MODELS90
def test_probe5_one_fused_group(f16_out):
    """Probe 5: 16 tiny products 2^-18 and c = 2^-18; a pair ±2^14 at any (i, j) gives 0, because all
    16 products and C are one fused step (Ampere's 2×8 would leave 8·2^-18). Same with C = +2^14 and
    one product −2^14."""
    t = 2.0**-9
    for i in range(16):
        for j in range(16):
            if i == j:
                continue
            a = [t] * 16
            b = [t] * 16
            a[i], b[i] = U, U
            a[j], b[j] = U, -U
            check_probe(a, b, 2.0**-18, 0.0, f16_out)
    for j in range(16):
        a = [t] * 16
        b = [t] * 16
        a[j], b[j] = U, -U
        check_probe(a, b, 2.0**14, 0.0, f16_out)


@MODELS90
def test_probe5_instruction_fold(f16_out):
    """Probe 5 across two chained steps (K = 32, tiny products everywhere but the big pair). Both big
    products in one step: that step returns 0 and the other step's 16·2^-18 (+ c when it is the first)
    survives. One in each step: each step truncates its tiny terms against 2^14 and the result is 0."""
    t = 2.0**-9
    c = 2.0**-18
    for i in range(32):
        for j in (0, 7, 15, 16, 23, 31):
            if i == j:
                continue
            a = [t] * 32
            b = [t] * 32
            a[i], b[i] = U, U
            a[j], b[j] = U, -U
            if i // 16 != j // 16:
                expected = 0.0
            elif i < 16:
                expected = 16 * 2.0**-18  # step 1 → +0, step 2 sums its 16 tiny products
            else:
                expected = 0.0  # step 1 → 17·2^-18, then truncated against ±2^14 in step 2
            check_probe(a, b, c, expected, f16_out, K=32)


@pytest.mark.parametrize("frac, ulps", [(0.25, 0), (0.5, 0), (0.75, 0), (1.5, 1)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_probe6_output_rz_f32(frac, ulps, sign):
    """Probe 6, FP32 out: ±(2^14 + x), x = {0.25, 0.5, 0.75, 1.5} ulp(2^14) → ±{0, 0, 0, 1} ulp (RZ)."""
    ulp = 2.0 ** (14 - 23)
    check_probe([U, frac * ulp], [sign * U, sign * 1.0], 0.0, sign * (2.0**14 + ulps * ulp))


@pytest.mark.parametrize("frac, ulps", [(0.25, 0), (0.5, 0), (0.75, 1), (1.5, 2)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_probe6_output_rne_f16(frac, ulps, sign):
    """Probe 6, FP16 out: the same at FP16 ulp(2^14) = 16 → ±{0, 0, 1, 2} ulp (RNE, ties to even)."""
    ulp = 2.0 ** (14 - 10)
    check_probe([U, frac * ulp], [sign * U, sign * 1.0], 0.0, sign * (2.0**14 + ulps * ulp), f16_out=True)


@pytest.mark.parametrize("tiny, ulps", [(2.0**-11, 1), (2.0**-12, 0)])
def test_probe6_rne_sticky_depth(tiny, ulps):
    """Probe 6, "RNE precision": 2^14 + 8 is an FP16 tie; a third product 2^-11 (= 2^(E−25)) breaks
    it upward, 2^-12 is truncated first and the tie goes to even."""
    check_probe([U, 8.0, tiny], [U, 1.0, 1.0], 0.0, 2.0**14 + ulps * 16.0, f16_out=True)


def test_probe8_e_zero_f16():
    """Probe 8: a = [2^-11, 0.25·2^-k], b = [2^-14, 2^-24], c = 0, FP16 out. The sum 2^-25 + 2^-(26+k)
    rounds to 2^-24 while the second product survives truncation at 2^(E−25) and to 0 (a tie) once
    it does not; the last surviving k gives E = −1 − k = e_zero = −21."""
    results = []
    for k in range(23):
        value, bits, ref_bits = probe([2.0**-11, 0.25 * 2.0**-k], [2.0**-14, 2.0**-24], 0.0, f16_out=True)
        assert bits == ref_bits
        results.append(value)
    last = max(k for k, v in enumerate(results) if v != 0.0)
    assert all(v == 2.0**-24 for v in results[: last + 1])
    assert all(v == 0.0 for v in results[last + 1 :])
    assert -1 - last == -21 == INSTRUCTIONS["sm90_f16"].e_zero


def test_probe8_e_zero_from_c_alone():
    """Probe 8 with C = 0 the only zero term: the other 14 products are nonzero (±2^-48 pairs, cut to 0
    at 2^-46), so the raised alignment exponent −21 can come from C alone."""
    pad_a = [2.0**-24] * 14
    pad_b = [2.0**-24, -(2.0**-24)] * 7
    for k, expected in ((20, 2.0**-24), (21, 0.0)):
        check_probe([2.0**-11, 0.25 * 2.0**-k] + pad_a, [2.0**-14, 2.0**-24] + pad_b, 0.0, expected, f16_out=True)


def test_f16_c_subnormal_exponent():
    """An FP16 subnormal C aligns at −14 too: C = 2^-23 sets E = −14 and cuts a product 2^-40 at 2^-39,
    so 2^-23 + 2^-25 stays an exact tie and rounds to even (2^-23); at −15 it would round up."""
    check_probe([2.0**-11, 2.0**-20], [2.0**-14, 2.0**-20], 2.0**-23, 2.0**-23, f16_out=True)


def test_probe8_e_zero_f32_unobservable():
    """Probe 8 for FP32 out needs products below 2^-133, which FP16 operands cannot make (their
    smallest exponent is −28); only an all-zero step sees e_zero = −133, and it returns +0."""
    check_probe([0.0, -0.0], [1.0, 1.0], -0.0, 0.0)
    check_probe([2.0**-24], [2.0**-24], 0.0, 2.0**-48)


@MODELS90
def test_probe9_signed_zero(f16_out):
    """Probe 9: an exact zero is +0, even from all −0 inputs or a cancelling sum."""
    check_probe([-0.0, -0.0], [-0.0, 0.0], -0.0, 0.0, f16_out)
    check_probe([-0.0], [1.0], -0.0, 0.0, f16_out)
    check_probe([1.0, 1.0], [1.0, -1.0], -0.0, 0.0, f16_out)
    check_probe([1.0], [-1.0], 1.0, 0.0, f16_out)


@MODELS90
def test_probe9_nan_inf(f16_out):
    """Probe 9: NaN is canonical (0x7FFFFFFF / 0x7FFF), inf propagates, inf·0 and inf − inf are NaN."""
    nan_bits = 0x7FFF if f16_out else 0x7FFFFFFF
    inf, nan = float("inf"), float("nan")
    for a, b, c in [([nan], [1.0], 0.0), ([1.0], [nan], 0.0), ([1.0], [1.0], nan),
                    ([inf], [0.0], 0.0), ([inf, inf], [1.0, -1.0], 0.0), ([inf], [-1.0], inf),
                    ([-inf], [-inf], -inf)]:
        _, bits, ref_bits = probe(a, b, c, f16_out)
        assert bits == ref_bits == nan_bits, (a, b, c, hex(bits), hex(ref_bits))
    check_probe([inf, 1.0], [1.0, 1.0], 0.0, inf, f16_out)
    check_probe([inf, 65504.0], [-2.0, 65504.0], 1.0, -inf, f16_out)
    check_probe([1.0], [1.0], -inf, -inf, f16_out)


@MODELS90
def test_probe9_subnormals_kept(f16_out):
    """Probe 9: subnormal inputs and outputs are not flushed."""
    check_probe([2.0**-24], [1.0], 0.0, 2.0**-24, f16_out)
    check_probe([2.0**-24, 2.0**-24], [-1.0, 0.5], 0.0, -(2.0**-25) if not f16_out else 0.0, f16_out)
    check_probe([2.0**-24], [0.75], 0.0, 2.0**-24 if f16_out else 0.75 * 2.0**-24, f16_out)
    if f16_out:
        check_probe([2.0**-20], [1.0], 2.0**-24, 17 * 2.0**-24, True)
    else:
        check_probe([0.0], [0.0], 2.0**-149, 2.0**-149)  # binary32 subnormal C, exponent −126
        # A product of two FP16 subnormals has exponent −28: C = −2^-149 is below 2^(−28−25), cut to 0.
        check_probe([2.0**-24], [2.0**-24], -(2.0**-149), 2.0**-48)


def test_fp16_subnormal_operand_exponent():
    """mma_models.md §1.1: an FP16 subnormal aligns with exponent −14. 2^-24·1 then has exponent −14
    and cuts at 2^-39, so a second product 2^-40 is lost; with −15 (or its true −24) it would stay."""
    check_probe([2.0**-24, 2.0**-20], [1.0, 2.0**-20], 0.0, 2.0**-24)
    check_probe([2.0**-24, 2.0**-19], [1.0, 2.0**-20], 0.0, 2.0**-24 + 2.0**-39)


def test_probe9_f16_overflow():
    """FP16 out: a sum of 65520 or more (after rounding) is inf; 65512 rounds to 65504."""
    check_probe([65504.0, 16.0], [1.0, 1.0], 0.0, float("inf"), f16_out=True)
    check_probe([65504.0, 8.0], [1.0, 1.0], 0.0, 65504.0, f16_out=True)
    check_probe([-65504.0, -16.0], [1.0, 1.0], 0.0, float("-inf"), f16_out=True)
    check_probe([256.0], [256.0], 0.0, float("inf"), f16_out=True)


def test_f32_c_dominates_and_truncates():
    """FP32 C is kept whole when it is the largest term (25 ≥ 24 bits) and cut when products dominate."""
    c = 1.0 + 2.0**-23
    check_probe([1.0], [2.0**-10], c, float(np.float32(c + 2.0**-10)))
    check_probe([U], [U], c, 2.0**14 + 1.0)  # 2^-23 is below 2^(14−25)


# ---------------------------------------------------------------------------------------------
# sm120 (GST-FDPA) random equality with mmasim
# ---------------------------------------------------------------------------------------------


def sm120_operands(rng, regime, M, N, K):
    Ac = rng.integers(0, 16, (M, K)).astype(np.uint8)
    Bc = rng.integers(0, 16, (N, K)).astype(np.uint8)
    As = rng.integers(1, 0x7F, (M, K // 16)).astype(np.uint8)
    Bs = rng.integers(1, 0x7F, (N, K // 16)).astype(np.uint8)
    if regime == "zeros":
        # Zero codes (±0), whole zero groups and zero scales: the e_zero = −139 rules.
        Ac[rng.random((M, K)) < 0.6] = rng.choice([0, 8])
        Bc[rng.random((N, K)) < 0.6] = 0
        Ac[:, : K // 2][rng.random((M, K // 2)) < 0.5] = 0
        As[rng.random(As.shape) < 0.2] = 0
        Bs[rng.random(Bs.shape) < 0.2] = rng.choice([0, 0x80])
    elif regime == "cancel":
        # Each group cancels in pairs (b' = −b), some exactly, so zero-valued groups keep their exponent.
        Bc[:, 1::2] = Bc[:, 0::2] ^ 8
        Ac[:, 1::2] = np.where(rng.random((M, K // 2)) < 0.7, Ac[:, 0::2], Ac[:, 1::2])
    elif regime == "signed_scales":
        # The sign bit of a UE4M3 scale is ignored.
        As |= (rng.integers(0, 2, As.shape) << 7).astype(np.uint8)
        Bs |= (rng.integers(0, 2, Bs.shape) << 7).astype(np.uint8)
    elif regime == "spread":
        # Scales far apart, so the F = 35 truncation and the scale-only exponent matter.
        As = rng.choice(np.array([1, 2, 7, 8, 9, 0x40, 0x7E], np.uint8), As.shape)
        Bs = rng.choice(np.array([1, 3, 8, 0x38, 0x70, 0x7E], np.uint8), Bs.shape)
    elif regime == "tiny_scales":
        # Subnormal and smallest normal scales: the subnormal scale exponent −6 sets E.
        As = rng.integers(1, 16, As.shape).astype(np.uint8)
        Bs = rng.integers(1, 16, Bs.shape).astype(np.uint8)
    elif regime == "nan_scale":
        As[rng.random(As.shape) < 0.02] = 0x7F
    return Ac, As, Bc, Bs


def sm120_c(rng, regime, M, N):
    if regime == "zero":
        return np.where(rng.random((M, N)) < 0.5, 0.0, -0.0).astype(np.float32)
    if regime == "normal":
        return (rng.standard_normal((M, N)) * 2.0 ** int(rng.integers(-20, 21))).astype(np.float32)
    if regime == "wide":
        bits = (rng.integers(0, 2, (M, N)) << 31) | (rng.integers(0, 255, (M, N)) << 23) | rng.integers(0, 1 << 23, (M, N))
        return bits.astype(np.uint32).view(np.float32)
    if regime == "bits":
        return rng.integers(0, 1 << 32, (M, N), dtype=np.uint64).astype(np.uint32).view(np.float32)
    if regime == "small":
        # Exponents around the F = 35 cut below small group terms, where C is partly truncated.
        return (rng.standard_normal((M, N)) * 2.0 ** rng.integers(-70, -20, (M, N))).astype(np.float32)
    raise AssertionError(regime)


SM120_REGIMES = ["random", "zeros", "cancel", "signed_scales", "spread", "tiny_scales", "nan_scale"]


@pytest.mark.parametrize("regime", SM120_REGIMES)
@pytest.mark.parametrize("c_reg", ["zero", "normal", "wide", "bits", "small"])
@pytest.mark.parametrize("K", [64, 128, 256])
@settings(deadline=None, max_examples=examples(1))
@given(seed=SEEDS)
def test_sm120_vs_mmasim(regime, c_reg, seed, K):
    """GST-FDPA against mmasim: every operand regime × every C regime, chains of 1, 2 or 4 steps."""
    rng = np.random.default_rng(seed)
    M, N = _DOTS
    assert_same_sm120(*sm120_operands(rng, regime, M, N, K), sm120_c(rng, c_reg, M, N))


@pytest.mark.slow
@settings(deadline=None, max_examples=examples(50))
@given(seed=SEEDS, regime=st.sampled_from(SM120_REGIMES), c_reg=st.sampled_from(["zero", "normal", "wide", "bits", "small"]),
       K=st.sampled_from([64, 128, 256]))
def test_sm120_sweep_slow(seed, regime, c_reg, K):
    rng = np.random.default_rng(seed)
    M, N = _DOTS_SLOW
    assert_same_sm120(*sm120_operands(rng, regime, M, N, K), sm120_c(rng, c_reg, M, N))


def test_sm120_group_rules():
    """mma_models.md §6 by hand: group sums are exact and aligned by the scale exponents alone; a
    cancelled group keeps its exponent, an all-zero group does not; F = 35."""
    def one(a, sa, b, sb, c):
        Ac = np.zeros((1, 64), np.uint8)
        Bc = np.zeros((1, 64), np.uint8)
        Ac[0, : len(a)] = a
        Bc[0, : len(b)] = b
        As = np.array([sa], np.uint8)
        Bs = np.array([sb], np.uint8)
        C = np.full((1, 1), c, np.float32)
        assert_same_sm120(Ac, As, Bc, Bs, C)
        out = np.empty((1, 1), np.float32)
        mma_sm120(Ac, As, Bc, Bs, C, out)
        return float(out[0, 0])

    one_s = 0x38  # scale 1.0
    # Group 0 = 6·6 − 6·6 = 0 at scale 1: it cancelled, so it keeps exponent 0 and C = 2^-35 survives
    # the truncation at 2^(0−35) while 2^-36 does not.
    assert one([7, 7], [one_s] * 4, [7, 15], [one_s] * 4, 2.0**-35) == 2.0**-35
    assert one([7, 7], [one_s] * 4, [7, 15], [one_s] * 4, 2.0**-36) == 0.0
    # An all-zero group gets e_zero = −139: C = 2^-36 is then the largest term and survives.
    assert one([0], [one_s] * 4, [0], [one_s] * 4, 2.0**-36) == 2.0**-36
    # Groups 0 and 1 are +36 and −36 at scale 1. Not normalised, they align at exponent 0, so
    # C = 2^-34 survives; renormalised to exponent 5 it would be cut at 2^-30.
    a, b = [0] * 17, [0] * 17
    a[0], b[0], a[16], b[16] = 7, 7, 7, 15
    assert one(a, [one_s] * 4, b, [one_s] * 4, 2.0**-34) == 2.0**-34
    # Subnormal scales (0x01 = 2^-9) align at exponent −6 each: two groups ±1·2^-18 cancel at E = −12,
    # so C = 2^-47 survives and 2^-48 is cut.
    a, b = [0] * 17, [0] * 17
    a[0], b[0], a[16], b[16] = 2, 2, 2, 10
    assert one(a, [1] * 4, b, [1] * 4, 2.0**-47) == 2.0**-47
    assert one(a, [1] * 4, b, [1] * 4, 2.0**-48) == 0.0
    # Scale product significands multiply the exact group sum: (1.5·1.5)·(1.125·2^1 · 1.875·2^-1).
    v = one([3], [0x41, 0x38, 0x38, 0x38], [3], [0x37, 0x38, 0x38, 0x38], 0.0)
    assert v == 2.25 * ue4m3(0x41) * ue4m3(0x37)


# ---------------------------------------------------------------------------------------------
# exact model (numerics.md §3.3)
# ---------------------------------------------------------------------------------------------


def fraction_to_f32(q: Fraction) -> float:
    """Correct RNE of a rational to binary32 (subnormals, overflow to inf)."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    e = max(e, -126)
    quantum = Fraction(2) ** (e - 23)
    n, r = divmod(q, quantum)
    if r > quantum / 2 or (r == quantum / 2 and n % 2 == 1):
        n += 1
    v = n * quantum
    if v >= 2**128:
        return sign * math.inf
    return sign * float(v)


def exact_sums(A, B, C):
    M, N = C.shape
    return [[Fraction(float(C[m, n])) + sum(Fraction(float(a)) * Fraction(float(b)) for a, b in zip(A[m], B[n]))
             for n in range(N)] for m in range(M)]


def f32_operands(rng, shape, positive):
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 21, shape)
    return (np.abs(x) if positive else x).astype(np.float32)


def ordered(x):
    """binary32 bit patterns as integers ordered like the values."""
    i = x.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


@settings(deadline=None, max_examples=examples(6))
@given(seed=SEEDS, K=st.sampled_from([1, 16, 64, 128]))
def test_exact_well_conditioned_is_correctly_rounded(seed, K):
    """Same-sign terms: the binary64 chain is far inside half a binary32 ulp, so one rounding gives
    the correctly rounded exact sum, bit for bit."""
    rng = np.random.default_rng(seed)
    M, N = 12, 12
    A, B, C = f32_operands(rng, (M, K), True), f32_operands(rng, (N, K), True), f32_operands(rng, (M, N), True)
    sgn = rng.choice([-1.0, 1.0])
    A, C = (A * sgn).astype(np.float32), (C * sgn).astype(np.float32)
    out = np.empty((M, N), np.float32)
    mma_exact(A, B, C, out)
    want = np.array([[fraction_to_f32(q) for q in row] for row in exact_sums(A, B, C)], np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@settings(deadline=None, max_examples=examples(6))
@given(seed=SEEDS, K=st.sampled_from([16, 64, 128]), spread=st.sampled_from([0, 4, 20]))
def test_exact_mixed_signs_within_one_ulp(seed, K, spread):
    """Mixed signs (no catastrophic cancellation in random data): within one binary32 ulp of the
    correctly rounded exact sum."""
    rng = np.random.default_rng(seed)
    M, N = 12, 12

    def draw(shape):
        return (rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, shape)).astype(np.float32)

    A, B, C = draw((M, K)), draw((N, K)), draw((M, N))
    out = np.empty((M, N), np.float32)
    mma_exact(A, B, C, out)
    want = np.array([[fraction_to_f32(q) for q in row] for row in exact_sums(A, B, C)], np.float32)
    assert np.abs(ordered(out) - ordered(want)).max() <= 1


@settings(deadline=None, max_examples=examples(6))
@given(seed=SEEDS, K=st.sampled_from([16, 64]))
def test_exact_error_bound_any_input(seed, K):
    """Any finite input, cancellation included: |out − exact| ≤ ½ulp(out) + γ_K·Σ|terms| (binary64
    sequential summation), the "exact up to binary64 additions" of numerics.md §3.3."""
    rng = np.random.default_rng(seed)
    M, N = 8, 8
    A = f32_operands(rng, (M, K), False)
    B = f32_operands(rng, (N, K), False)
    B[:, K // 2:] = -B[:, : K // 2] * (1 + rng.integers(-2, 3, (N, K // 2)) * 2.0**-23)  # near-cancelling
    A[:, K // 2:] = A[:, : K // 2]
    C = f32_operands(rng, (M, N), False)
    out = np.empty((M, N), np.float32)
    mma_exact(A, B, C, out)
    gamma = Fraction(K, 2**53 - K)
    for m in range(M):
        for n in range(N):
            terms = [Fraction(float(C[m, n]))] + [Fraction(float(a)) * Fraction(float(b)) for a, b in zip(A[m], B[n])]
            exact = sum(terms)
            o = float(out[m, n])
            half_ulp = Fraction(2) ** (max(math.frexp(o)[1] - 1, -126) - 24) if o != 0 else Fraction(2) ** -150
            assert abs(Fraction(o) - exact) <= half_ulp + gamma * sum(abs(t) for t in terms)


@settings(deadline=None, max_examples=examples(5))
@given(seed=SEEDS, K=st.sampled_from([3, 16, 64]))
def test_exact_is_the_sequential_binary64_chain(seed, K):
    """The definition, with Python floats (binary64 RNE) as the oracle, on random binary32 bits."""
    rng = np.random.default_rng(seed)
    M, N = 8, 8

    def bits(shape):
        return rng.integers(0, 1 << 32, shape, dtype=np.uint64).astype(np.uint32).view(np.float32)

    A, B, C = bits((M, K)), bits((N, K)), bits((M, N))
    out = np.empty((M, N), np.float32)
    mma_exact(A, B, C, out)
    want = np.empty((M, N), np.float32)
    with np.errstate(all="ignore"):
        for m in range(M):
            for n in range(N):
                acc = float(C[m, n])
                for k in range(K):
                    acc = acc + float(A[m, k]) * float(B[n, k])
                want[m, n] = np.float32(acc)
    same = (out.view(np.uint32) == want.view(np.uint32)) | (np.isnan(out) & np.isnan(want))
    assert same.all()


# ---------------------------------------------------------------------------------------------
# API contract
# ---------------------------------------------------------------------------------------------


def test_c_may_alias_out():
    rng = np.random.default_rng(1)
    A, B = f16_normal(rng, (16, 64)), f16_normal(rng, (8, 64))
    for fn, dt in ((mma_sm90_f32, np.float32), (mma_sm90_f16, np.float16)):
        C = rng.standard_normal((16, 8)).astype(dt).astype(np.float32)
        out = np.empty_like(C)
        fn(A.astype(np.float32), B.astype(np.float32), C, out)
        fn(A.astype(np.float32), B.astype(np.float32), C, C)
        np.testing.assert_array_equal(C.view(np.uint32), out.view(np.uint32))
    Ac, As, Bc, Bs = sm120_operands(rng, "random", 16, 8, 128)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    out = np.empty_like(C)
    mma_sm120(Ac, As, Bc, Bs, C, out)
    mma_sm120(Ac, As, Bc, Bs, C, C)
    np.testing.assert_array_equal(C.view(np.uint32), out.view(np.uint32))
    A32, B32 = A.astype(np.float32), B.astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    mma_exact(A32, B32, C, out)
    mma_exact(A32, B32, C, C)
    np.testing.assert_array_equal(C.view(np.uint32), out.view(np.uint32))


def test_chain_equals_steps():
    """A chain is the left fold of its steps (numerics.md §3)."""
    rng = np.random.default_rng(2)
    A, B = f16_normal(rng, (16, 128)).astype(np.float32), f16_normal(rng, (8, 128)).astype(np.float32)
    for fn in (mma_sm90_f32, mma_sm90_f16):
        whole = np.empty((16, 8), np.float32)
        fn(A, B, np.zeros((16, 8), np.float32), whole)
        acc = np.zeros((16, 8), np.float32)
        for k0 in range(0, 128, 16):
            fn(np.ascontiguousarray(A[:, k0:k0 + 16]), np.ascontiguousarray(B[:, k0:k0 + 16]), acc, acc)
        np.testing.assert_array_equal(acc.view(np.uint32), whole.view(np.uint32))


def test_bad_shapes_raise():
    A = np.zeros((16, 24), np.float32)
    with pytest.raises(ValueError):
        mma_sm90_f32(A, np.zeros((8, 24), np.float32), np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32))
    with pytest.raises(ValueError):
        mma_sm120(np.zeros((16, 32), np.uint8), np.zeros((16, 2), np.uint8), np.zeros((8, 32), np.uint8),
                  np.zeros((8, 2), np.uint8), np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32))


def test_instruction_table():
    """The parameters of mma_models.md §2 for the three instructions."""
    assert tuple(INSTRUCTIONS["sm90_f32"])[:4] == (25, -133, 0, 16)
    assert INSTRUCTIONS["sm90_f16"].F == 25 and INSTRUCTIONS["sm90_f16"].e_zero == -21
    assert INSTRUCTIONS["sm120_nvf4"].F == 35 and INSTRUCTIONS["sm120_nvf4"].e_zero == -139
    assert INSTRUCTIONS["sm120_nvf4"].L == 64 and INSTRUCTIONS["sm120_nvf4"].G == 16
