"""Sliding window (numerics.md §6.1, §6.3, §6.4): against float64 attention with the same window,
against full causal attention where the window covers everything, and the geometry of the visits
against the key positions, computed here independently of apa_emu.geometry."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hyp import Seen, examples

from helpers import merged_f64

from apa_emu import Config, attention, reference
from apa_emu.reference import reference_rows
from apa_emu.study.synth import synthetic

ALL_OFF = dict(quant_q=False, quant_k=False, quant_p=False, quant_v=False)


@st.composite
def windowed(draw):
    d = draw(st.sampled_from([64, 128]))
    G = draw(st.sampled_from([1, 3]))
    kv = draw(st.integers(70, 520))
    n = draw(st.integers(1, min(kv, 48)))
    off = draw(st.integers(0, kv - n))
    W = draw(st.integers(1, kv + 10))
    dump = synthetic(n, kv, 2 * G, 2, d, seed=draw(st.integers(0, 2**31 - 1)), q_offset=off,
                     sink=draw(st.sampled_from([0.0, 6.0])), locality=draw(st.sampled_from([0.0, 3.0])))
    return dump.q, dump.k, dump.v, off, W


def test_window_covering_every_key_is_full_causal():
    """W ≥ q_offset + n keys hides nothing: every output, bound and trace record is bitwise the
    full causal run's."""
    dump = synthetic(40, 700, 4, 2, 64, seed=5, q_offset=660)
    for cfg in (Config(), Config(eps=0.3), Config(eps=-1.0)):
        full = attention(dump.q, dump.k, dump.v, 660, cfg, trace="all")
        win = attention(dump.q, dump.k, dump.v, 660, cfg, window=700, trace="all")
        assert full.out.tobytes() == win.out.tobytes() and full.err_bound.tobytes() == win.err_bound.tobytes()
        assert full.visits.tobytes() == win.visits.tobytes() and full.rows.tobytes() == win.rows.tobytes()


def test_window_matches_float64_and_visits_only_visible_tiles():
    """Unquantized with the `exact` MMA model (as test_unquantized_exact_matches_float64): the merged
    binary32 result is within 1e-5 of float64 attention with the same window; pass 1 visits exactly the
    tiles that hold a key some row of the warp sees, tile 0 first when it is one of them, and rows that
    see nothing in the first visited tile (c = −inf) stay finite."""
    seen = Seen()

    blind = synthetic(16, 1024, 2, 2, 64, seed=11, q_offset=625)  # positions 625..640: tile 10 first

    @settings(deadline=None, max_examples=examples(12))
    @given(windowed(), st.sampled_from([0.3, 1e9]))
    @example((blind.q, blind.k, blind.v, 625, 200), 0.3)
    def prop(problem, eps):
        q, k, v, off, W = problem
        n, H, _ = q.shape
        G = H // k.shape[1]
        cfg = Config(eps=eps, mma="exact", p2_accum="f32", **ALL_OFF)
        res = attention(q, k, v, off, cfg, window=W, trace="all")
        rows = res.rows
        ref = reference_rows(q, k, v, off, rows["row"] // G, rows["hk"] * G + rows["row"] % G,
                             cfg.softmax_scale(q.shape[2]), window=W)
        got = merged_f64(rows)
        assert np.all(np.isfinite(res.out)) and np.sqrt(((got - ref) ** 2).sum() / (ref**2).sum()) <= 1e-5
        S = k.shape[0]
        for rec in np.unique(res.visits[["hk", "warp"]]):
            hk, w = int(rec["hk"]), int(rec["warp"])
            visits = res.visits[(res.visits["hk"] == hk) & (res.visits["warp"] == w)]["tile"]
            rows = np.arange(16 * w, min(16 * w + 16, n * G))
            pos = off + rows // G
            lo, hi = np.maximum(pos - W + 1, 0), np.minimum(pos, S - 1)
            holds = {t for t in range((S + 63) // 64) if np.any((lo <= 64 * t + 63) & (hi >= 64 * t))}
            assert set(visits.tolist()) == holds and len(visits) == len(holds)
            assert (visits[0] == 0) == (0 in holds)
            first = visits[0]
            blind = ~((lo <= 64 * first + 63) & (hi >= 64 * first))
            seen.update(window_cuts=int(lo.min() > 0), blind_first_tile=int(blind.any()))
        seen.update(cold=int(res.hot_tiles < res.active_tiles), hot=int(res.hot_tiles > 0))

    prop()
    seen.require("window_cuts", "blind_first_tile", "cold", "hot")


def test_row_blind_to_the_first_visited_tile():
    """A warp whose last row starts a new tile: the diagonal order visits that tile first, where the
    warp's other 15 rows see nothing (c = −inf, §7.4). Their P̂ stays 0 and their output is right."""
    S, W, d = 1024, 200, 64
    off = 64 * 10 - 15  # rows 0..14 end in tile 9, row 15 sees key 640 of tile 10
    dump = synthetic(16, S, 1, 1, d, seed=11, q_offset=off)
    cfg = Config(eps=1e9, mma="exact", **ALL_OFF)
    res = attention(dump.q, dump.k, dump.v, off, cfg, window=W, trace="all")
    first = res.visits[0]
    assert first["tile"] == 10 and np.all(first["c"][:15] == -np.inf) and first["c"][15] > -np.inf
    ref = reference(dump.q, dump.k, dump.v, off, cfg, window=W)
    got = merged_f64(res.rows).reshape(ref.shape)
    assert np.sqrt(((got - ref) ** 2).sum() / (ref**2).sum()) <= 1e-5


@pytest.mark.parametrize("window, match", [
    (0, "must be >= 1"), (-4, "must be >= 1"), (2.5, "positive integer"), (True, "positive integer"),
])
def test_bad_window_is_refused(window, match):
    dump = synthetic(8, 200, 2, 1, 64, seed=1, q_offset=192)
    with pytest.raises(ValueError, match=match):
        attention(dump.q, dump.k, dump.v, 192, window=window)


def test_window_leaving_a_row_without_keys_is_refused():
    """q_offset past the keys with a short window: the last row's window starts after key S − 1."""
    dump = synthetic(8, 200, 2, 1, 64, seed=1, q_offset=192)
    with pytest.raises(ValueError, match="would see no key"):
        attention(dump.q, dump.k, dump.v, 300, window=50)
