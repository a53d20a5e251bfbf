"""Two of the seed's FMA sites (numerics.md §1.8, config ``fma``) in the kernel on chosen operands,
against the emulator: §7.4's P-scale exponent and §9.3–9.4's merge, through cuda/probe.cu.

On whole problems a single binary32 rounding seldom reaches an output bit, so a kernel that dropped one
of these fusions could pass the attention cross-checks (mutants K16, K17 of tools/mutants.py). Here the
operands are ones where the fusion decides the result. Marked ``gpu``: it runs on the device and, in CI,
on the CPU simulator (tests/kernel/test_gpu_sim.py runs this file there).
"""

from __future__ import annotations

import numpy as np
import pytest

from apa_emu import Config, fpmath
from apa_emu.formats import ue4m3_value
from apa_emu.merge import merge, merge_weights
from apa_emu.fpmath import ex2_tables
from apa_emu.pass1 import P1Mode, p1_pscale

from apa_gpu.probes import run_probe_merge, run_probe_pscale

pytestmark = pytest.mark.gpu
F32 = np.float32


def _emulated_pscale(gm, cq, c, pow2: bool, fma: bool):
    k = Config().pass1_consts()
    mode = P1Mode(0, *ex2_tables(True), pow2, True, np.arange(64), F32(1), False, fma, False, F32(1))
    out = [p1_pscale(F32(a), F32(b), F32(x), k, mode) for a, b, x in zip(gm, cq, c)]
    return (np.array([ue4m3_value(np.uint8(kb)) for kb, _, _ in out], F32), np.array([b for _, b, _ in out], F32),
            np.array([m for _, _, m in out], F32))


def _pscale_matches(gm, cq, c, pow2: bool, fma: bool):
    """The kernel's (dec(kb), bias, a_g) of each triple, asserted bitwise equal to the emulator's."""
    k = Config().pass1_consts()
    got = run_probe_pscale(gm, cq, c, k.A, k.L, pow2, fma)
    for g, w in zip(got, _emulated_pscale(gm, cq, c, pow2, fma)):
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (pow2, fma)
    return got


def test_pscale_fusion_lifts_the_row_maximum_group():
    """§7.4 by hand (tests/emu/test_algorithm.py derives it): gm = 100, c_q = 1 + 2⁻²², c = gm ⊗ c_q. Unfused
    u = 4 exactly and the scale is 16; fused u = 4 + 2⁻²⁰ and the scale is 18. Then a spread of triples
    around u = 4 under both scale kinds, bitwise against the emulator, some of which the fusion moves."""
    k = Config().pass1_consts()
    gm, cq = F32(100), F32(1 + 2.0**-22)
    for fma, want in ((False, 16), (True, 18)):
        scale = run_probe_pscale([gm], [cq], [gm * cq], k.A, k.L, False, fma)[0]
        assert float(scale[0]) == want
    rng = np.random.default_rng(5)
    n = 4096
    gm = rng.uniform(-60, 60, n).astype(F32)
    cq = rng.uniform(0.01, 2, n).astype(F32)
    c = (gm * cq + rng.choice([0, 0, 0.5, 3, 11], n).astype(F32)).astype(F32)
    moved = 0
    for pow2 in (False, True):
        got = {fma: _pscale_matches(gm, cq, c, pow2, fma) for fma in (False, True)}
        moved += int((got[False][0] != got[True][0]).sum())
    assert moved > 0, "no triple where the fusion moves the scale"


