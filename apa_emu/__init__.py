"""apa_emu: the bit-exact reference emulator of APA attention for sm_90 (see docs/numerics.md)."""

import hashlib
import os
from pathlib import Path

import numba


def _numba_cache_dir() -> str:
    """Numba's cache directory, keyed on a hash of this package's sources.

    Numba's own cache is keyed on each function's file alone: a cached function is not recompiled
    when a function it calls in another file changes, so with a warm cache an edit to fpmath.py
    would go untested. A directory per source state makes every edit a cold cache."""
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    base = os.environ.get("NUMBA_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "apa_emu"
    return str(Path(base) / f"numba-{h.hexdigest()[:16]}")


numba.config.CACHE_DIR = _numba_cache_dir()  # before the modules below decorate their cached functions

from .api import attention  # noqa: E402
from .call import validate  # noqa: E402
from .config import Config  # noqa: E402
from .kvstate import KVState  # noqa: E402
from .metrics import pair_metrics, summarize  # noqa: E402
from .reference import reference, reference_rows  # noqa: E402
from .result import NonFiniteOutput, Overflow, Result  # noqa: E402

__all__ = ["Config", "KVState", "NonFiniteOutput", "Overflow", "Result", "attention", "validate", "reference", "reference_rows", "pair_metrics", "summarize"]
