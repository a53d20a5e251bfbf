"""What the studies' Matplotlib figures share: the pyplot of a headless run, and PNG files written
like dumps. Each figure is drawn by its command (``commands``)."""

from __future__ import annotations

import io

from .files import write_atomically


def save(fig, out) -> str:
    """PNG bytes rendered in memory, then written like a dump: savefig itself swallows some write
    errors (ENOSPC on /dev/full) and would write into devices. The figure is closed either way."""
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        write_atomically(out, lambda f: f.write(buf.getbuffer()))
    finally:
        pyplot().close(fig)
    return str(out)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
