"""Matplotlib figures of the studies, written as PNG files."""

from __future__ import annotations

import io

import numpy as np

from .files import write_atomically
from .scan import PairReport, SweepRow


def _save(fig, out) -> str:
    """PNG bytes rendered in memory, then written like a dump: savefig itself swallows some write
    errors (ENOSPC on /dev/full) and would write into devices."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_atomically(out, lambda f: f.write(buf.getbuffer()))
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
    try:
        return _save(fig, out)
    finally:
        plt.close(fig)


def plot_sweep(rows: list[SweepRow], out, name) -> str:
    """Hot share and min cosine per ε."""
    plt = _pyplot()
    eps = [max(r.eps, 1e-9) for r in rows]
    fig, a = plt.subplots(figsize=(7, 4))
    a.plot(eps, [r.hot_share for r in rows], "o-", label="hot share")
    a.set_xscale("log")
    a.set_xlabel("ε")
    a.set_ylabel("hot share")
    b = a.twinx()
    b.plot(eps, [r.min_cos for r in rows], "s--", color="tab:red", label="min cosine")
    b.set_ylabel("min cosine")
    a.set_title(f"apa sweep {name}")
    fig.legend(loc="lower left")
    fig.tight_layout()
    try:
        return _save(fig, out)
    finally:
        plt.close(fig)
