"""The kernel's P' thresholds (cuda/formats.cuh e2m1_exp2s, numerics.md §7.5) against the definition.

The kernel replaces e2m1(exp2s(y)) by seven comparisons of y with constants T_k. The oracle here is
the emulator's exp2s (bitwise the spec's §2 routine) followed by ml_dtypes' E2M1 cast (after the
clamp to ±6 of §4.1); the constants are read from the CUDA header, so an edit there is tested.
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from apa_emu.fpmath import exp2s_np

HEADER = Path(__file__).resolve().parents[2] / "cuda" / "formats.cuh"
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def header_thresholds() -> np.ndarray:
    found = dict(re.findall(r"#define APA_E2M1_EXP2S_T(\d) (0x[0-9A-Fa-f]{8})u", HEADER.read_text()))
    assert sorted(found) == [str(k) for k in range(7)], found
    return np.array([int(found[str(k)], 16) for k in range(7)], np.uint32).view(np.float32)


def oracle(y: np.ndarray) -> np.ndarray:
    """e2m1(exp2s(y)) as a value: the spec's exp2s, then ml_dtypes' round-to-nearest-even E2M1."""
    p = np.minimum(exp2s_np(y), np.float32(6.0))
    return p.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)


def ladder(y: np.ndarray, T: np.ndarray) -> np.ndarray:
    """The header's rule: the value index is the number of thresholds y exceeds."""
    return GRID[(y[:, None] > T[None, :]).sum(axis=1)]


def check(y: np.ndarray, T: np.ndarray) -> None:
    want, got = oracle(y), ladder(y, T)
    bad = np.flatnonzero(want != got)
    assert bad.size == 0, f"{bad.size} mismatches, first y={y[bad[0]]!r}: exp2s gives {want[bad[0]]}, " \
                          f"thresholds give {got[bad[0]]}"


def neighbours(x: np.float32, n: int) -> np.ndarray:
    """The n binary32 values below x, x itself and the n above (x finite, not crossing zero)."""
    b = np.int64(np.float32(x).view(np.int32))
    bits = np.arange(b - n, b + n + 1, dtype=np.int64)
    return bits.astype(np.int32).view(np.float32)


def test_thresholds_are_strictly_increasing_and_exact_at_the_boundary():
    T = header_thresholds()
    assert np.all(np.diff(T) > 0)
    for k, t in enumerate(T):
        above = np.nextafter(t, np.float32(np.inf))
        # T_k is the last y below the k-th midpoint, its successor the first one above it.
        assert oracle(np.array([t]))[0] == GRID[k]
        assert oracle(np.array([above]))[0] == GRID[k + 1]


def test_thresholds_match_exp2s_near_each_boundary():
    T = header_thresholds()
    for t in T:
        check(neighbours(t, 1 << 16), T)


def test_thresholds_match_exp2s_on_a_sample_and_outside_the_scanned_range():
    T = header_thresholds()
    rng = np.random.default_rng(0)
    uniform = rng.uniform(-2.5, 3.0, 1_000_000).astype(np.float32)
    special = np.array([-np.inf, -1e30, -126.0, -125.5, -3.0, -2.5, 3.0, 3.25, 60.0, 127.5, 128.0, 1e30, np.inf],
                       np.float32)
    outside = np.concatenate([rng.uniform(-130.0, -2.5, 100_000), rng.uniform(3.0, 140.0, 100_000)]).astype(np.float32)
    check(np.concatenate([uniform, special, outside, -uniform]), T)


@pytest.mark.slow
def test_thresholds_match_exp2s_on_every_binary32_of_the_scanned_range():
    """All 2.15e9 binary32 values of [-2.5, 3] (about a minute)."""
    T = header_thresholds()
    chunk = 1 << 22
    for sign, top in ((0x80000000, 0x40200000), (0, 0x40400000)):  # [-2.5, -0] and [+0, 3]
        for start in range(0, top + 1, chunk):
            check((np.arange(start, min(start + chunk, top + 1), dtype=np.uint32) | np.uint32(sign)).view(np.float32), T)
