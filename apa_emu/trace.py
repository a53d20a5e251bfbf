"""Trace layout shared by the emulator and the kernel's trace mode (numerics.md §10).

The field lists below are part of the spec: the CUDA kernel writes records with exactly these bytes,
so the cross-checker can compare the two field by field.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np

from .geometry import ROWS

VISIT_DTYPE = np.dtype(
    [
        ("b", "<i4"),
        ("hk", "<i4"),
        ("warp", "<i4"),
        ("visit", "<i4"),
        ("tile", "<i4"),
        ("hot", "u1"),
        ("_pad", "u1", (3,)),
        ("c", "<f4", (ROWS,)),
        ("m", "<f4", (ROWS,)),
        ("tl", "<f4", (ROWS,)),
        ("la", "<f4", (ROWS,)),
        ("lc", "<f4", (ROWS,)),
        ("tv", "<f4", (ROWS,)),
        ("lv", "<f4", (ROWS,)),
        ("t2", "<f4", (ROWS,)),
        ("ws", "<f4", (ROWS,)),
    ]
)
# tv and lv: the output hot test's value-weighted sums (§7.6–7.7); +0 under the mass and budget tests.
# t2 and ws: §9.8's cold Σ P̂², so that a study can say which tiles the estimate's cold variance came from.
VISIT_FIELDS = ("tile", "hot", "c", "m", "tl", "la", "lc", "tv", "lv", "t2", "ws")
# The emulator's per-warp trace buffers (apa_emu.pass1 fills them), one array per field, in this order.
VisitTrace = namedtuple("VisitTrace", VISIT_FIELDS)


def visit_trace(nvisits: int) -> VisitTrace:
    return VisitTrace(*(np.zeros((nvisits, *VISIT_DTYPE[f].shape), VISIT_DTYPE[f].base) for f in VISIT_FIELDS))


def row_dtype(d: int) -> np.dtype:
    """Per packed row: the exported pass-1 partial, the pass-2 state and the output."""
    return np.dtype(
        [
            ("b", "<i4"),
            ("hk", "<i4"),
            ("row", "<i4"),
            ("m1", "<f4"),
            ("l1", "<f4"),
            ("m2", "<f4"),
            ("l2", "<f4"),
            ("ad1", "<f4"),
            ("err_bound", "<f4"),
            ("ws1", "<f4"),
            ("p2", "<f4"),
            ("err_est", "<f4"),
            ("part", "<f4", (d,)),
            ("o2", "<f4", (d,)),
            ("out", "<f2", (d,)),
        ]
    )


ROW_FIELDS = ("m1", "l1", "m2", "l2", "ad1", "err_bound", "ws1", "p2", "err_est", "part", "o2", "out")


# The stages of a row in data-flow order with the trace fields each one writes (§7.10, §8.6, §9). A
# frame m = −inf is no overflow: it means the stage saw no tile.
STAGES = (
    ("pass 1 (FP4 estimate of the cold tiles)", ("m1", "l1", "part", "ws1")),
    ("pass 2 (FP16 scores q·k, row max and sum)", ("m2", "l2", "p2")),
    ("pass 2 (FP16 output accumulation P·V)", ("o2",)),
    ("the merge (FP16 output)", ("out",)),
)


def overflow_stage(rec) -> str | None:
    """Which stage of a traced row (a ``trace.row_dtype`` record) first went non-finite, and how. A
    NaN output from finite pass states is the merge's 0 ⊘ 0 when neither pass holds mass (§9.1-9.3;
    pass 1's direct store of §9.5 with lc = 0 is the other way there), not an overflow."""
    for stage, fields in STAGES:
        for name in fields:
            x = np.asarray(rec[name], dtype=np.float64)
            bad = np.isnan(x) | (x == np.inf) if name.startswith("m") else ~np.isfinite(x)
            if not bad.any():
                continue
            if name == "out" and np.isnan(x[bad]).all() and not (rec["l1"] > 0 or rec["l2"] > 0):
                return f"{stage}: 0/0, neither pass holds mass for the row (l1 = l2 = 0): out holds NaN"
            return f"{stage} overflowed: {name} holds {'NaN' if np.isnan(x[bad]).any() else 'Inf'}"
    return None


