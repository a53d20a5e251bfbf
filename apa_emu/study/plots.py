"""Matplotlib figures of the studies, written as PNG files."""

from __future__ import annotations

import io

import numpy as np

from .files import write_atomically
from .scan import Breakdown, PairReport, SweepRow


def _save(fig, out) -> str:
    """PNG bytes rendered in memory, then written like a dump: savefig itself swallows some write
    errors (ENOSPC on /dev/full) and would write into devices. The figure is closed either way."""
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        write_atomically(out, lambda f: f.write(buf.getbuffer()))
    finally:
        _pyplot().close(fig)
    return str(out)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pair(report: PairReport, out, title) -> str:
    """Per-tile float64 mass and |Σ p·v| of one pair, hot tiles in red."""
    plt = _pyplot()
    t = np.arange(report.mass.size)
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    colors = np.where(report.hot, "tab:red", "tab:blue")
    a.bar(t, report.mass, color=colors)
    a.set_yscale("log")
    a.set_ylabel("tile mass (float64)")
    a.set_title(f"{title}: red = hot (pass 2), blue = cold (FP4)")
    b.bar(t, report.contrib_norm, color=colors)
    b.set_yscale("log")
    b.set_ylabel("|Σ p·v| of the tile")
    b.set_xlabel("tile")
    fig.tight_layout()
    return _save(fig, out)


def plot_sweep(series: dict[str, list[SweepRow]], out, title) -> str:
    """The accuracy-cost frontier: 1 − min cosine against hot share, one line per dump (and the
    pooled pairs), each point labelled with its ε."""
    plt = _pyplot()
    fig, a = plt.subplots(figsize=(7, 4.5))
    for name, rows in series.items():
        share = [r.hot_share for r in rows]
        gap = [max(1.0 - r.min_cos, 1e-17) if np.isfinite(r.min_cos) else np.nan for r in rows]
        a.plot(share, gap, "o-", label=name)
        for r, x, y in zip(rows, share, gap):
            a.annotate(f"ε={r.eps:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    a.set_yscale("log")
    a.set_xlabel("hot share (tiles recomputed in pass 2)")
    a.set_ylabel("1 − min cosine")
    a.set_title(f"apa sweep {title}: min cosine against cost")
    a.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out)


def plot_heatmap(panels: dict[str, Breakdown], out, title) -> str:
    """Min cosine of each (head, query-position bucket), one panel per dump, as 1 − cos on a log scale
    (cosines near 1 differ in their sixth digit), each cell labelled."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.28 * sum(len(b.heads) for b in panels.values())
                                                       + 1.2 * len(panels)), squeeze=False)
    for a, (name, b) in zip(axes[:, 0], panels.items()):
        gap = np.clip(1.0 - b.min_cos, 1e-16, None)
        im = a.imshow(gap, aspect="auto", cmap="magma", norm=LogNorm(), interpolation="nearest")
        for (i, j), g in np.ndenumerate(gap):
            if np.isfinite(g):
                a.text(j, i, f"{g:.1e}", ha="center", va="center", fontsize=6,
                       color="black" if im.norm(g) > 0.6 else "white")
        a.set_yticks(range(len(b.heads)), [str(h) for h, _ in b.heads], fontsize=7)
        a.set_xticks(range(len(b.buckets)), [lab for lab, _ in b.buckets], fontsize=7, rotation=30)
        a.set_ylabel("query head")
        a.set_title(f"{name}: 1 − min cosine by head and query position", fontsize=9)
        fig.colorbar(im, ax=a, label="1 − min cosine")
    axes[-1, 0].set_xlabel("query positions")
    fig.suptitle(f"apa attribute {title}", fontsize=10)
    fig.tight_layout()
    return _save(fig, out)
