"""Presentation of study results: rich tables and progress bars for people, JSON for scripts."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import sys
from contextlib import contextmanager

import numpy as np

from ..config import Config
from ..engines import CpuEngine

NUMBA_WAIT = CpuEngine.wait


@contextmanager
def progress_bar(enabled: bool, label: str, wait: str = NUMBA_WAIT):
    """A rich progress bar driven by the emulator's ``progress(done, total)`` callback; until the first
    step is done it also says what the wait is for. Only on a terminal: elsewhere rich would draw
    nothing but a stray empty line."""
    from rich.console import Console

    console = Console(stderr=True)
    if not (enabled and console.is_terminal):
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), transient=True, console=console) as bar:
        task = bar.add_task(f"{label} ({wait})", total=None)

        def update(done, total):
            bar.update(task, completed=done, total=total, description=label)

        yield update


def cfg_name(cfg: Config) -> str:
    """The config as the toggles that differ from the defaults."""
    changed = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(Config)
               if getattr(cfg, f.name) != getattr(Config(), f.name)]
    return " ".join(changed) or "default config"


def table(title, columns, rows):
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c not in ("variant", "metric", "bin") else "left")
    for r in rows:
        t.add_row(*[_fmt(x) for x in r])
    return t


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, (float, np.floating)):
        return f"{x:.6g}"
    return str(x)


def json_safe(x, path: str = "", flags: dict | None = None):
    """x with NumPy values made plain and every NaN or ±Inf made None; ``flags`` collects what each
    replaced value was, by its path in x (e.g. ``worst[0].cos``). Strict JSON has no NaN or
    Infinity, and JavaScript's JSON.parse rejects Python's spelling of them."""
    if isinstance(x, dict):
        return {k: json_safe(v, f"{path}.{k}" if path else str(k), flags) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [json_safe(v, f"{path}[{i}]", flags) for i, v in enumerate(x)]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        if flags is not None:
            flags[path] = "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
        return None
    return x


class OutputError(Exception):
    """Standard output cannot take the results: a closed pipe, a full device."""


@contextmanager
def _writing():
    try:
        yield
    except OSError as e:
        raise OutputError(e.strerror or str(e)) from e


def emit(as_json: bool, payload: dict, tables) -> None:
    """Print the payload as JSON, or the tables for people."""
    with _writing():
        if as_json:
            flags = {}
            clean = json_safe(payload, flags=flags)
            if flags:
                clean["non_finite"] = flags
            json.dump(clean, sys.stdout, indent=1, allow_nan=False)
            sys.stdout.write("\n")
            return
        from rich.console import Console

        class _Console(Console):
            def on_broken_pipe(self):  # rich would exit quietly with status 1: report it like any output error
                raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

        console = _Console()
        if not console.is_terminal:  # piped or captured: no terminal width to respect, keep numbers whole
            console = _Console(width=200)
        for t in tables:
            console.print(t)


def say(text: str) -> None:
    with _writing():
        print(text)


def flush() -> None:
    """Push out what standard output still buffers, so that a failure is reported, not ignored at exit."""
    with _writing():
        sys.stdout.flush()

