"""Peer recipes: other attention kernels emulated bit for bit, so that ``apa check`` can hold a peer's
real kernel on the GPU against its emulation (numerics.md §14 onward). A recipe is independent of APA's
passes; it reuses only the shared primitives (``fpmath``, ``mma``, ``sfu``).

An engine (apa_emu.engines) says which reference it implements in its ``recipe``: ``APA`` (numerics.md,
the emulator) or a name of ``RECIPES``. A peer engine implements ``run_peer(q, k, v) -> PeerRun``: one
batch element, causal with equal lengths, q [n, h_q, d] and k, v [n, h_k, d] (FP16), and returns the
FP16 output with the named ``inputs`` the recipe takes from outside the peer's kernels (SageAttention:
``km``, the K mean its torch wrapper computed). ``check`` runs it on copies of the inputs and compares
its output with the recipe's, bitwise (or in tolerance, the fallback while a recipe is not bit-exact).

A recipe module has ``check_inputs(q, k, v)`` (one ValueError line for what it does not cover),
``run(q, k, v, *, tables, **inputs)`` (a result with ``out``) and ``tile(row, head, n, h_q, h_k)`` (the
words naming the kernel's tile that computed an output row).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..compare import ulp_distance
from ..engines import EngineError, check_untouched, guarded, input_copy

APA = "apa"  # the emulator's numerics.md: every engine's recipe unless it names a peer


@dataclass(frozen=True)
class Recipe:
    """A peer kernel's emulation: its module, the inputs it takes from the engine, its head dims."""

    name: str
    module: str
    inputs: tuple[str, ...]
    head_dims: tuple[int, ...]
    title: str

    def load(self):
        return importlib.import_module(self.module)


RECIPES = {
    "sageattention": Recipe("sageattention", "apa_emu.peers.sageattn", ("km",), (64, 128),
                            "SageAttention 1.0.6 causal (numerics.md §14)"),
    # Emulated only: no engine runs SageAttention3 (its kernel needs sm_120), so ``check`` has nothing
    # to hold against it; ``apa compare`` runs it on the CPU.
    "sageattention3": Recipe("sageattention3", "apa_emu.peers.sage3", (), (64, 128),
                             "SageAttention3 NVFP4 causal, emulated (numerics.md §15)"),
    # Emulated only, as SageAttention3: its sm_90 kernel is not installed on the machines here.
    "sageattention2": Recipe("sageattention2", "apa_emu.peers.sage2", (), (64, 128),
                             "SageAttention2 sm_90 INT8 QK, FP8 PV causal, emulated (numerics.md §16)"),
}


def recipe(name: str) -> Recipe:
    """The recipe called ``name``; a ValueError of one line naming the known ones."""
    if name not in RECIPES:
        raise ValueError(f"no peer recipe {name!r} (recipes: {', '.join(RECIPES)}; {APA!r} is the emulator)")
    return RECIPES[name]


def parse_toggles(name: str, toggles: type, text: str) -> dict:
    """``KEY=VAL,...`` of the fields of a recipe's ``Toggles`` dataclass as keyword arguments of its
    ``run``: booleans as 0/1/true/false, words as given, numbers as floats; a ValueError of one line
    starting with the recipe's ``name`` for an unknown key or a bad value."""
    fields = {f.name: f.type for f in dataclasses.fields(toggles)}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, val = item.partition("=")
        if key not in fields:
            raise ValueError(f"{name}: no toggle {key!r} (toggles: {', '.join(fields)})")
        out[key] = _toggle_value(name, key, fields[key], val)
    return out


def _toggle_value(name: str, key: str, kind: str, val: str):
    if kind == "bool":
        if val.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"{name}: {key} takes 0/1/true/false, got {val!r}")
        return val.lower() in ("1", "true")
    if kind == "str":
        return val
    try:
        return float(val)
    except ValueError:
        raise ValueError(f"{name}: {key} takes a number, got {val!r}") from None


class PeerRun(NamedTuple):
    """What a peer engine returns: the FP16 output [n, h_q, d] (NumPy, or a device array with
    ``.get()``/``.cpu()``) and the recipe's named inputs as the engine computed them."""

    out: Any
    inputs: dict


@dataclass
class PeerOutcome:
    """A peer engine against its recipe on one problem. ``first``: the first differing element
    (row, head, channel) in the caller's rows; ``values``: (recipe, engine) there; ``tile``: the
    kernel's tile that computed it; ``spread``: how far the difference reaches; ``ulps``: the largest
    FP16 ULP distance; in tolerance mode ``rel_l2`` is the largest relative L2 distance of a pair."""

    engine: str
    recipe: str
    mode: str
    passed: bool
    first: tuple | None = None
    values: tuple | None = None
    tile: str = ""
    spread: str = ""
    ulps: int = 0
    rel_l2: float = 0.0
    bound: float = 0.0

    @property
    def pair(self) -> tuple | None:
        return None if self.first is None else self.first[:2]

    def lines(self) -> list[str]:
        if self.passed:
            how = "bitwise" if self.mode == "bitwise" else f"within relative L2 {self.bound:g}"
            return [f"engine {self.engine} equals the {self.recipe} recipe {how}"]
        row, head, ch = self.first
        want, got = self.values
        return [f"first differing (row, head): ({row}, {head}), channel {ch}: recipe {float(want)!r} "
                f"({_bits(want)}), engine {float(got)!r} ({_bits(got)})",
                f"tile: {self.tile}", self.spread]


