"""The kernels' parameter structs, each described once as a NumPy structured dtype.

Every kernel takes one C struct by value (cuda/params.cuh). ``Struct.pack`` builds its bytes from
named values; before a kernel's first launch ``apa_gpu.device`` compares the dtype with the layout
the module exports for it (its size, and each field's offset, size and name hash) and refuses to
launch on any difference, so a field reordered, renamed, added or resized on either side cannot
silently rebind.
"""

from __future__ import annotations

import numbers
import struct

import numpy as np

PTR = np.uint64  # a device address
I32 = np.int32
I64 = np.int64
F32 = np.float32


def name_hash(name: str) -> int:
    """cuda/params.cuh apa_name_hash, as the int32 the table holds."""
    h = 2166136261
    for c in name.encode():
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


class Struct:
    """A C struct: its name (the module exports ``apa_params_<name>``) and its fields in
    declaration order, each a NumPy scalar type or a nested Struct. The dtype has C's alignment."""

    def __init__(self, name: str, fields: list[tuple[str, object]]):
        self.name = name
        self.fields = tuple(fields)
        self._names = {f for f, _ in self.fields}
        self.dtype = np.dtype([(f, t.dtype if isinstance(t, Struct) else t) for f, t in self.fields], align=True)
        # One struct-module format for the whole record, nested structs flattened and C's padding as pad
        # bytes: a launch packs its values in one call (a NumPy field assignment each cost ~2 µs of host
        # time per field, which the GPU waited for between short launches).
        self._leaves = self._flat_fields(0, "")
        fmt, at = "<", 0
        for _, off, code in self._leaves:
            fmt += f"{off - at}x{code}"
            at = off + struct.calcsize(code)
        self._format = struct.Struct(fmt + f"{self.dtype.itemsize - at}x")

    def layout(self) -> list[int]:
        """What cuda/params.cuh APA_PARAMS_LAYOUT exports: the size, then each field's offset, size
        and name hash (32-bit FNV-1a, as int32)."""
        out = [self.dtype.itemsize]
        for f, _ in self.fields:
            dt, off = self.dtype.fields[f][:2]
            out += [off, dt.itemsize, name_hash(f)]
        return out

    def nested(self) -> list[Struct]:
        return [t for _, t in self.fields if isinstance(t, Struct)]

    _CODE = {np.dtype(PTR): "Q", np.dtype(I32): "i", np.dtype(I64): "q", np.dtype(F32): "f"}

    def _flat_fields(self, base: int, prefix: str) -> list[tuple[str, int, str]]:
        """(dotted name, byte offset, struct-module code) of every scalar field, in order."""
        out = []
        for f, t in self.fields:
            off = base + self.dtype.fields[f][1]
            if isinstance(t, Struct):
                out += t._flat_fields(off, f"{prefix}{f}.")
            else:
                out.append((prefix + f, off, self._CODE[np.dtype(t)]))
        return out

    def pack(self, values: dict, address) -> np.ndarray:
        """The struct as a one-element array (what CuPy passes by value). ``values`` names every
        field: a nested struct as a dict, a pointer as a device array (``address`` gives its
        address) or None (null), anything else as a number."""
        flat: list = []
        self._flatten(values, address, flat)
        try:
            packed = self._format.pack(*flat)
        except struct.error:  # a number outside its field's type
            for (name, _, code), v in zip(self._leaves, flat):
                try:
                    struct.pack(code, v)
                except struct.error as e:
                    raise ValueError(f"{self.name}.{name}: {v} is out of range ({e})") from None
            raise
        return np.frombuffer(bytearray(packed), self.dtype)

    def _flatten(self, values: dict, address, out: list) -> None:
        if values.keys() != self._names:
            missing, extra = sorted(self._names - values.keys()), sorted(values.keys() - self._names)
            raise TypeError(f"{self.name}: missing fields {missing}, unknown fields {extra}")
        for f, t in self.fields:
            v = values[f]
            if t.__class__ is Struct:
                t._flatten(v, address, out)
            elif t is PTR:
                if v is None:
                    out.append(0)
                elif isinstance(v, (numbers.Number, np.generic)):
                    raise TypeError(f"{self.name}.{f}: a pointer takes a device array or None, not {v!r}")
                else:
                    out.append(address(v))
            elif v.__class__ in _SCALARS or isinstance(v, (numbers.Number, np.generic)):
                out.append(float(v) if t is F32 else int(v))  # as NumPy's assignment converts
            else:
                raise TypeError(f"{self.name}.{f}: expected a number, got {type(v).__name__}")


