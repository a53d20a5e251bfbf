"""Varlen batches (numerics.md §6.6): a packed call is the per-sequence calls, bit for bit, placed at
the sequences' rows; each sequence against float64 attention of its own keys; bad cu_seqlens refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hyp import examples

from apa_emu import Config, attention, reference


@st.composite
def packed(draw):
    B = draw(st.integers(1, 4))
    d = draw(st.sampled_from([64, 128]))
    Hkv, G = draw(st.sampled_from([(1, 1), (1, 3), (2, 2)]))
    n = [draw(st.integers(1, 40)) for _ in range(B)]
    S = [ni + draw(st.integers(0, 150)) for ni in n]
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    q = rng.standard_normal((sum(n), Hkv * G, d)).astype(np.float16)
    k = rng.standard_normal((sum(S), Hkv, d)).astype(np.float16)
    v = rng.standard_normal((sum(S), Hkv, d)).astype(np.float16)
    k[np.cumsum([0] + S[:-1])] += 4  # a sink at each sequence's first key
    cu = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    return q, k, v, cu(n), cu(S)


@settings(deadline=None, max_examples=examples(8))
@given(packed(), st.sampled_from([Config(), Config(eps=0.05), Config(eps=-1.0), Config(hot_test="output")]),
       st.sampled_from([None, 37]))
def test_varlen_is_each_sequence_alone(problem, cfg, window):
    q, k, v, cq, ck = problem
    window = None if window is None else max(window, int(np.max(np.diff(cq))))  # every row keeps a key
    res = attention(q, k, v, 0, cfg, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck, trace="all")
    assert res.out.shape == q.shape and res.err_bound.shape == q.shape[:2]
    for b in range(len(cq) - 1):
        qs, ks, vs = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        off = ks.shape[0] - qs.shape[0]
        alone = attention(qs, ks, vs, off, cfg, window=window, trace="all")
        assert res.out[cq[b]:cq[b + 1]].tobytes() == alone.out.tobytes()
        assert res.err_bound[cq[b]:cq[b + 1]].tobytes() == alone.err_bound.tobytes()
        h = alone.hot[0]
        assert np.array_equal(res.hot[b, :h.shape[0], :h.shape[1], :h.shape[2]], h)
        assert not res.hot[b, :, h.shape[1]:].any() and not res.hot[b, :, :, h.shape[2]:].any()
        for name in ("visits", "rows"):
            mine, theirs = getattr(res, name)[getattr(res, name)["b"] == b], getattr(alone, name).copy()
            assert (theirs["b"] == 0).all()
            theirs["b"] = b  # the sequence's records, renumbered
            assert mine.tobytes() == theirs.tobytes()
        ref = reference(qs, ks, vs, off, window=window) if window else reference(qs, ks, vs, off)
        err = np.linalg.norm(res.out[cq[b]:cq[b + 1]].astype(np.float64) - ref, axis=-1)
        assert np.all(err <= res.err_bound[cq[b]:cq[b + 1]])  # §9.7 holds per sequence


def _packed():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((30, 2, 64)).astype(np.float16)
    k = rng.standard_normal((100, 1, 64)).astype(np.float16)
    return q, k, k.copy()


@pytest.mark.parametrize("cq, ck, kwargs, message", [
    ([0, 10, 10, 30], [0, 40, 70, 100], {}, "cu_seqlens_q is not increasing at sequence 1: 10 then 10"),
    ([1, 10, 30], [0, 40, 100], {}, r"cu_seqlens_q\[0\] = 1: must be 0"),
    ([0, 10, 29], [0, 40, 100], {}, r"cu_seqlens_q\[-1\] = 29: must equal the packed length 30"),
    ([0, 10, 30], [0, 40, 70, 100], {}, "cu_seqlens_q, cu_seqlens_k: 2 and 3 sequences"),
    ([0, 10, 30], [0, 90, 100], {}, "sequence 1 has 20 query rows but 10 keys"),
    ([0, 10, 30], [0, 40, 100], dict(q_offset=5), "q_offset=5: with cu_seqlens"),
    ([0.0, 10.0, 30.0], [0, 40, 100], {}, "cu_seqlens_q: expected an integer array"),
    ([0, 10, 30], None, {}, "cu_seqlens_k: expected an integer array"),
])
def test_bad_cu_seqlens_are_refused(cq, ck, kwargs, message):
    q, k, v = _packed()
    as_array = lambda x: None if x is None else np.array(x)  # noqa: E731
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, kwargs.get("q_offset", 0), cu_seqlens_q=as_array(cq), cu_seqlens_k=as_array(ck))


def test_varlen_needs_packed_inputs():
    q, k, v = _packed()
    with pytest.raises(ValueError, match=r"q: with cu_seqlens, expected packed \[total, heads, d\]"):
        attention(q[None], k[None], v[None], 0, cu_seqlens_q=np.array([0, 30]), cu_seqlens_k=np.array([0, 100]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(warps=[(2, 0, 0)]), r"warps: warp \(2, 0, 0\) does not exist \(b < 2"),
    (dict(trace=[(5, 0, 0)]), r"trace: warp \(5, 0, 0\) does not exist \(b < 2"),
    (dict(warps=[(0, 0, 2)]), r"warps: warp \(0, 0, 2\) does not exist \(b < 1, hk < 1, warp < 2\)"),
])
def test_varlen_warps_and_trace_name_existing_sequences(kwargs, message):
    """A triple is checked against the batch (b = the sequence), then against its own sequence: sequence
    0's 10 rows of 2 heads fill two warps of 16 rows, sequence 1's 20 rows three."""
    q, k, v = _packed()
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, 0, cu_seqlens_q=np.array([0, 10, 30]), cu_seqlens_k=np.array([0, 40, 100]), **kwargs)


def test_varlen_warps_pick_their_sequences():
    """warps= of a varlen call runs those warps of their sequences alone, renumbered; a sequence none of
    whose warps is chosen stays NaN."""
    q, k, v = _packed()
    cq, ck = np.array([0, 10, 30]), np.array([0, 40, 100])
    res = attention(q, k, v, 0, cu_seqlens_q=cq, cu_seqlens_k=ck, warps=[(1, 0, 1)], trace=[(1, 0, 1)])
    alone = attention(q[10:], k[40:], v[40:], 40, warps=[(0, 0, 1)], trace=[(0, 0, 1)])
    assert np.isnan(res.out[:10].astype(np.float32)).all()
    assert res.out[10:].tobytes() == alone.out.tobytes()
    assert (res.visits["b"] == 1).all() and (res.visits["warp"] == 1).all() and res.visits.size
