"""The kernels' parameter structs, each read from its one declaration in the kernel sources.

Every kernel takes one C struct by value (cuda/params.cuh). A struct S is declared once, as the field
list ``#define APA_FIELDS_S(X)`` of ``X(type, name)`` lines in cuda/; ``declared()`` reads those lines
into a NumPy structured dtype with C's alignment, so a field added, moved or retyped there reaches the
host without an edit here. ``Struct.pack`` builds a struct's bytes from named values; before a
kernel's first launch ``apa_gpu.device`` compares the dtype with the layout the module exports for it
(its size, and each field's offset, size and name hash) and refuses to launch on any difference, so a
field the reading here got wrong cannot silently rebind.
"""

from __future__ import annotations

import numbers
import re
import struct
from pathlib import Path

import numpy as np

from .build import CUDA_DIR

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
        """What cuda/params.cuh APA_PARAMS_EXPORT exports: the size, then each field's offset, size
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


# cuda/params.cuh: a field's C type, as the host holds it. Any pointer is a device address.
C_TYPES = {"int": I32, "long long": I64, "float": F32}
_LIST = re.compile(r"^#define APA_FIELDS_(\w+)\(X\)((?:.*\\\n)*.*)$", re.M)
_FIELD = re.compile(r"\bX\(\s*([^,()]+?)\s*,\s*(\w+)\s*\)")
_ALIAS = re.compile(r"^#define APA_FIELDS_(\w+)\s+APA_FIELDS_(\w+)\s*$", re.M)


def declared(cuda_dir: Path = CUDA_DIR) -> dict[str, Struct]:
    """Every struct the kernel sources declare by a field list (cuda/params.cuh APA_FIELDS_S), by
    name, a struct that shares another's list (``#define APA_FIELDS_T APA_FIELDS_S``) among them; a
    field of another such struct's type nests it (the same Struct object)."""
    lists, aliases = {}, []
    for path in sorted(cuda_dir.glob("*.cu*")):
        text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
        for name, body in _LIST.findall(text):
            if name in lists:
                raise ValueError(f"{path.name}: APA_FIELDS_{name} is declared twice")
            lists[name] = (path.name, _FIELD.findall(body))
        aliases += [(path.name, name, of) for name, of in _ALIAS.findall(text)]
    for where, name, of in aliases:
        if name in lists or of not in lists:
            raise ValueError(f"{where}: APA_FIELDS_{name} is declared twice or names no list ({of})")
        lists[name] = lists[of]
    structs: dict[str, Struct] = {}

    def get(name: str) -> Struct:
        if name not in structs:
            where, fields = lists[name]
            structs[name] = Struct(name, [(f, _host_type(t, lists, get, f"{where} {name}.{f}")) for t, f in fields])
        return structs[name]

    for name in lists:
        get(name)
    return structs


def _host_type(ctype: str, lists, get, where: str):
    """The NumPy scalar type or nested Struct of C type ``ctype``."""
    ctype = " ".join(ctype.split())
    if ctype.endswith("*"):
        return PTR
    if ctype in C_TYPES:
        return C_TYPES[ctype]
    if ctype in lists:
        return get(ctype)
    raise ValueError(f"{where}: type {ctype!r} is not a pointer, {', '.join(C_TYPES)} or a declared struct")


DECLARED = declared()
GEOM_SIZES = DECLARED["GeomSizes"]  # cuda/common.cuh: the sizes every kernel derives its geometry from (§6)
KV_PAGES = DECLARED["KvPages"]  # cuda/common.cuh: paged KV (§5.0); a null table is the contiguous layout
TILE_SPAN = DECLARED["TileSpan"]  # cuda/common.cuh: the tiles a launch forms or visits (§6.7)
PREP = DECLARED["PrepParams"]  # cuda/apa.cu: the six prep kernels (§5)
PASS1_ARGS = DECLARED["Pass1Args"]  # cuda/pass1.cuh; Pass1Consts and Pass1Flags by the same names
CERT = DECLARED["CertConsts"]  # cuda/merge.cuh: apa_emu.constants.CertConsts by the same names (§9.7)
EST = DECLARED["EstConsts"]  # cuda/merge.cuh: apa_emu.constants.EstConsts by the same names (§9.8)
PASS2_ARGS = DECLARED["Pass2Args"]  # cuda/pass2.cuh; Pass2Flags by the same names
# cuda/apa.cu: the entry points of the two passes and of the fused persistent launch.
PASS1, PASS2, FUSED = DECLARED["Pass1Params"], DECLARED["Pass2Params"], DECLARED["FusedParams"]

# cuda/apa.cu's entry points and the struct each takes.
KERNELS = {
    **dict.fromkeys(("apa_prep_stats", "apa_prep_finalize", "apa_prep_q", "apa_prep_k", "apa_prep_v",
                     "apa_prep_means"), PREP),
    **dict.fromkeys(("apa_pass1", "apa_pass1_segment", "apa_pass1_budget", "apa_pass1_segment_budget"), PASS1),
    "apa_pass2": PASS2, "apa_fused": FUSED, "apa_fused_budget": FUSED,
}
