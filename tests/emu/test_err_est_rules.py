"""Two rules of the error estimate (numerics.md §9.8) that its calibration cannot see: step 7 (+inf for a
row with a non-finite channel, even when the other channels are finite) and §7.6's t2, the Σ P̂² that
ws1 sums, formed by the sm90 chain under both non-exact models."""

from __future__ import annotations

import math

import numpy as np
import pytest

from apa_emu import Config, attention
from apa_emu.constants import EXACT, SM90, SM120
from apa_emu.mma import mma_sm90_f32
from apa_emu.pass1 import p1_self_sums

F32 = np.float32


@pytest.mark.filterwarnings("ignore::apa_emu.NonFiniteOutput")
def test_a_row_with_one_nonfinite_channel_has_an_infinite_estimate():
    """q = 0 makes every weight 1, so row r's FP16 output sum is its key count times v: v = 1000 on
    channel 0 alone passes 65 504 from 66 keys on, the other 63 channels (v = 1) stay finite. Every pair
    with a non-finite channel has err_est = +inf (§9.8 step 7: not NaN, which out − y = inf − inf would
    give); the finite pairs have a finite estimate. Among the former, pairs with finite channels."""
    n, S, d = 16, 72, 64
    q = np.zeros((n, 2, d), np.float16)
    k = np.random.default_rng(0).standard_normal((S, 1, d)).astype(np.float16)
    v = np.ones((S, 1, d), np.float16)
    v[:, 0, 0] = 1000
    res = attention(q, k, v, S - n, config=Config(eps=-1.0))
    out = res.out.astype(np.float64)
    bad = ~np.isfinite(out).all(axis=-1)
    assert np.isposinf(res.err_est[bad]).all(), res.err_est[bad]
    assert np.isfinite(res.err_est[~bad]).all()
    partly = bad & np.isfinite(out).any(axis=-1)
    assert partly.sum() >= 2 * 5 and (~bad).any(), "no pair with both finite and non-finite channels"


def _phat_rows(seed: int) -> np.ndarray:
    """16 rows of 64 FP16 values over a wide range of magnitudes (P̂ is FP16-exact under sm90 and sm120):
    their sums of squares round differently along the sm90 chain and in one binary64 sum."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.5, 2, (16, 64)) * 2.0 ** rng.integers(-14, 6, (16, 64))
    return x.astype(np.float16).astype(F32)


def test_t2_is_the_sm90_chain_under_sm90_and_sm120():
    """§7.6: t2 = the chain of P̂ᵣ against P̂ᵣ itself, the §3.1 (sm90) chain under `sm90` and `sm120`,
    §3.3 under `exact`. For each model, p1_self_sums against the chain run directly (mma_sm90_f32 of the
    row against itself) or a correctly rounded sum (math.fsum of the exact squares) for `exact`; a row
    that does not run has t2 = +0. The rows are ones where the two chains differ."""
    runs = np.ones(16, bool)
    runs[3] = False
    differ = 0
    for seed in range(4):
        phat = _phat_rows(seed)
        chain = np.zeros(16, F32)
        for r in range(16):
            one = np.zeros((1, 1), F32)
            mma_sm90_f32(phat[r:r + 1], phat[r:r + 1], np.zeros((1, 1), F32), one)
            chain[r] = one[0, 0] if runs[r] else 0
        exact = np.array([F32(math.fsum(float(x) ** 2 for x in row)) if ok else F32(0)
                          for row, ok in zip(phat, runs)], F32)
        for model, want in ((SM90, chain), (SM120, chain), (EXACT, exact)):
            t2 = np.full(16, F32(7))
            p1_self_sums(model, phat, runs, t2)
            assert np.array_equal(t2.view(np.uint32), want.view(np.uint32)), (seed, model)
        differ += int((chain != exact).sum())
    assert differ > 0, "no row where the sm90 chain and the exact sum differ"
