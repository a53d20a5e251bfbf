"""``Result.overflow`` and the NonFiniteOutput warning: which computed pairs are not finite, and the
stage of §10's row record that made them so, from ``attention`` itself (the CLI's `apa pair` says
the same from its own trace)."""

from __future__ import annotations

import warnings

import numpy as np

from apa_emu import Config, KVState, NonFiniteOutput, attention
from apa_emu.strategies import make_inputs

SCORES = "pass 2 (FP16 scores q·k, row max and sum) overflowed: m2 holds Inf"
OUTPUT = "pass 2 (FP16 output accumulation P·V) overflowed: o2 holds Inf"


def _call(*args, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = attention(*args, **kw)
    return res, [w for w in caught if issubclass(w.category, NonFiniteOutput)]


def _bad(res) -> set:
    return {tuple(int(i) for i in ix) for ix in np.argwhere(~np.isfinite(res.out.astype(np.float64)).all(-1)
                                                             & ~np.isnan(res.err_bound))}


def _heavy_values(n=8, S=600, H=2, d=64):
    """q = 0: every score is 0, every weight 1 in pass 2's frame, so the FP16 output sum of a row is
    its number of keys times v. v = 1000 on channel 0 passes 65504 once a row sees 66 keys."""
    q = np.zeros((n, H, d), np.float16)
    k = np.random.default_rng(0).standard_normal((S, 1, d)).astype(np.float16)
    v = np.ones((S, 1, d), np.float16)
    v[:, 0, 0] = 1000
    return q, k, v


def test_finite_outputs_say_nothing():
    q, k, v = make_inputs(1, 1, 40, 1, 2, 64, 300, "sink", batched=False)
    res, caught = _call(q, k, v, 260)
    assert res.overflow == [] and caught == []


def test_scores_past_fp16_name_pass_2s_scores():
    """q and k × 300: q·k passes 65504 (the float64 partial sums say so independently, §8.7), in every
    pair, while pass 1 (binary32 scores) stays finite."""
    q, k, v = make_inputs(79, 1, 64, 1, 2, 64, 128, "normal", batched=False)
    q, k = ((x.astype(np.float32) * 300).astype(np.float16) for x in (q, k))
    assert np.abs(np.einsum("nhd,sd->nhs", q.astype(np.float64), k[:, 0].astype(np.float64))).max() > 65504
    res, caught = _call(q, k, v, 64, Config(eps=-1.0))
    assert len(caught) == 1 and f"{len(res.overflow)} (row, head) pair(s)" in str(caught[0].message)
    assert {o.index for o in res.overflow} == _bad(res) and len(res.overflow) > 0
    assert {o.stage for o in res.overflow} == {SCORES}


def test_an_output_sum_past_fp16_names_the_output_accumulation():
    """Row r sees 57 + r keys, so its exact output sum is 1000·(57 + r) on channel 0: under 65 504 up
    to 65 keys, over it from 66. The rows well below stay finite, those well above are listed, and the
    list is exactly the non-finite pairs."""
    q, k, v = _heavy_values(n=16, S=72)
    res, caught = _call(q, k, v, 56, Config(eps=-1.0))
    rows = {o.index[0] for o in res.overflow}
    assert {o.stage for o in res.overflow} == {OUTPUT} and {o.index for o in res.overflow} == _bad(res)
    assert rows >= set(range(11, 16)) and not rows & set(range(0, 6)), sorted(rows)
    assert len(caught) == 1
    windowed, caught = _call(q, k, v, 56, Config(eps=-1.0), window=60)  # 60 keys: 60 000 < 65 504
    assert windowed.overflow == [] and caught == [] and np.isfinite(windowed.out).all()


def test_batched_and_uncomputed_rows():
    """(b, row, head) indices; a batch entry whose warps were not asked holds NaN and is not listed."""
    q, k, v = _heavy_values(n=8, S=600)
    qb, kb, vb = np.stack([q, q]), np.stack([k, k]), np.stack([v, v])
    vb[1] = 1  # the second entry's values are small: finite
    res, caught = _call(qb, kb, vb, 592, Config(eps=-1.0))
    assert {o.index[0] for o in res.overflow} == {0} and {o.index for o in res.overflow} == _bad(res)
    part, _ = _call(qb, kb, vb, 592, Config(eps=-1.0), warps=[(1, 0, 0)])
    assert part.overflow == [] and np.isnan(part.out[0]).all()


def test_varlen_indices_are_packed_rows():
    q, k, v = _heavy_values(n=8, S=600)
    qs, ks, vs = np.concatenate([q, q]), np.concatenate([k[:40], k]), np.concatenate([v[:40], v])
    cu_q, cu_k = np.array([0, 8, 16]), np.array([0, 40, 640])
    res, _ = _call(qs, ks, vs, 0, Config(eps=-1.0), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert {o.index for o in res.overflow} == _bad(res) and {o.index[0] for o in res.overflow} == set(range(8, 16))
    assert {o.stage for o in res.overflow} == {OUTPUT}


def test_a_chunk_leaves_its_state_as_a_call_without_the_diagnosis():
    """The stage comes from a rerun of the chunk from the state as it was: the caller's state records
    one call, as a twin state fed the same chunks does."""
    q, k, v = _heavy_values(n=16, S=600)
    kept, twin = KVState(), KVState()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteOutput)
        for state in (kept, twin):
            attention(q[:8], k[:592], v[:592], 584, kv_state=state)
    res, caught = _call(q[8:], k, v, 592, Config(eps=-1.0), kv_state=kept)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteOutput)
        plain = attention(q[8:], k, v, 592, Config(eps=-1.0), kv_state=twin)
    assert len(caught) == 1 and {o.stage for o in res.overflow} == {OUTPUT}
    assert kept.history == twin.history and len(kept.history) == 2 and kept.last == twin.last
    assert np.array_equal(res.out.view(np.uint16), plain.out.view(np.uint16))


def test_the_warning_names_the_first_pair():
    q, k, v = _heavy_values()
    res, caught = _call(q, k, v, 592, Config(eps=-1.0))
    first = res.overflow[0]
    assert str(first.index) in str(caught[0].message) and first.stage in str(caught[0].message)


def test_each_pair_gets_its_own_rows_stage():
    """Two query heads on one KV head, packed as alternate rows of the same warps (§6.2): head 0
    overflows pass 2's output (q = 0), head 1 its scores (q along the keys, × 2000). Each pair's stage
    is its own row's."""
    q, k, v = _heavy_values(n=16, S=600)
    q[:, 1] = (k[:16, 0].astype(np.float32) * 2000).astype(np.float16)  # q·k about 2000·64
    res, _ = _call(q, k, v, 584, Config(eps=-1.0))
    stages = {o.index: o.stage for o in res.overflow}
    assert set(stages) == _bad(res) == {(r, h) for r in range(16) for h in range(2)}
    assert {stages[r, 0] for r in range(16)} == {OUTPUT} and {stages[r, 1] for r in range(16)} == {SCORES}