@dataclass(frozen=True)
class TraceRequest:
    """Which warps to trace: ``None`` in a field means every value of it.

    A whole 122880-key dump traced in full would be gigabytes, so the CLI traces only the warps it
    shows; tests trace everything on small inputs.
    """

    warps: frozenset | None = None  # of (b, hk, warp) triples

    def wants(self, b: int, hk: int, warp: int) -> bool:
        return self.warps is None or (b, hk, warp) in self.warps

    @classmethod
    def of(cls, spec) -> "TraceRequest | None":
        """Normalise the ``trace=`` argument: None/False, True/"all", or an iterable of triples."""
        if spec is None or spec is False:
            return None
        if spec is True or (isinstance(spec, str) and spec == "all"):  # an array spec has no single truth value
            return cls(None)
        if isinstance(spec, TraceRequest):
            return spec
        return cls(frozenset(integer_triples("trace", spec)))


def _integer(name: str, x) -> int:
    """An integer entry as a Python int. Any other number (1.7, np.float64(1)) is refused, never
    truncated: int(1.7) would silently trace warp 1. As q_offset, a warp number is an integer type."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return int(x)
    raise ValueError(f"{name}: {x!r} is not an integer (expected (b, hk, warp) integer triples)")


def integer_triples(name: str, spec) -> list[tuple[int, int, int]]:
    """``trace=``/``warps=`` as a list of (b, hk, warp) Python ints; anything else is a ValueError
    naming ``name``: a non-iterable (trace=5), an entry not of three, or a non-integer number."""
    # trace= also takes True or 'all'; warps= takes None for every warp
    whole = "True, 'all' or " if name == "trace" else "None (every warp) or "
    if isinstance(spec, (str, bytes)):
        raise ValueError(f"{name}: expected {whole}an iterable of (b, hk, warp) triples, got {spec!r}")
    try:
        entries = list(spec)
    except TypeError:
        raise ValueError(f"{name}: expected {whole}an iterable of (b, hk, warp) triples, got {spec!r}") from None
    triples = []
    for t in entries:
        try:
            t = tuple(t)
        except TypeError:
            raise ValueError(f"{name}: {t!r} is not a (b, hk, warp) triple") from None
        if len(t) != 3:
            raise ValueError(f"{name}: {t!r} is not a (b, hk, warp) triple")
        triples.append(tuple(_integer(name, x) for x in t))
    return triples


_CANON = {np.dtype(np.float16): np.uint16(0x7FFF), np.dtype(np.float32): np.uint32(0x7FFFFFFF)}


def canonical_nan(a: np.ndarray) -> np.ndarray:
    """A copy with every NaN replaced by the canonical NaN of its width (numerics.md §1.7: NaN
    payloads are not part of the contract). Works field by field on structured arrays."""
    a = np.array(a, copy=True)
    if a.dtype.names:
        for name in a.dtype.names:
            a[name] = canonical_nan(a[name])
    elif a.dtype.base in _CANON:
        a[np.isnan(a)] = _CANON[a.dtype.base].view(a.dtype.base)
    return a


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x


def first_difference(left: np.ndarray, right: np.ndarray, fields, keys=("b", "hk", "warp", "visit")):
    """The first record, field and element where two record arrays differ bitwise, or None.

    Records are compared in order, fields in the order given. Floats are compared as bit patterns
    (so -0 and +0 differ) after NaN canonicalisation. The result names the record's ``keys`` and the
    two values as ``left`` and ``right``.
    """
    if left.shape != right.shape:
        return {"field": "shape", "left": left.shape, "right": right.shape}
    n = left.shape[0]
    if n == 0:
        return None
    left, right = canonical_nan(left), canonical_nan(right)
    first, where = n, None
    for f in fields:
        ne = (_bits(left[f]) != _bits(right[f])).reshape(n, -1)
        bad = np.flatnonzero(ne.any(axis=1))
        if bad.size and bad[0] < first:
            first, where = int(bad[0]), (f, int(np.flatnonzero(ne[bad[0]])[0]))
    if where is None:
        return None
    f, j = where
    x, y = np.atleast_1d(left[f][first]), np.atleast_1d(right[f][first])
    return {"record": first, **{k: int(left[k][first]) for k in keys}, "field": f,
            "element": j if x.size > 1 else None, "left": x[j], "right": y[j]}
