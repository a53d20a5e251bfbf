"""The budget hot test (numerics.md §7.7) at its edges: the vote is a strict > (a row whose two sides are
equal, a row with no mass and no visible key among them, never makes a tile hot), and padding rows that
vote under pad_vote (§6.2) form βr from qstat's +0, not from the row R − 1 whose keys they see."""

from __future__ import annotations

import numpy as np
from helpers import budget_edge_rows, emulated_budget_vote

from apa_emu import Config
from apa_emu.api import HeadRunner
from apa_emu.geometry import ROWS, Shape
from apa_emu.prep import prepare

F32 = np.float32


def test_budget_vote_is_strict_at_the_edge():
    """Rows whose t2 equals βr ⊗ (L ⊗ L) (ws = +0), or lies one ulp below or above it, by float32 NumPy:
    hot exactly where t2 is above. And a row with la = ws = +0 that sees no key of the tile (c = m = −inf,
    tl = t2 = +0): 0 > βr ⊗ 0 is false, so it votes cold whatever its budget."""
    ops, right, _ = budget_edge_rows(600, 5)
    t2 = ops[5]
    np.testing.assert_array_equal(emulated_budget_vote(*ops), t2 > right)
    assert (t2 == right).sum() == 200 and (t2 > right).sum() == 200
    for beta in (F32(0.25), F32(1e-30), F32(np.inf)):
        empty = [F32([x]) for x in (-np.inf, 0, 0, -np.inf, 0, 0, beta)]
        assert not emulated_budget_vote(*empty)[0], beta


def _beta64(eps: float, cq, qn, eq, kvstat, d: int) -> np.ndarray:
    """§7.7's βr = ε²·X/κ in float64 (§9.8 steps 1–2, ρ = 2⁻⁷ with P' quantized)."""
    km, ekm, vm, evm = (float(x) for x in kvstat[5:9])
    s1 = ((eq * km) ** 2 + (qn * ekm) ** 2) * (cq * np.log(2.0)) ** 2 * 2 / d
    return eps**2 * vm**2 / ((s1 + 2.0**-7) * vm**2 + evm**2)


def test_padding_rows_form_their_budget_from_zero_query_statistics():
    """n = 10 rows of G = 3 heads: 30 packed rows, so warp 1 holds 14 real rows and 2 padding rows, which
    vote under pad_vote. Each row's βr, as pass 1 receives it (HeadRunner.p1_inputs), against float64:
    a real row's from its own (qn, eq) and c_q, a padding row's from qn = eq = +0 and the c_q pass 1
    reads. Row R − 1's statistics would give the padding rows a budget smaller by far more than the
    tolerance."""
    rng = np.random.default_rng(2)
    n, G, S, d = 10, 3, 300, 64
    q = (2 * rng.standard_normal((n, G, d))).astype(np.float16)
    k, v = (rng.standard_normal((S, 1, d)).astype(np.float16) for _ in range(2))
    off, eps = S - n, 0.05
    cfg = Config(hot_test="budget", pad_vote=True, eps=eps)
    shape = Shape(B=1, n=n, H=G, Hkv=1, S=S, d=d, q_offset=off)
    prep = prepare(q, k, v, off, cfg, first_key=0)
    runner = HeadRunner(shape, 0, 0, prep, cfg, cfg.flags())
    wr = shape.warp_rows(1)
    _, rows, _ = runner.p1_inputs(wr)
    real, pad = wr.valid, ~wr.valid
    assert real.sum() == n * G - ROWS and pad.sum() == 2 and rows.runs[pad].all()
    cq = rows.cq.astype(np.float64)
    qs = prep.qstat[0, np.where(real, wr.rows, 0)].astype(np.float64)
    qn, eq = np.where(real, qs[:, 0], 0.0), np.where(real, qs[:, 1], 0.0)
    want = _beta64(eps, cq, qn, eq, prep.kvstat[0], d)
    np.testing.assert_allclose(rows.beta, want, rtol=1e-5)
    last = prep.qstat[0, n * G - 1].astype(np.float64)
    borrowed = _beta64(eps, cq[pad], last[0], last[1], prep.kvstat[0], d)
    assert np.all(np.abs(borrowed / want[pad] - 1) > 1e-3), (borrowed, want[pad])