def test_pscale_mass_at_ties_and_clamps():
    """§7.4's a_g = min(dec(kb), 24 ⊗ exp2(u₀)): the kernel takes exp2s(u₀) as exp2s(x₀) ⊗ 2^floor(u₀),
    x₀ = u₀ ⊖ floor(u₀), except at x₀ = 0.5 with an odd floor and outside [−125, 127), where it evaluates
    exp2s(u₀). Bitwise against the emulator on u₀ = k + 0.5 (both parities, and where the two forms
    differ), its neighbours, integers, clamped values, the range ends and −inf (a masked group)."""
    k = Config().pass1_consts()
    ties = np.arange(-24, 9, dtype=F32) + F32(0.5)
    u0 = np.concatenate([ties, np.nextafter(ties, F32(-np.inf)), np.nextafter(ties, F32(np.inf)),
                         np.arange(-24, 9, dtype=F32), F32([-124.75, -125, -125.5, -126.5, -200, -np.inf, -0.0,
                                                            7.999999, 8])]).astype(F32)
    # u₀ = gm ⊗ 1 ⊕ (A ⊖ A) = gm, fused or not.
    gm, cq, c = u0, np.ones_like(u0), np.full_like(u0, k.A)
    for fma in (False, True):
        _pscale_matches(gm, cq, c, False, fma)
    # The interesting case happened: an odd-floor tie where the two forms of exp2s(u₀) differ and a_g
    # is the cap (u₀ < −6 − log2 24: above it a_g is dec(kb) whatever the cap's last bit).
    odd = ties[(np.floor(ties).astype(int) % 2 == 1) & (ties < -11)]
    split = [F32(fpmath.exp2s(t)) != F32(fpmath.exp2s(F32(0.5))) * F32(2.0 ** np.floor(t)) for t in odd]
    assert any(split), "no odd-floor tie where exp2s(u₀) differs from exp2s(x₀)·2^floor(u₀)"


# Two rows found by search (seed 1, 200000 random rows) whose FP16 output the fused numerator decides, in
# channel 1 and in channel 0 (the kernel forms the two channels in two statements): m1 = −0.5 makes
# w1 = exp2(−0.5) inexact, so w1 ⊗ part rounds where fma(w1, part, ·) does not. Binary32 bits.
ROWS = dict(l1=(0x402FD0F9, 0x3FB443A5), l2=(0x402A2A88, 0x3FB5A04A),
            part=((0x3F8C343B, 0x3FE4A591), (0x3F977115, 0x3FDB991D)),
            o2=((0x3FCDD126, 0x3FF88FF5), (0x3F99A2B5, 0x3FA4ABDE)))


def test_merge_fusion_decides_an_output_bit():
    """§9.3–9.4 with ``fma``: on ROWS the seed's numerator fma(w1, part, w2 ⊗ o2) gives a different FP16
    output, in channel 1 of the first and channel 0 of the second, than w1 ⊗ part ⊕ w2 ⊗ o2 under the same
    fused denominator (what mutant K17 computes in one channel); the kernel matches the emulator both
    ways. Then random rows (some with no hot or no cold part), bitwise, fused and not."""
    l1, l2, part, o2 = (np.array(ROWS[x], np.uint32).view(F32) for x in ("l1", "l2", "part", "o2"))
    m1, m2 = np.full(2, -0.5, F32), np.zeros(2, F32)
    fused = merge(m1, l1, part, m2, l2, o2, True, True)
    _, w1, w2, _ = merge_weights(m1, l1, m2, l2, True)
    inv = F32(1) / fpmath.fma32_arrays(w1, l1, w2 * l2)
    num_unfused = ((w1[:, None] * part + w2[:, None] * o2) * inv[:, None]).astype(np.float16)
    assert (fused != num_unfused).tolist() == [[False, True], [True, False]]
    for fma in (False, True):
        got = run_probe_merge(m1, l1, part, m2, l2, o2, fma)
        assert np.array_equal(got.view(np.uint16), merge(m1, l1, part, m2, l2, o2, True, fma).view(np.uint16)), fma
    rng = np.random.default_rng(9)
    n = 4096
    m1 = rng.uniform(-3, 0, n).astype(F32)
    # some rows with no hot tile (m2 = −inf, l2 = 0) or no cold part (l1 = 0), never both (a row always has one)
    m2 = np.where(rng.random(n) < 0.1, F32(-np.inf), rng.uniform(-3, 0, n)).astype(F32)
    l1 = np.where((rng.random(n) < 0.1) & (m2 > -np.inf), F32(0), rng.uniform(0.5, 300, n)).astype(F32)
    l2 = np.where(m2 == -np.inf, F32(0), rng.uniform(0.5, 300, n)).astype(F32)
    part, o2 = (rng.uniform(-40, 40, (n, 2)).astype(F32) for _ in range(2))
    for fma in (False, True):  # about 1 row in 10⁴ has an output bit the fusion decides: ROW is one
        got, want = run_probe_merge(m1, l1, part, m2, l2, o2, fma), merge(m1, l1, part, m2, l2, o2, True, fma)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), fma