def _bits(x) -> str:
    return hex(int(np.asarray(x, np.float16).view(np.uint16)))


def _host(x) -> np.ndarray:
    return np.asarray(x.get() if hasattr(x, "get") else x.cpu() if hasattr(x, "cpu") else x)


def peer_run(engine, q, k, v) -> tuple[np.ndarray, dict]:
    """The engine's output and inputs on copies of q, k, v; an EngineError naming the engine when it
    raises, changes an input or returns something else than a PeerRun of the recipe's inputs."""
    rec = recipe(engine.recipe)
    given = {name: input_copy(x) for name, x in (("q", q), ("k", k), ("v", v))}
    with guarded(f"engine {engine.name} raised"):
        res = engine.run_peer(given["q"], given["k"], given["v"])
    check_untouched(engine.name, dict(q=q, k=k, v=v), given)
    if not isinstance(res, PeerRun) or not isinstance(res.inputs, dict):
        raise EngineError(f"engine {engine.name} returned a {type(res).__name__}, expected a PeerRun(out, inputs)")
    if set(res.inputs) != set(rec.inputs):
        raise EngineError(f"engine {engine.name} returned inputs {sorted(res.inputs)}, expected the "
                          f"{rec.name} recipe's {list(rec.inputs)}")
    out = _host(res.out)
    if out.shape != q.shape or out.dtype != np.float16:
        raise EngineError(f"engine {engine.name} returned an output of shape {out.shape} and dtype {out.dtype}, "
                          f"expected q's {q.shape} float16")
    return out, {name: _host(x) for name, x in res.inputs.items()}


def check(engine, q, k, v, *, first_row: int = 0, mode: str = "bitwise", max_rel_l2: float = 0.1,
          tables=None) -> PeerOutcome:
    """``engine`` (its ``recipe`` a peer) against that recipe on q, k, v, comparing rows ``first_row``
    onward (a dump's real rows after its padding; rows are named from there). ``tables``: the SFU
    tables (default: the measured ones)."""
    rec = recipe(engine.recipe)
    module = rec.load()
    module.check_inputs(q, k, v)
    out, inputs = peer_run(engine, q, k, v)
    want = module.run(q, k, v, tables=tables, **inputs).out
    a, b = want[first_row:], out[first_row:]
    base = PeerOutcome(engine.name, rec.name, mode, True, bound=max_rel_l2)
    differ = _canonical(a) != _canonical(b)
    if not differ.any():
        return base
    base.ulps = int(ulp_distance(a, b).max())
    base.rel_l2 = _worst_rel_l2(a, b)
    if mode == "tolerance" and base.rel_l2 <= max_rel_l2:
        return base
    row, head, ch = (int(i) for i in np.argwhere(differ)[0])
    pairs = np.argwhere(differ.any(axis=-1))
    blocks = sorted({int(r + first_row) // module.BLOCK_M for r, _ in pairs})
    base.passed, base.first, base.values = False, (row, head, ch), (a[row, head, ch], b[row, head, ch])
    nan = bool(np.isnan(b[row, head, ch]) and not np.isnan(a[row, head, ch]))
    base.tile = module.tile(row + first_row, head, q.shape[0], q.shape[1], k.shape[1], nan) + \
        (f" of the problem padded with {first_row} rows in front" if first_row else "")
    base.spread = (f"{int(differ.sum())} elements differ in {len(pairs)} (row, head) pairs, query heads "
                   f"{_span(pairs[:, 1])}, query blocks {_span(blocks)}; largest ULP distance {base.ulps}, "
                   f"largest relative L2 {base.rel_l2:.3g}")
    return base


def _canonical(x: np.ndarray) -> np.ndarray:
    bits = np.asarray(x, np.float16).view(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7E00), bits)


def _worst_rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff, norm = np.linalg.norm(a64 - b64, axis=-1), np.linalg.norm(a64, axis=-1)
        rel = np.where(norm > 0, diff / norm, np.where(diff > 0, np.inf, 0.0))
    rel = np.where(np.isnan(rel), np.inf, rel)
    return float(rel.max()) if rel.size else 0.0


def _span(values) -> str:
    values = sorted({int(v) for v in values})
    if len(values) > 6:
        return f"{values[0]}..{values[-1]} ({len(values)} of them)"
    return ", ".join(map(str, values))
