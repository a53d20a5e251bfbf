"""The call contract at its edges: a window whose last row keeps exactly one key against one that keeps
none (§6.1), and warps= of a varlen call choosing a warp of the first sequence (§6.6)."""

from __future__ import annotations

import numpy as np
import pytest

from apa_emu import attention, reference


def _qkv(n: int, S: int, seed: int = 0, H: int = 1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, H, 64)).astype(np.float16),
            *(rng.standard_normal((S, 1, 64)).astype(np.float16) for _ in range(2)))


def test_a_window_that_keeps_one_key_runs_and_one_that_keeps_none_is_refused():
    """One row at position q_offset = S = 100 against keys 0..99: window = 2 starts at key 99, the last
    key, so the row sees exactly that key and its output is v[99] (float64 attention of one key says
    so); window = 1 starts at key 100, past the last: the contract refuses it by name."""
    q, k, v = _qkv(1, 100)
    res = attention(q, k, v, 100, window=2)
    want = reference(q, k[99:], v[99:], 0)
    np.testing.assert_allclose(res.out.astype(np.float64), want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(want[0, 0], v[99, 0].astype(np.float64), rtol=1e-6)
    with pytest.raises(ValueError, match=r"window=1\b.*no key"):
        attention(q, k, v, 100, window=1)


def test_varlen_warps_of_the_first_sequence_leave_the_others_uncomputed():
    """Two sequences of 16 rows and 100 keys each, warps=[(0, 0, 0)] and the same trace: sequence 0's
    rows are its call alone, bit for bit; sequence 1's rows stay NaN and none of its warps is traced."""
    q, k, v = _qkv(32, 200, seed=4)
    cu_q, cu_k = np.array([0, 16, 32], np.int32), np.array([0, 100, 200], np.int32)
    res = attention(q, k, v, 0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, warps=[(0, 0, 0)], trace=[(0, 0, 0)])
    alone = attention(q[:16], k[:100], v[:100], 84)
    assert res.out[:16].tobytes() == alone.out.tobytes()
    assert np.isnan(res.out[16:].astype(np.float32)).all()
    assert res.visits.size and (res.visits["b"] == 0).all()
    assert res.rows.size and (res.rows["b"] == 0).all()
