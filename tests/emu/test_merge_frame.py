"""The merge's frame (numerics.md §9.1): only a state that holds mass sets it. A pass-1 state with no
mass (every visited tile hot) can leave its FP4 frame far above pass 2's exact maximum; taken as the
frame, it scaled the exact part to 0 and the output to 0 ⊘ 0 (fuzz-2026-12 S1)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hyp import Seen, examples

from apa_emu import Config, attention, reference
from apa_emu.strategies import large_logits, make_inputs

# A sink hot and the rest cold, rows whose cold frame lags pass 2's by over 16 log2 units (§7.8's δ).
LAGGING = (*make_inputs(1, 1, 20, 1, 2, 64, 1020, "sink", batched=False), 1000, Config(eps=0.005))


def _fuzz_problem(cfg: Config):
    """fuzz-2026-12 S1's problem: scores large enough that pass 1's FP4 frame overshoots on rows
    whose every tile is hot."""
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((64, 2, 64)) * 20).astype(np.float16)
    k = (rng.standard_normal((128, 1, 64)) * 20).astype(np.float16)
    v = rng.standard_normal((128, 1, 64)).astype(np.float16)
    return q, k, v, 64, cfg


FUZZ = _fuzz_problem(Config())


def _massless_above(rows) -> np.ndarray:
    """Rows whose pass 1 holds no mass while its frame sits above pass 2's, which holds some."""
    return (rows["l1"] == 0) & (rows["m1"] > rows["m2"]) & (rows["l2"] > 0)


def test_fuzz_reproducer_is_finite_and_within_its_bound():
    q, k, v, _, _ = FUZZ
    res = attention(q, k, v, 64, trace="all")
    assert _massless_above(res.rows).any()  # the case the old frame got wrong
    ref = reference(q, k, v, 64)
    err = np.linalg.norm(res.out.astype(np.float64) - ref, axis=-1)
    assert np.isfinite(res.out).all() and (err <= res.err_bound).all()


def test_large_logits_give_finite_outputs_where_the_reference_is_finite():
    """Scales up to 10³, every tile hot, every tile cold, pass 1's frame far above pass 2's (without
    mass) and far below it (with): no non-finite output where the float64 reference is finite inside
    §8.7's range, and the certificate holds there."""
    seen = Seen()

    @settings(deadline=None, max_examples=examples(40))
    @given(large_logits())
    # together, the examples meet every required case whatever the draws: LAGGING's rows far below,
    # S1's problem at scale 10³ every tile hot with massless frames above, and at ε = 10⁹ every tile cold
    @example(LAGGING)
    @example(_fuzz_problem(Config(scale=1000.0)))
    @example(_fuzz_problem(Config(eps=1e9)))
    def prop(problem):
        q, k, v, off, cfg = problem
        res = attention(q, k, v, off, cfg, trace="all")
        ref = reference(q, k, v, off, cfg)
        finite = np.isfinite(ref).all(axis=-1)
        assert np.isfinite(res.out[finite]).all()
        err = np.linalg.norm(res.out.astype(np.float64) - ref, axis=-1)
        assert (err[finite] <= res.err_bound[finite]).all()
        rows = res.rows
        gap = rows["m1"] - rows["m2"]
        both = (rows["l1"] > 0) & (rows["l2"] > 0)
        seen.update(scale_1000=cfg.scale == 1000.0, all_hot=res.hot_tiles == res.active_tiles,
                    all_cold=res.hot_tiles == 0, massless_above=int(_massless_above(rows).sum()),
                    far_below=int((both & (gap < -16)).sum()))

    prop()
    seen.require("scale_1000", "all_hot", "all_cold", "massless_above", "far_below")


def test_a_nan_from_no_mass_is_named_as_such_not_as_an_overflow():
    from apa_emu import trace as tr
    from apa_emu.trace import overflow_stage

    rec = np.zeros((), tr.row_dtype(64))
    rec["out"] = np.nan
    assert overflow_stage(rec) == ("the merge (FP16 output): 0/0, neither pass holds mass for the row "
                                   "(l1 = l2 = 0): out holds NaN")
    rec["l2"], rec["out"] = 1.0, np.inf
    assert overflow_stage(rec) == "the merge (FP16 output) overflowed: out holds Inf"
