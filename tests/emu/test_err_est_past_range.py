"""§9.8 step 7: err_est is never NaN on a computed row. Past §8.7's range a variance or the
denominator can be infinite while the output stays finite; err_est is then +inf (it claims nothing,
as err_bound there), and NaN stays the mark of a row not computed."""

from __future__ import annotations

import warnings

import numpy as np

from apa_emu import Config, attention, reference
from apa_emu.problems import make_inputs


def test_err_est_is_inf_not_nan_where_the_output_is_finite_past_the_range():
    # fuzz-2026-12b S7: an "extreme" problem with max |q·k| about 9e6, far past §8.7's 65504
    q, k, v = make_inputs(1367244369, 1, 29, 2, 4, 64, 321, "extreme", batched=False)
    cfg = Config(p_scale="pow2", tile_order="ascending", mma="exact", hot_test="budget", quant_p=False, eps=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = attention(q, k, v, 321 - 29, cfg)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    qk = max(np.abs(q64[:, h] @ k64[:, h // 4].T).max() for h in range(8))
    assert qk > 65504, "the problem must lie past §8.7's range"
    finite = np.isfinite(res.out).all(-1)
    assert finite.all()
    assert not np.isnan(res.err_est).any(), "a computed pair's err_est is NaN"
    err = np.linalg.norm(res.out.astype(np.float64) - reference(q, k, v, 321 - 29, cfg), axis=-1)
    gave_up = np.isinf(res.err_est)
    assert gave_up.any(), "the problem no longer reaches the NaN case of step 6"
    assert np.isinf(res.err_bound[gave_up]).all(), "err_est gave up where err_bound still claims a bound"
    assert np.isfinite(err[gave_up]).all()
