"""How a scan ranks pairs by their predicted error (``apa worst --by est`` or ``--by bound``): err_est
or err_bound over ‖out‖, against the FP16 outputs' own float64 norms, worst first, a non-finite output
before every pair and a pair with no estimate after every one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from apa_emu import Config
from apa_emu.study.scan import Pairs, run_pairs
from apa_emu.study.synth import synthetic


@pytest.fixture(scope="module")
def scan():
    d = synthetic(24, 200, 4, 2, 64, seed=1)
    return run_pairs(d, Config(eps=0.05), Pairs.select(d.n, d.nh), backend="cpu")


@pytest.mark.parametrize("by", ("est", "bound"))
def test_predicted_error_is_the_estimate_over_the_output_norm(scan, by):
    """predicted(by) = err_est (err_bound) ⊘ ‖out‖₂ per pair, ‖out‖ from the FP16 output in float64;
    rank(by) orders the pairs by it, largest first."""
    norm = np.sqrt((scan.out.astype(np.float64) ** 2).sum(axis=1))
    score = {"est": scan.est, "bound": scan.bound}[by].astype(np.float64)
    want = score / norm
    assert scan.finite.all() and np.isfinite(want).all() and np.ptp(norm) > 0.1 * norm.max()
    np.testing.assert_allclose(scan.predicted(by), want, rtol=1e-12)
    ranked = want[scan.rank(by)]
    assert (np.diff(ranked) <= 0).all()


def test_a_pair_with_no_estimate_ranks_last_and_a_nonfinite_one_first(scan):
    """An engine that gives no err_est for a pair (NaN) leaves it after every pair with one, even the
    one with the smallest predicted error; a pair whose output is not finite comes before every pair."""
    est, finite = scan.est.copy(), scan.finite.copy()
    least = int(np.argmin(scan.predicted("est")))
    none, bad = (least + 1) % len(est), (least + 2) % len(est)
    est[none], finite[bad] = np.nan, False
    order = replace(scan, est=est, finite=finite).rank("est").tolist()
    assert order[0] == bad and order[-1] == none and order[-2] == least
