"""Presentation of study results: rich tables and progress bars for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import numpy as np


@contextmanager
def progress_bar(enabled: bool, label: str):
    """A rich progress bar driven by the emulator's ``progress(done, total)`` callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=None)

        def update(done, total):
            bar.update(task, completed=done, total=total)

        yield update


def table(title, columns, rows):
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c not in ("variant", "metric", "bin") else "left")
    for r in rows:
        t.add_row(*[_fmt(x) for x in r])
    return t


def _fmt(x) -> str:
    if isinstance(x, (float, np.floating)):
        return f"{x:.6g}"
    return str(x)


def emit(as_json: bool, payload: dict, tables) -> None:
    """Print the payload as JSON, or the tables for people."""
    if as_json:
        json.dump(payload, sys.stdout, indent=1, default=_jsonable)
        sys.stdout.write("\n")
        return
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or captured: no terminal width to respect, keep numbers whole
        console = Console(width=200)
    for t in tables:
        console.print(t)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x).__name__)
