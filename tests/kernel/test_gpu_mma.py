"""The H200's mma.sync.m16n8k16 (f16→f32 and f16→f16) against the emulator's sm90 model, bitwise.

numerics.md §3.1; the targeted probes are those of docs/mma_models.md §8 (1–6, 8, 9:
the FP8 probe 7 does not apply to the instructions we use), each checked against the value stated
there and against ``apa_emu.mma``; then ≥ 10^5 random tiles per instruction (random bit patterns,
random finite bit patterns, cancellation-heavy sums), compared bit for bit. Marked ``gpu`` and ``hardware``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from numba import njit

from apa_emu.mma import mma_sm90_f16, mma_sm90_f32

from apa_gpu.probes import run_probe_mma, run_probe_wgmma, run_probe_wgmma_f16

# The simulator computes mma.sync with its own port of the emulator's model: only the device tells.
pytestmark = [pytest.mark.gpu, pytest.mark.hardware]

N_RANDOM = int(os.environ.get("APA_GPU_MMA_TILES", "100000"))
U = 2.0**7


@njit(cache=True)
def _emulate_tiles(A, B, C, out, f16_out):
    for t in range(A.shape[0]):
        if f16_out:
            mma_sm90_f16(A[t], B[t], C[t], out[t])
        else:
            mma_sm90_f32(A[t], B[t], C[t], out[t])


def emulate(A16, B16, C, f16_out):
    """Emulator result for tiles A16 [T,16,16], B16 [T,8,16] float16, C [T,16,8]; like C."""
    out = np.empty(C.shape, np.float32)
    _emulate_tiles(A16.astype(np.float32), B16.astype(np.float32), C.astype(np.float32), out, f16_out)
    return out.astype(np.float16) if f16_out else out


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype == np.float16 else np.uint32)


def assert_same(gpu, emu, what):
    gb, eb = bits(gpu), bits(emu)
    bad = np.argwhere(gb != eb)
    if bad.size:
        i = tuple(int(v) for v in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {gb.size} outputs differ; first at {i}: gpu {gpu[i]!r} "
            f"(0x{int(gb[i]):x}) vs emulator {emu[i]!r} (0x{int(eb[i]):x})"
        )


def one_dot(a, b, c, f16_out):
    """A single dot product in output element (0, 0): a in A row 0, b in B column 0, c in C[0, 0]."""
    A = np.zeros((1, 16, 16), np.float16)
    B = np.zeros((1, 8, 16), np.float16)
    C = np.zeros((1, 16, 8), np.float16 if f16_out else np.float32)
    A[0, 0, : len(a)] = a
    B[0, 0, : len(b)] = b
    C[0, 0, 0] = c
    return A, B, C


def probe(a, b, c, f16_out=False):
    """(gpu, emulator) value of element (0, 0) for one probe; the whole tile is compared too."""
    A, B, C = one_dot(a, b, c, f16_out)
    g = run_probe_mma(A, B, C, f16_out)
    e = emulate(A, B, C, f16_out)
    assert_same(g, e, f"probe a={a} b={b} c={c}")
    return float(g[0, 0, 0]), float(e[0, 0, 0])


# ---------------------------------------------------------------------------------------------
# mma_models.md §8 targeted probes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x, want", [(2.0**-10, 2.0**-10), (2.0**-11, 2.0**-11), (2.0**-12, 0.0)])
def test_probe1_alignment_width_products(x, want):
    g, _ = probe([U, U, x], [U, -U, 1.0], 0.0)
    assert g == want


@pytest.mark.parametrize("c, want", [(2.0**-11, 2.0**-11), (2.0**-12, 0.0)])
def test_probe2_alignment_width_c(c, want):
    g, _ = probe([U, U], [U, -U], c)
    assert g == want


@pytest.mark.parametrize("f, want", [(0.25, 0.0), (0.5, 0.0), (0.75, 0.0), (1.5, 1.0)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_probe3_truncation_toward_zero(f, want, sign):
    g, _ = probe([U, U], [U, -U], sign * f * 2.0**-11)
    assert g == sign * want * 2.0**-11


def test_probe4_no_product_renormalisation():
    g, _ = probe([1.5 * U, -1.5 * U, 2.0**-11], [1.5 * U, 1.5 * U, 1.0], 0.0)
    assert g == 2.0**-11


@pytest.mark.parametrize("i, j", [(0, 1), (0, 7), (3, 5), (0, 15), (8, 15), (7, 8), (14, 2)])
def test_probe5_one_fused_group(i, j):
    a = [2.0**-9] * 16
    b = [2.0**-9] * 16
    a[i], b[i] = U, U
    a[j], b[j] = U, -U
    g, _ = probe(a, b, 2.0**-18)
    assert g == 0.0


@pytest.mark.parametrize("j", [0, 5, 15])
def test_probe5_c_fused_with_products(j):
    a = [2.0**-9] * 16
    b = [2.0**-9] * 16
    a[j], b[j] = U, -U
    g, _ = probe(a, b, 2.0**14)
    assert g == 0.0


@pytest.mark.parametrize("f, ulps", [(0.25, 0), (0.5, 0), (0.75, 0), (1.5, 1)])
def test_probe6_output_rz_f32(f, ulps):
    ulp = 2.0**14 * 2.0**-23
    g, _ = probe([U, f * ulp], [U, 1.0], 0.0)
    assert g == 2.0**14 + ulps * ulp


@pytest.mark.parametrize("f, ulps", [(0.25, 0), (0.5, 0), (0.75, 1), (1.5, 2)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_probe6_output_rne_f16(f, ulps, sign):
    ulp = 16.0  # binary16 ulp at 2^14
    g, _ = probe([sign * U, f * ulp], [U, sign], 0.0, f16_out=True)
    assert g == sign * (2.0**14 + ulps * ulp)


@pytest.mark.parametrize("k", range(0, 23))
def test_probe8_e_zero_f16(k):
    # 2^-25 (half the f16 subnormal quantum) plus 2^-(26+k): the zero terms (e_zero = -21) set
    # E = -21, so the second product survives truncation (quantum 2^-46) up to k = 20 and the sum
    # rounds up to 2^-24; from k = 21 on it is cut and the exact tie 2^-25 rounds to even, 0.
    g, _ = probe([2.0**-11, 0.25 * 2.0**-k], [2.0**-14, 2.0**-24], 0.0, f16_out=True)
    assert g == (2.0**-24 if k <= 20 else 0.0)


@pytest.mark.parametrize("f16_out", [False, True])
def test_probe9_special_values(f16_out):
    inf, nan = np.inf, np.nan
    # zero result is +0 even from -0 inputs
    g, _ = probe([-0.0] * 16, [0.0] * 16, -0.0, f16_out)
    assert g == 0.0 and np.signbit(np.float32(g)) == False  # noqa: E712
    A, B, C = one_dot([-0.0, 1.0], [1.0, -0.0], -0.0, f16_out)
    assert bits(run_probe_mma(A, B, C, f16_out))[0, 0, 0] == 0
    # NaN is canonical; inf propagates; inf*0 and inf-inf are NaN
    for a, b, c in (([nan], [1.0], 0.0), ([inf, 0.0], [0.0, 1.0], 0.0), ([inf, inf], [1.0, -1.0], 0.0),
                    ([inf], [2.0], 1.0), ([-inf], [2.0], 1.0), ([1.0], [1.0], inf)):
        probe(a, b, c, f16_out)
    A, B, C = one_dot([nan], [1.0], 0.0, f16_out)
    d = bits(run_probe_mma(A, B, C, f16_out))[0, 0, 0]
    assert d == (0x7FFF if f16_out else 0x7FFFFFFF)
    # subnormal inputs and outputs are kept
    g, _ = probe([2.0**-24], [1.0], 0.0, f16_out)
    assert g == 2.0**-24
    if not f16_out:
        g, _ = probe([2.0**-24], [2.0**-24], 0.0)
        assert g == 2.0**-48


# ---------------------------------------------------------------------------------------------
# random tiles
# ---------------------------------------------------------------------------------------------


def _random_tiles(kind, T, f16_out, rng):
    if kind == "bits":
        A = rng.integers(0, 1 << 16, (T, 16, 16), dtype=np.uint16).view(np.float16)
        B = rng.integers(0, 1 << 16, (T, 8, 16), dtype=np.uint16).view(np.float16)
    elif kind == "finite":
        def fb(shape):
            x = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
            return np.where((x & 0x7C00) == 0x7C00, x & 0x83FF, x).view(np.float16)
        A, B = fb((T, 16, 16)), fb((T, 8, 16))
    else:  # cancellation: pairs of equal and opposite large products plus small ones
        A = (rng.standard_normal((T, 16, 16)) * np.exp2(rng.integers(-12, 8, (T, 16, 1)))).astype(np.float16)
        B = (rng.standard_normal((T, 8, 16)) * np.exp2(rng.integers(-12, 8, (T, 8, 1)))).astype(np.float16)
        A[:, :, 1::2] = A[:, :, 0::2]
        B[:, :, 1::2] = -B[:, :, 0::2]
        B[:, :, 15] = rng.standard_normal((T, 8)).astype(np.float16)
    if f16_out:
        C = rng.integers(0, 1 << 16, (T, 16, 8), dtype=np.uint16)
        if kind != "bits":
            C = np.where((C & 0x7C00) == 0x7C00, C & 0x83FF, C)
        C = C.view(np.float16)
    else:
        C = rng.integers(0, 1 << 32, (T, 16, 8), dtype=np.uint32)
        if kind != "bits":
            C = np.where((C & 0x7F800000) == 0x7F800000, C & 0x807FFFFF, C)
        C = C.view(np.float32)
    return A, B, C


@pytest.mark.parametrize("f16_out", [False, True], ids=["f16f32", "f16f16"])
@pytest.mark.parametrize("kind, frac", [("bits", 1.0), ("finite", 0.2), ("cancel", 0.2)])
def test_random_tiles(kind, frac, f16_out):
    rng = np.random.default_rng(1234 + 7 * f16_out + hash(kind) % 1000)
    T = max(1, int(N_RANDOM * frac))
    for start in range(0, T, 25000):
        n = min(25000, T - start)
        A, B, C = _random_tiles(kind, n, f16_out, rng)
        assert_same(run_probe_mma(A, B, C, f16_out), emulate(A, B, C, f16_out),
                    f"{kind} tiles {start}..{start + n} ({'f16' if f16_out else 'f32'} accumulation)")


# ---------------------------------------------------------------------------------------------
# wgmma scale-d = 0 (mma_models.md §3): pass 1 starts its score chains with it
# ---------------------------------------------------------------------------------------------


def _wgmma_tiles(T, rng):
    """Random bit patterns, sums of only −0 products, and exact cancellations to zero, a third each."""
    A = rng.integers(0, 1 << 16, (T, 64, 16), dtype=np.uint16).view(np.float16)
    B = rng.integers(0, 1 << 16, (T, 64, 16), dtype=np.uint16).view(np.float16)
    z = slice(T // 3, 2 * T // 3)
    A[z] = -np.abs(rng.standard_normal(A[z].shape)).astype(np.float16) - np.float16(2.0**-14)
    B[z] = np.float16(0.0)
    c = slice(2 * T // 3, T)
    A[c, :, 1::2] = A[c, :, 0::2] = np.where(np.isfinite(A[c, :, 0::2]), A[c, :, 0::2], np.float16(1.0))
    B[c] = np.where(np.isfinite(B[c]), B[c], np.float16(2.0))
    B[c, :, 1::2] = -B[c, :, 0::2]
    return A, B


def test_wgmma_scale_d_zero():
    """A wgmma k16 step with scale-d = 0 equals the same step from C = +0 bit for bit, and both equal
    the sm90 model's step from C = +0, on random bits and on sums that are exactly zero: all −0
    products (the model gives +0) and exact cancellations."""
    rng = np.random.default_rng(4321)
    T = max(3, N_RANDOM // 2048 * 3)
    A, B = _wgmma_tiles(T, rng)
    d0, d1 = run_probe_wgmma(A, B)
    assert_same(d0, d1, "wgmma scale-d = 0 against C = +0")
    # The model's step per output: m16n8k16 tiles over 16-row and 8-column blocks, C = +0.
    At = A.reshape(T, 4, 1, 16, 16).repeat(8, 2).reshape(-1, 16, 16)
    Bt = B.reshape(T, 1, 8, 8, 16).repeat(4, 1).reshape(-1, 8, 16)
    emu = emulate(At, Bt, np.zeros((At.shape[0], 16, 8), np.float32), False)
    emu = emu.reshape(T, 4, 8, 16, 8).transpose(0, 1, 3, 2, 4).reshape(T, 64, 64)
    assert_same(d1, emu, "wgmma from C = +0 against the sm90 model")
    assert (bits(d0[T // 3:]) == 0).all(), "sums of −0 products and exact cancellations must give +0"


@pytest.mark.parametrize("kind", ["bits", "finite", "cancel"])
def test_wgmma_f16_accumulation_is_the_mma_step(kind):
    """Pass 2's score step (§8.1): wgmma m64n64k16 with FP16 accumulation and A from registers equals
    the sm90 model's m16n8k16 FP16 step (mma_f16_acc) on every 16-row and 8-column block, from any C."""
    rng = np.random.default_rng(99 + hash(kind) % 1000)
    T = max(2, N_RANDOM // 256)
    A_, B_, _ = _random_tiles(kind, 8 * T, True, rng)
    A, B = A_[: 4 * T].reshape(T, 64, 16), B_.reshape(T, 64, 16)
    C = rng.integers(0, 1 << 16, (T, 64, 64), dtype=np.uint16)
    if kind != "bits":
        C = np.where((C & 0x7C00) == 0x7C00, C & 0x83FF, C)
    C = C.view(np.float16)
    d = run_probe_wgmma_f16(A, B, C)
    At = A.reshape(T, 4, 1, 16, 16).repeat(8, 2).reshape(-1, 16, 16)
    Bt = B.reshape(T, 1, 8, 8, 16).repeat(4, 1).reshape(-1, 8, 16)
    Ct = C.reshape(T, 4, 16, 8, 8).transpose(0, 1, 3, 2, 4).reshape(-1, 16, 8)
    emu = emulate(At, Bt, Ct, True).reshape(T, 4, 8, 16, 8).transpose(0, 1, 3, 2, 4).reshape(T, 64, 64)
    assert_same(d, emu, f"wgmma f16 accumulation, {kind} tiles")
