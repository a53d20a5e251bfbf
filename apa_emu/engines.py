"""Engines: what runs a resolved call (apa_emu/call.py) and returns the emulator's Result.

The studies and ``apa check`` reach an implementation of numerics.md only through this interface:

- ``name``; what it implements: ``features`` (a subset of FEATURES, the call arguments it honours;
  without "warps" it computes every warp of a call that chooses some), ``head_dims``, and
  ``lacks(config, d)``, why it cannot run a config at head dim d (None: it can);
- ``missing()``: what this machine lacks to run it (None: nothing); it and ``lacks`` are asked of
  the class, before an engine is built;
- ``run(call, config, *, progress=None, **options) -> Result``, with ``options`` the keywords it
  declares in ``options`` (name -> choices), such as the kernel's launch schedules;
- where the studies keep its arrays: ``xp`` and ``put`` (the reference and metrics are computed
  there), ``block_elements``, ``free_memory()``, ``release()``, ``context()``, ``devices``; and,
  when it offers them, ``prep_arrays`` (its prep outputs, to localise a mismatch, apa_emu.compare).

The emulator is the engine "cpu". Other packages register theirs as entry points of the group
``apa_emu.engines`` (``name = "module:Class"``), so that apa_emu never imports them; such a class is
built as ``cls(devices=..., note=...)``. A checkout that is not installed (on the device, a copy run with
PYTHONPATH) names them in ``$APA_ENGINES`` instead, in the same form: ``gpu=apa_gpu.engine:GpuEngine``,
several separated by commas.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from importlib.metadata import EntryPoint, entry_points

import numpy as np

from . import api
from .call import Call, Result
from .config import Config
from .geometry import HEAD_DIMS

GROUP = "apa_emu.engines"
FEATURES = frozenset({"window", "paging", "varlen", "kv_state", "trace", "warps"})


class Engine:
    """An implementation that runs calls. ``note`` says why ``--backend auto`` chose it (or None);
    ``devices`` are the devices it runs on (empty: the current one; the studies run on several as
    workers of a cluster, each on the one it sees)."""

    name = ""
    features: frozenset = frozenset()
    head_dims: tuple[int, ...] = HEAD_DIMS
    options: dict[str, tuple] = {}
    xp = np
    block_elements = 1 << 20  # float64 scores the studies compute at once where the arrays live
    prep_arrays = None
    wait = ""  # what a first run waits for (a compiler), said beside the studies' progress bar

    def __init__(self, *, devices=(), note: str | None = None):
        self.devices = tuple(devices)
        self.note = note

    @classmethod
    def missing(cls) -> str | None:
        """What this machine lacks to run the engine, in a few words (None: nothing)."""
        return None

    @classmethod
    def lacks(cls, config: Config, d: int) -> str | None:
        """Why the engine cannot run ``config`` at head dim ``d`` (None: it can)."""
        return None

    def run(self, call: Call, config: Config, *, progress=None, **options) -> Result:
        """The Result of a resolved call, bitwise the emulator's where the engine is exact, with NumPy
        arrays. ``progress(done, total)`` is called over ``steps`` steps."""
        raise NotImplementedError

    def steps(self, warps: int) -> int:
        """Progress steps of one call over ``warps`` warps."""
        return 1

    def put(self, x):
        """A host array where the engine computes (``xp``)."""
        return x

    def free_memory(self) -> list[tuple[int, int]]:
        """(device, free bytes) of each device the engine runs on; empty for host memory, which the
        emulator checks itself."""
        return []

    def release(self) -> None:
        """Give back the memory that earlier calls held."""

    def context(self):
        """The context the engine's calls run in (its device)."""
        return nullcontext()


class CpuEngine(Engine):
    """The emulator (apa_emu.api.run), ``workers`` processes over the warps of each (batch, KV head)."""

    name = "cpu"
    features = FEATURES
    wait = "the first run compiles the emulator with Numba, about 30 s"

    def __init__(self, workers: int = 1, note: str | None = None):
        super().__init__(note=note)
        self.workers = workers

    def run(self, call, config, *, progress=None):
        return api.run(call, config, workers=self.workers, progress=progress)

    def steps(self, warps):
        return warps


def _named() -> dict[str, EntryPoint]:
    """The engines of other packages: their entry points, then those of ``$APA_ENGINES``."""
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    for item in filter(None, (s.strip() for s in os.environ.get("APA_ENGINES", "").split(","))):
        name, sep, value = item.partition("=")
        if not sep or ":" not in value:
            raise ValueError(f"APA_ENGINES: {item!r} is not name=module:Class")
        found[name.strip()] = EntryPoint(name.strip(), value.strip(), GROUP)
    return found


def registered() -> tuple[str, ...]:
    """The names of the engines registered by other packages, without importing them."""
    return tuple(sorted(set(_named()) - {"auto", "cpu"}))


def load(name: str) -> type[Engine]:
    """The engine class called ``name``: "cpu" or a registered one (KeyError otherwise)."""
    if name == "cpu":
        return CpuEngine
    ep = _named().get(name)
    if ep is None:
        raise KeyError(f"no engine {name!r} (engines: {', '.join(('cpu',) + registered())})")
    return ep.load()
