"""Paged KV (numerics.md §5.0): a paged call is the contiguous call on the keys the table points at,
bitwise, whatever the page size and the order of the pages in the pool; holes are zero keys; bad
tables and pools are refused with a message that names them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hyp import Seen, examples

from apa_emu import Config, attention
from apa_emu.strategies import make_inputs, paginate, problems


def _same(a, b):
    for name in ("out", "err_bound", "hot"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.tobytes() == y.tobytes(), name
    for name in ("visits", "rows"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


@settings(deadline=None, max_examples=examples(8))
@given(problems(), st.sampled_from([1, 16, 48, 64, 256, 5]), st.integers(0, 2**20),
       st.sampled_from([Config(), Config(eps=0.3), Config(eps=-1.0), Config(hot_test="output", eps=0.05)]))
def test_paged_equals_contiguous_with_shuffled_pages(problem, page_size, seed, cfg):
    """The pool holds the problem's pages in a random order beside spare pages of noise; for odd seeds
    one page is a hole, which must act as a page of zero keys and values in the contiguous layout."""
    shape, q_offset = problem
    q, k, v = make_inputs(**shape)
    pool_k, pool_v, table = paginate(k, v, page_size, seed)
    kc, vc = (x.copy() for x in (k, v))
    holes = np.argwhere(table.reshape(-1, table.shape[-1]) < 0)
    for b, j in holes:  # zero that page of the contiguous problem, independently of apa_emu.paging
        for x in (kc, vc):
            (x[b] if x.ndim == 4 else x)[j * page_size:(j + 1) * page_size] = 0
    paged = attention(q, pool_k, pool_v, q_offset, cfg, block_table=table, seqlen_k=shape["S"], trace="all")
    flat = attention(q, kc, vc, q_offset, cfg, trace="all")
    _same(paged, flat)


def test_paged_cases_seen():
    """The property above meets holes, several pages per sequence and page sizes that do not divide S."""
    seen = Seen()
    for seed, (S, ps) in enumerate([(130, 48), (64, 64), (200, 16), (77, 5)]):
        q, k, v = make_inputs(seed, 1, 20, 1, 2, 64, S, "sink", batched=False)
        _, _, table = paginate(k, v, ps, seed)
        seen.update(hole=int((table < 0).any()), multi=int(table.size > 1), ragged=int(S % ps != 0))
        paged = attention(q, *paginate(k, v, ps, seed)[:2], S - 20, block_table=table, seqlen_k=S)
        assert np.isfinite(paged.out.astype(np.float32)).all()
    seen.require("hole", "multi", "ragged")


def _pool():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 2, 64)).astype(np.float16)
    pool = rng.standard_normal((6, 16, 1, 64)).astype(np.float16)
    return q, pool, pool.copy(), np.array([3, 0, 5, 1], np.int32)


@pytest.mark.parametrize("change, message", [
    (dict(block_table=np.array([3, 0, 6, 1], np.int32)), r"block_table\[0, 2\] = 6: not a page of the pool"),
    (dict(block_table=np.array([3, -2, 5, 1], np.int32)), r"block_table\[0, 1\] = -2"),
    (dict(block_table=np.array([3.0, 0.0])), "block_table: expected an integer array"),
    (dict(block_table=[3, 0]), "block_table: expected an integer array"),
    (dict(block_table=np.zeros((2, 4), np.int32)), "block_table: 2 rows for a batch of 1"),
    (dict(block_table=np.zeros((1, 2, 2), np.int32)), "block_table: expected shape"),
    (dict(seqlen_k=65), r"seqlen_k=65: expected an integer in 1\.\.64"),
    (dict(seqlen_k=0), "seqlen_k=0"),
    (dict(k=np.zeros((6, 16, 64), np.float16)), "k: with a block_table, expected a page pool"),
    (dict(v=np.zeros((6, 8, 1, 64), np.float16)), "k, v: page pools differ"),
])
def test_bad_paging_is_refused(change, message):
    q, k, v, table = _pool()
    args = dict(k=k, v=v, block_table=table, seqlen_k=None) | change
    with pytest.raises(ValueError, match=message):
        attention(q, args["k"], args["v"], 56, block_table=args["block_table"], seqlen_k=args["seqlen_k"])


def test_seqlen_k_needs_a_table():
    q, k, v, _ = _pool()
    with pytest.raises(ValueError, match="seqlen_k: only with a block_table"):
        attention(q, k[0], v[0], 8, seqlen_k=16)


def test_non_finite_values_count_only_where_the_table_reads():
    q, k, v, table = _pool()
    k[2, 3, 0, 7] = np.inf  # page 2: not in the table
    attention(q, k, v, 56, block_table=table)
    k[5, 3, 0, 7] = np.nan  # page 5 is the table's third page: key 2·16 + 3
    with pytest.raises(ValueError, match=r"k: non-finite value nan at index \(35, 0, 7\)"):
        attention(q, k, v, 56, block_table=table)
