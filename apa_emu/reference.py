"""Float64 causal attention on the same FP16 inputs: the accuracy oracle (numerics.md §11)."""

from __future__ import annotations

import numpy as np

from .config import Config


def reference_rows(q, k, v, q_offset: int, rows, heads, scale: float, chunk: int = 256,
                   window: int | None = None) -> np.ndarray:
    """Float64 attention output for the (row, head) pairs ``rows[i], heads[i]``: [len(rows), d],
    with a sliding window of ``window`` keys when given (numerics.md §6.1).

    Not bit-exact by design (BLAS is fine here); streamed over pairs so a 122880-key dump never
    materialises [rows x keys] for more than ``chunk`` pairs at a time.
    """
    rows, heads = np.asarray(rows), np.asarray(heads)
    H, Hkv = q.shape[1], k.shape[1]
    G = H // Hkv
    S = k.shape[0]
    out = np.empty((len(rows), q.shape[2]), np.float64)
    for start in range(0, len(rows), chunk):
        r, h = rows[start:start + chunk], heads[start:start + chunk]
        for hk in np.unique(h // G):
            sel = np.nonzero(h // G == hk)[0]
            qq = q[r[sel], h[sel]].astype(np.float64)
            kk = k[:, hk].astype(np.float64)
            vv = v[:, hk].astype(np.float64)
            s = (qq @ kk.T) * float(scale)  # ok: float64 oracle
            lim = np.minimum(q_offset + r[sel], S - 1)
            lo = np.zeros_like(lim) if window is None else np.maximum(q_offset + r[sel] - window + 1, 0)
            keys = np.arange(S)[None, :]
            s[(keys > lim[:, None]) | (keys < lo[:, None])] = -np.inf
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            out[start + sel] = (p @ vv) / p.sum(axis=1, keepdims=True)  # ok: float64 oracle
    return out


def reference(q, k, v, q_offset: int = 0, config: Config | None = None, window: int | None = None) -> np.ndarray:
    """Float64 attention for every (row, head) of an unbatched problem: [n, H, d]."""
    cfg = config or Config()
    n, H, d = q.shape
    rows = np.repeat(np.arange(n), H)
    heads = np.tile(np.arange(H), n)
    return reference_rows(q, k, v, q_offset, rows, heads, cfg.softmax_scale(d), window=window).reshape(n, H, d)
