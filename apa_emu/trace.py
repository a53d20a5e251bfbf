"""Trace layout shared by the emulator and the kernel's trace mode (numerics.md §10).

The field lists below are part of the spec: the CUDA kernel writes records with exactly these bytes,
so the cross-checker can compare the two field by field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROWS_PER_WARP = 16

VISIT_DTYPE = np.dtype(
    [
        ("b", "<i4"),
        ("hk", "<i4"),
        ("warp", "<i4"),
        ("visit", "<i4"),
        ("tile", "<i4"),
        ("hot", "u1"),
        ("_pad", "u1", (3,)),
        ("c", "<f4", (ROWS_PER_WARP,)),
        ("m", "<f4", (ROWS_PER_WARP,)),
        ("tl", "<f4", (ROWS_PER_WARP,)),
        ("la", "<f4", (ROWS_PER_WARP,)),
        ("lc", "<f4", (ROWS_PER_WARP,)),
    ]
)
VISIT_FIELDS = ("tile", "hot", "c", "m", "tl", "la", "lc")


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
            ("part", "<f4", (d,)),
            ("o2", "<f4", (d,)),
            ("out", "<f2", (d,)),
        ]
    )


ROW_FIELDS = ("m1", "l1", "m2", "l2", "part", "o2", "out")


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
        if spec is True or spec == "all":
            return cls(None)
        if isinstance(spec, TraceRequest):
            return spec
        triples = frozenset(tuple(int(x) for x in t) for t in spec)
        if any(len(t) != 3 for t in triples):
            raise ValueError("trace: expected 'all' or an iterable of (b, hk, warp) triples")
        return cls(triples)


def first_difference(a: np.ndarray, b: np.ndarray, fields, keys=("b", "hk", "warp", "visit")):
    """The first record and field where two traces differ bitwise, or None.

    Floats are compared as bit patterns, so -0/+0 and NaN payloads count as differences.
    """
    if a.shape != b.shape:
        return {"field": "shape", "a": a.shape, "b": b.shape}
    for i in range(a.shape[0]):
        for f in fields:
            x, y = np.asarray(a[f][i]), np.asarray(b[f][i])
            xb = x.view(np.uint8) if x.dtype.kind == "f" else x
            yb = y.view(np.uint8) if y.dtype.kind == "f" else y
            if not np.array_equal(xb, yb):
                where = {k: int(a[k][i]) for k in keys if k in a.dtype.names}
                return {"record": i, **where, "field": f, "a": x, "b": y}
    return None
