"""Varlen batches (numerics.md §6.6): packed sequences of different query and key lengths, given by
cu_seqlens as FlashAttention and cuDNN take them.

Sequence b is an independent problem (its own prep statistics, geometry and warps) on rows
cu_seqlens_q[b] .. cu_seqlens_q[b+1] − 1 of q and keys cu_seqlens_k[b] .. cu_seqlens_k[b+1] − 1 of k and
v, bottom-right causal (q_offset = S_b − n_b). ``check`` refuses bad calls for both sides; the emulator
runs a call's sequences one by one (apa_emu/call.py ``Call.sequences``, built as the call is resolved)
and ``pack`` packs their results (the kernel runs the whole batch in one launch instead).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from .geometry import Shape


def check_cu_seqlens(cu, name: str, total: int) -> np.ndarray:
    """A cu_seqlens array: integers [B + 1] from 0, strictly increasing, ending at ``total``."""
    if not isinstance(cu, np.ndarray) or cu.dtype.kind not in "iu" or cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name}: expected an integer array [batch + 1] of cumulative lengths, got "
                         f"{getattr(cu, 'dtype', type(cu).__name__)} {getattr(cu, 'shape', '')}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name}[0] = {cu[0]}: must be 0")
    bad = np.flatnonzero(np.diff(cu) <= 0)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{name} is not increasing at sequence {b}: {cu[b]} then {cu[b + 1]} (every sequence "
                         f"needs at least one row)")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] = {cu[-1]}: must equal the packed length {total}")
    return cu


class Seqs(NamedTuple):
    """The checked cu_seqlens of a varlen call: sequence b is rows cq[b] .. cq[b+1] − 1, keys
    ck[b] .. ck[b+1] − 1."""

    cq: np.ndarray  # int64 [B + 1]
    ck: np.ndarray

    @property
    def n(self) -> np.ndarray:
        return np.diff(self.cq)

    @property
    def S(self) -> np.ndarray:
        return np.diff(self.ck)

    def shapes(self, H: int, Hkv: int, d: int, window) -> tuple[list[Shape], Shape]:
        """Each sequence's Shape (§6.6: bottom-right causal), and the longest sequence's rows and keys
        as one Shape of B = the sequences: what sizes the kernel's per-(b, hk) buffers in one launch
        (apa_gpu.plan.Plan)."""
        each = [Shape(B=1, n=int(n), H=H, Hkv=Hkv, S=int(S), d=d, q_offset=int(S - n), window=window)
                for n, S in zip(self.n, self.S)]
        n, S = max(e.n for e in each), max(e.S for e in each)
        return each, Shape(B=len(each), n=n, H=H, Hkv=Hkv, S=S, d=d, q_offset=S - n, window=window)


def check(q, k, v, q_offset, cu_seqlens_q, cu_seqlens_k, block_table=None) -> Seqs:
    """Refuse what a varlen call cannot be (§6.6), naming it; the values of q, k and v are the
    caller's to validate, packed, so that a bad one is named by its packed index."""
    if q_offset != 0:
        raise ValueError(f"q_offset={q_offset}: with cu_seqlens each sequence is bottom-right causal "
                         f"(q_offset = its keys − its rows); pass 0")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name}: with cu_seqlens, expected packed [total, heads, d], got shape "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if block_table is not None:
        raise ValueError("block_table: paged KV with cu_seqlens is not supported; pass one or the other")
    cq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    ck = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: {cq.shape[0] - 1} and {ck.shape[0] - 1} sequences")
    seqs = Seqs(cq, ck)
    n, S = seqs.n, seqs.S
    short = np.flatnonzero(n > S)
    if short.size:
        b = int(short[0])
        raise ValueError(f"cu_seqlens: sequence {b} has {n[b]} query rows but {S[b]} keys; bottom-right causal "
                         f"needs rows <= keys, or its first row sees no key")
    return seqs


def pack(parts, q, cq):
    """The sequences' results (§6.6) packed as one Result: ``out`` [total_q, H, d], ``err_bound`` and
    ``err_est`` [total_q, H], hot masks padded to the longest sequence's warps and words, trace records with
    b = the sequence; rows of skipped sequences (None) stay NaN."""
    done = [p for p in parts if p is not None]
    first = done[0]
    out = np.full(q.shape, np.nan, np.float16)
    bound, est = np.full(q.shape[:2], np.nan, np.float32), np.full(q.shape[:2], np.nan, np.float32)
    shape = (len(parts), *(max(p.hot.shape[i] for p in done) for i in (1, 2, 3)))
    hot = np.zeros(shape, np.uint32)
    visits, rows = [], []
    for b, p in enumerate(parts):
        if p is None:
            continue
        out[cq[b]:cq[b + 1]] = p.out
        bound[cq[b]:cq[b + 1]] = p.err_bound
        est[cq[b]:cq[b + 1]] = p.err_est
        h = p.hot[0]
        hot[b, :h.shape[0], :h.shape[1], :h.shape[2]] = h
        for recs, acc in ((p.visits, visits), (p.rows, rows)):
            if recs is not None:
                recs = recs.copy()
                recs["b"] = b
                acc.append(recs)
    return dataclasses.replace(
        first, out=out, err_bound=bound, err_est=est, hot=hot,
        active_tiles=sum(p.active_tiles for p in done), hot_tiles=sum(p.hot_tiles for p in done),
        visits=np.concatenate(visits) if visits else None, rows=np.concatenate(rows) if rows else None,
        meta=dict(first.meta, sequences=[None if p is None else p.meta for p in parts]))
