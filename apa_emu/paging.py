"""Paged KV (numerics.md §5.0): page pools [pages, page_size, Hkv, d] read through a block table.

The checks are the call contract's (apa_emu/call.py), so the emulator and the kernel's launcher refuse
the same inputs with the same message; the emulator then gathers the pools into the contiguous
layout, which defines the paged call.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MAX_INT32 = 2**31 - 1


class Pages(NamedTuple):
    """A checked block table: int32 [B, max_pages], the page size, the pool's pages and S."""

    table: np.ndarray
    page_size: int
    pages: int
    S: int


def check_pages(block_table, k_shape: tuple, v_shape: tuple, q_ndim: int, batch: int, seqlen_k) -> Pages:
    """Validate ``block_table`` (host array) against the pools' shapes and q's batch; every problem
    is a ValueError naming the argument."""
    if not isinstance(block_table, np.ndarray) or block_table.dtype.kind not in "iu":
        kind = type(block_table).__name__ if not isinstance(block_table, np.ndarray) else block_table.dtype
        raise ValueError(f"block_table: expected an integer array [batch, max_pages], got {kind}")
    bt = block_table[None] if block_table.ndim == 1 else block_table
    if bt.ndim != 2 or bt.shape[1] < 1:
        raise ValueError(f"block_table: expected shape [batch, max_pages] (or [max_pages]), got {block_table.shape}")
    for name, shape in (("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name}: with a block_table, expected a page pool [pages, page_size, kv_heads, d], "
                             f"got shape {shape}")
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k, v: page pools differ in shape ({k_shape} vs {v_shape})")
    pages, page_size = k_shape[0], k_shape[1]
    if pages < 1 or page_size < 1:
        raise ValueError(f"k: the page pool {k_shape} holds no key")
    want_batch = batch if q_ndim == 4 else 1
    if bt.shape[0] != want_batch:
        raise ValueError(f"block_table: {bt.shape[0]} rows for a batch of {want_batch} (one row of pages per "
                         f"sequence)")
    bad = (bt < -1) | (bt >= pages)
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(bt[b, j])}: not a page of the pool (0 <= page < {pages}, "
                         f"or -1 for a hole)")
    cap = bt.shape[1] * page_size
    if seqlen_k is None:
        S = cap
    elif isinstance(seqlen_k, bool) or not isinstance(seqlen_k, (int, np.integer)) or not 1 <= seqlen_k <= cap:
        raise ValueError(f"seqlen_k={seqlen_k!r}: expected an integer in 1..{cap} (max_pages {bt.shape[1]} x "
                         f"page_size {page_size})")
    else:
        S = int(seqlen_k)
    if S > MAX_INT32 // 2:
        raise ValueError(f"seqlen_k: {S} keys are past the kernel's int32 key positions")
    return Pages(np.ascontiguousarray(bt, dtype=np.int32), int(page_size), int(pages), S)


def gather(pool: np.ndarray, pages: Pages) -> np.ndarray:
    """The contiguous [B, S, Hkv, d] keys (or values) of a pool: key s of row b is row s mod ps of
    page table[b, s div ps]; a hole (-1) reads as zeros (§5.0)."""
    B = pages.table.shape[0]
    s = np.arange(pages.S)
    page = pages.table[:, s // pages.page_size]  # [B, S]
    out = pool[np.maximum(page, 0), s % pages.page_size]  # [B, S, Hkv, d]
    out[page < 0] = 0
    return out.reshape(B, pages.S, *pool.shape[2:])
