"""Float64 attention and the per-pair error sums of the studies, written once for NumPy and CuPy: the
array module ``xp`` is an argument, so the CPU and GPU engines run the same arithmetic in the same
order and their tables agree to rounding.

The reference is numerics.md §11's oracle streamed over keys: an online softmax in float64 over
blocks of ``KEY_BLOCK`` keys, so memory stays at one block of scores for a chunk of pairs whatever
the number of keys. It works on the query heads of one KV head at a time, reading that head's K and V
once for all of them (GQA without copying K and V per query head).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..geometry import ROWS, TILE

# Keys per block: whole 64-key tiles (the hot split goes tile by tile) and the same block boundaries
# on every engine, so the online softmax rescales at the same keys on the CPU and on the GPU.
KEY_BLOCK = 32 * TILE


class Reference(NamedTuple):
    """Float64 outputs of a set of pairs (on the engine's device) and, when split by a hot mask, the
    norms of the hot and cold parts of each output and the cold share of its softmax mass."""

    out: object  # xp [P, d] float64
    hot_norm: object | None  # xp [P]
    cold_norm: object | None
    cold_mass: object | None


class PairSums(NamedTuple):
    """Per-pair sums from which every metric of the studies follows (host float64 arrays)."""

    dot: np.ndarray  # Σ out·ref
    out_sq: np.ndarray  # Σ out²
    ref_sq: np.ndarray  # Σ ref²
    diff_sq: np.ndarray  # Σ (out − ref)²
    max_abs: np.ndarray  # max |out − ref|

    def take(self, index) -> "PairSums":
        return PairSums(*(a[index] for a in self))

    @classmethod
    def concat(cls, parts) -> "PairSums":
        return cls(*(np.concatenate(a) for a in zip(*parts)))


def host(a):
    """A NumPy copy of an xp array (NumPy arrays pass through)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def reference(xp, q, k, v, q_offset: int, rows, heads, scale: float, *, hot=None,
              block_elements: int = 1 << 20) -> Reference:
    """Float64 causal attention of the pairs (rows[i], heads[i]) of one KV head.

    q [n, G, d]: the query heads of that KV head (``heads`` index them); k, v [S, d] or [S, 1, d];
    all FP16 arrays of module ``xp``. Query row r sees keys 0 .. min(q_offset + r, S − 1).
    ``hot``: the warps' hot-tile words [warps, W] (uint32, §10); with it the output is also split
    into the parts of its hot and cold tiles. ``block_elements`` bounds a block of scores (pairs ×
    keys); a chunk of pairs is block_elements / KEY_BLOCK of them.
    """
    rows, heads = np.asarray(rows, np.int64), np.asarray(heads, np.int64)
    S, d = k.shape[0], k.shape[-1]
    k, v = k.reshape(S, d), v.reshape(S, d)
    lim = np.minimum(q_offset + rows, S - 1)
    # Pairs by causal limit, so that a chunk's keys end near its own limits, not the dump's last key.
    order = np.argsort(lim, kind="stable")
    warp = (rows * q.shape[1] + heads) // ROWS
    chunk = max(1, block_elements // KEY_BLOCK)
    out = xp.empty((rows.size, d), xp.float64)
    split = [xp.empty(rows.size, xp.float64) for _ in range(3)] if hot is not None else [None] * 3
    for c0 in range(0, rows.size, chunk):
        sel = order[c0:c0 + chunk]
        idx = xp.asarray(sel)
        qq = q[xp.asarray(rows[sel]), xp.asarray(heads[sel])].astype(xp.float64)
        words = None if hot is None else hot[xp.asarray(warp[sel])]
        parts = _stream(xp, qq, k, v, lim[sel], float(scale), words)
        out[idx] = parts[0]
        for dst, src in zip(split, parts[1:]):
            if dst is not None:
                dst[idx] = src
    return Reference(out, *split)


def _stream(xp, qq, k, v, lim: np.ndarray, scale: float, words):
    """The online softmax of one chunk of pairs over blocks of keys; returns (out, |hot part|,
    |cold part|, cold mass) with the last three None when ``words`` is None."""
    C, d = qq.shape
    lim_x = xp.asarray(lim)
    m = xp.full(C, -np.inf)
    total = xp.zeros(C)
    acc = xp.zeros((C, d))  # the hot part when split, else the whole output
    if words is not None:
        acc_cold, total_cold = xp.zeros((C, d)), xp.zeros(C)
    low, top = int(lim.min()), int(lim.max()) + 1
    # Block 0 holds key 0, which every row sees: m is finite after it, so no rescale meets −inf − −inf.
    for k0 in range(0, top, KEY_BLOCK):
        k1 = min(k0 + KEY_BLOCK, top)
        vv = v[k0:k1].astype(xp.float64)
        s = qq @ k[k0:k1].astype(xp.float64).T  # ok: float64 oracle
        s *= scale
        keys = xp.arange(k0, k1)
        if k1 - 1 > low:
            s = xp.where(keys[None, :] > lim_x[:, None], -np.inf, s)
        m_new = xp.maximum(m, s.max(axis=1))
        alpha = xp.exp(m - m_new)
        s -= m_new[:, None]
        p = xp.exp(s, out=s)
        total = total * alpha + p.sum(axis=1)
        acc *= alpha[:, None]
        if words is not None:
            t = keys // TILE
            cold = ((words[:, t // 32] >> (t % 32).astype(xp.uint32)) & 1) == 0
            pc = xp.where(cold, p, 0.0)
            acc_cold *= alpha[:, None]
            acc_cold += pc @ vv  # ok: float64 oracle
            total_cold = total_cold * alpha + pc.sum(axis=1)
            p -= pc
        acc += p @ vv  # ok: float64 oracle
        m = m_new
    if words is None:
        return acc / total[:, None], None, None, None
    hot_part, cold_part = acc / total[:, None], acc_cold / total[:, None]
    return (hot_part + cold_part, xp.sqrt((hot_part * hot_part).sum(axis=1)),
            xp.sqrt((cold_part * cold_part).sum(axis=1)), total_cold / total)


def pair_sums(xp, out, ref) -> PairSums:
    """The per-pair sums of FP16 outputs ``out`` [P, d] (NumPy) against float64 ``ref`` (xp), reduced
    where ``ref`` lives; only [P] arrays come back."""
    x = xp.asarray(np.ascontiguousarray(out)).astype(xp.float64)
    diff = x - ref
    sums = ((x * ref).sum(axis=1), (x * x).sum(axis=1), (ref * ref).sum(axis=1), (diff * diff).sum(axis=1),
            xp.abs(diff).max(axis=1))
    return PairSums(*(host(a) for a in sums))


def cos_rel(s: PairSums) -> tuple[np.ndarray, np.ndarray]:
    """Cosine and relative L2 of each pair, as apa_emu.metrics.pair_metrics defines them (both norms
    zero: cosine 1; one zero: 0; a zero reference: relative L2 0 if the output is zero too, else inf)."""
    nx, ny, nd = np.sqrt(s.out_sq), np.sqrt(s.ref_sq), np.sqrt(s.diff_sq)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(nx * ny > 0, s.dot / (nx * ny), np.where((nx == 0) & (ny == 0), 1.0, 0.0))
        rel = np.where(ny > 0, nd / ny, np.where(nd == 0, 0.0, np.inf))
    return cos, rel
