"""Accuracy metrics against the float64 reference (numerics.md §11)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

HIST_EDGES = (-1.0, 0.0, 0.5, 0.9, 0.99, 0.999, 0.9999, 1.0)


def pair_metrics(out: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-pair cosine and relative L2 over the last axis (float64)."""
    x = out.astype(np.float64)
    y = ref.astype(np.float64)
    dot = np.einsum("...i,...i->...", x, y)  # ok: float64 metric
    nx = np.sqrt(np.einsum("...i,...i->...", x, x))  # ok: float64 metric
    ny = np.sqrt(np.einsum("...i,...i->...", y, y))  # ok: float64 metric
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(nx * ny > 0, dot / (nx * ny), np.where((nx == 0) & (ny == 0), 1.0, 0.0))
        diff = np.sqrt(np.einsum("...i,...i->...", x - y, x - y))  # ok: float64 metric
        rel = np.where(ny > 0, diff / ny, np.where(diff == 0, 0.0, np.inf))
    return cos, rel


@dataclass
class Summary:
    pairs: int
    pooled_cos: float
    mean_cos: float
    min_cos: float
    below_0_9: int
    below_0_99: int
    below_0: int
    rel_l2_mean: float
    rel_l2_p99: float
    rel_l2_max: float
    hot_share: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(out: np.ndarray, ref: np.ndarray, hot_share: float | None = None) -> Summary:
    """Pooled / mean / min cosine, counts below 0.9 / 0.99 / 0 and relative L2 over all pairs."""
    x = out.reshape(-1, out.shape[-1]).astype(np.float64)
    y = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    cos, rel = pair_metrics(x, y)
    pooled = float(np.einsum("ij,ij->", x, y) / np.sqrt(np.einsum("ij,ij->", x, x) * np.einsum("ij,ij->", y, y)))  # ok: float64 metric
    return Summary(
        pairs=int(cos.size),
        pooled_cos=pooled,
        mean_cos=float(cos.mean()),
        min_cos=float(cos.min()),
        below_0_9=int((cos < 0.9).sum()),
        below_0_99=int((cos < 0.99).sum()),
        below_0=int((cos < 0).sum()),
        rel_l2_mean=float(rel.mean()),
        rel_l2_p99=float(np.quantile(rel, 0.99)),
        rel_l2_max=float(rel.max()),
        hot_share=hot_share,
    )


def cosine_histogram(cos: np.ndarray) -> list[tuple[str, int]]:
    """Counts of per-pair cosines in the bins [-1,0), [0,.5), ..., [.9999, 1]."""
    counts, _ = np.histogram(cos, bins=HIST_EDGES)
    labels = [f"[{a:g}, {b:g})" for a, b in zip(HIST_EDGES[:-1], HIST_EDGES[1:])]
    return list(zip(labels, counts.tolist()))