# The scalar types the launches pass, tested by identity before the slower abstract-class check.
_SCALARS = frozenset((bool, int, float, np.float32, np.int32, np.int64, np.bool_))


# cuda/common.cuh GeomSizes: the sizes every kernel derives its geometry from (§6).
GEOM_SIZES = Struct("GeomSizes", [("n", I32), ("H", I32), ("Hkv", I32), ("S", I32), ("q_offset", I32),
                                   ("window", I32), ("S_buf", I32), ("cu_q", PTR), ("cu_k", PTR)])

# cuda/prep.cuh KvPages: paged KV (§5.0); a null table is the contiguous layout.
KV_PAGES = Struct("KvPages", [("table", PTR), ("page_size", I32), ("max_pages", I32)])

# cuda/common.cuh TileSpan: the tiles a launch forms or visits, and their slots in the key images (§6.7).
TILE_SPAN = Struct("TileSpan", [("lo", I32), ("hi", I32), ("sink", I32), ("first", I32), ("stride", I32)])

# cuda/apa.cu PrepParams: the five prep kernels (§5).
PREP = Struct("PrepParams", [
    ("sz", GEOM_SIZES),
    ("q", PTR), ("k", PTR), ("v", PTR), ("pages", KV_PAGES), ("ksum", PTR), ("amax", PTR), ("kmean", PTR), ("scales", PTR),
    ("qhat", PTR), ("cq", PTR), ("sh", PTR), ("qstat", PTR), ("kvstat", PTR), ("khat", PTR), ("vhat", PTR),
    ("nu", PTR),
    ("qmul", F32), ("q_mode", I32), ("q_terms", I32), ("quant_k", I32), ("quant_v", I32), ("lsq", I32),
    ("interleaved", I32), ("v_f16", I32), ("p2_lanes", I32), ("pad_vote", I32), ("fma", I32), ("span", TILE_SPAN),
])

# cuda/pass1.cuh Pass1Args; eps .. Kf are apa_emu.constants.Pass1Consts, by the same names.
PASS1_ARGS = Struct("Pass1Args", [
    ("qhat", PTR), ("cq", PTR), ("khat", PTR), ("vhat", PTR), ("scales", PTR), ("nu", PTR), ("part", PTR),
    ("ml", PTR), ("carry", PTR), ("span", TILE_SPAN), ("hot", PTR), ("trace_visits", PTR), ("visit_base", PTR),
    ("eps", F32), ("delta", F32), ("tau", F32), ("A", F32), ("L", F32), ("Kf", F32),
    ("ascending", I32), ("pow2", I32), ("interleaved", I32), ("quant_p", I32), ("output", I32), ("fma", I32),
    ("pad_vote", I32), ("direct", I32),
])

# cuda/merge.cuh CertConsts: apa_emu.constants.CertConsts, by the same names (§9.7).
CERT = Struct("CertConsts", [("sd", F32), ("cs", F32), ("c2", F32), ("fast", F32), ("delta", F32)])

# cuda/pass2.cuh Pass2Args.
PASS2_ARGS = Struct("Pass2Args", [
    ("q", PTR), ("k", PTR), ("v", PTR), ("pages", KV_PAGES), ("kv_maps", PTR), ("sh", PTR), ("part", PTR), ("ml", PTR), ("hot", PTR), ("out", PTR),
    ("cq", PTR), ("qstat", PTR), ("kvstat", PTR), ("bound", PTR),
    ("trace_rows", PTR), ("row_base", PTR), ("qmul", F32), ("all_hot", I32), ("fma", I32), ("direct", I32),
    ("cert", CERT),
])

# cuda/apa.cu: the entry points of the two passes and of the fused persistent launch.
PASS1 = Struct("Pass1Params", [("sz", GEOM_SIZES), ("pass1", PASS1_ARGS)])
PASS2 = Struct("Pass2Params", [("sz", GEOM_SIZES), ("pass2", PASS2_ARGS)])
FUSED = Struct("FusedParams", [
    ("sz", GEOM_SIZES), ("B", I32), ("counters", PTR), ("flags", PTR), ("pass1", PASS1_ARGS), ("pass2", PASS2_ARGS),
])

# cuda/apa.cu's entry points and the struct each takes.
KERNELS = {
    **dict.fromkeys(("apa_prep_stats", "apa_prep_finalize", "apa_prep_q", "apa_prep_k", "apa_prep_v"), PREP),
    "apa_pass1": PASS1, "apa_pass1_segment": PASS1, "apa_pass2": PASS2, "apa_fused": FUSED,
}
