"""The kernel's arithmetic primitives (cuda/fpmath.cuh, cuda/formats.cuh) against the emulator, bitwise.

exp2s (numerics.md §2), the LG2 and UE4M3 tables (§2.2, §4.2), E2M1 and E4M3 encoding (§4.1, §4.2)
and quant16 (§4.4), each run on the GPU through cuda/probe.cu. A mismatch here localises a
kernel-vs-emulator difference before the whole attention is compared. Marked ``gpu`` and
``hardware``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_quant16, first_diff

from apa_emu import formats, fpmath

from apa_gpu.probes import run_probe_codes, run_probe_exp2, run_probe_tables

# Under the simulator the binary16 conversions and roundings are host ports, and tens of millions of
# host threads would take hours: the device's own instructions are what these tests check.
pytestmark = [pytest.mark.gpu, pytest.mark.hardware]


def test_exp2s_dense_and_special():
    # every binary32 in [-1, 1] with stride 97, a stride over the whole relevant range, specials
    lo, hi = np.float32(-1).view(np.uint32), np.float32(1).view(np.uint32)
    neg = np.arange(np.float32(0).view(np.uint32), lo, 97, dtype=np.uint32).view(np.float32) * np.float32(-1)
    pos = np.arange(0, hi, 97, dtype=np.uint32).view(np.float32)
    wide = np.linspace(-130, 130, 2_000_001, dtype=np.float32)
    ints = np.arange(-130, 131, dtype=np.float32)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 127.5, 127.99999, 128, -126, -126.00001,
                        -125.5, -125.50001, 1e-45, -1e-45], np.float32)
    x = np.concatenate([neg, pos, wide, ints, ints + np.float32(0.5), special])
    msg = first_diff(run_probe_exp2(x), fpmath.exp2s_np(x), x)
    assert msg is None, msg


def test_exp2s_restricted_variants():
    # exp2s_core (the P-scale mantissa, §7.4) is exp2s on [0, 1), every binary32 there with stride 13;
    # exp2s_nonpos (frame rescales, pass-2 probabilities) is exp2s on x ≤ 0 and NaN: every binary32 in
    # [-2, 0] with stride 29, a stride over [-130, -2], the edges of step 1 and -inf.
    unit = np.arange(0, np.float32(1).view(np.uint32), 13, dtype=np.uint32).view(np.float32)
    msg = first_diff(run_probe_exp2(unit, "core"), fpmath.exp2s_np(unit), unit)
    assert msg is None, msg
    lo = np.float32(-2).view(np.uint32)
    near = np.arange(np.float32(-0.0).view(np.uint32), lo, 29, dtype=np.uint32).view(np.float32)
    far = np.linspace(-130, -2, 4_000_001, dtype=np.float32)
    edges = np.array([np.nan, -np.inf, -0.0, 0.0, -126, -126.00001, -125.99999, -125.5, -125.50001, -1e-45,
                      -126.5, -126.49999, -126.50001, -127, -126.99999, -127.00001, -127.5, -128, -3e38],
                     np.float32)
    x = np.concatenate([near, far, edges])
    msg = first_diff(run_probe_exp2(x, "nonpos"), fpmath.exp2s_np(x), x)
    assert msg is None, msg


def test_tables():
    lg2, dec = run_probe_tables()
    assert np.array_equal(lg2.view(np.uint32), fpmath.LG2.view(np.uint32))
    want = np.array([formats.ue4m3_value(np.uint8(c)) for c in range(127)], np.float32)
    assert np.array_equal(dec.view(np.uint32), want.view(np.uint32))


def test_codes():
    rng = np.random.default_rng(5)
    grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 448, 464, 465, 1000,
                     2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 2.0**-6, 1e-30, np.inf], np.float32)
    near = np.concatenate([np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(-np.inf))])
    bitsx = rng.integers(0, 1 << 32, 1_000_000, dtype=np.uint32).view(np.float32)
    bitsx = bitsx[np.isfinite(bitsx)]
    x = np.concatenate([grid, -grid, near, -near, bitsx, rng.standard_normal(200_000).astype(np.float32) * 8])
    x = x[~np.isnan(x)]
    g2, g4 = run_probe_codes(x)
    e2 = formats.E2M1_VALUES[[formats.e2m1_code(v) for v in x]]
    e4 = formats.e4m3_codes(x)
    assert (msg := first_diff(g2, e2, x)) is None, "e2m1: " + msg
    assert (msg := first_diff(g4, e4, x)) is None, "e4m3: " + msg


@pytest.mark.parametrize("lsq", [True, False], ids=["lsq", "nearest"])
def test_quant16(lsq):
    check_quant16(200_000, lsq)
