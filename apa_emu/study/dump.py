"""Attention dumps in the seed bench's format (docs/dumps.md, "Format"), read memory-mapped and validated.

Layout, all little-endian: six int32 ``n, kv, nh, nkv, hd, off``, then FP16 ``Q[n][nh][hd]``,
``K[kv][nkv][hd]``, ``V[kv][nkv][hd]``. Q row i is the query at position ``off + i``; the keys are
positions ``0 .. kv-1``, so causal row i sees keys ``0 .. off+i``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..geometry import HEAD_DIMS
from .files import open_regular, write_atomically

HEADER_FIELDS = ("n", "kv", "nh", "nkv", "hd", "off")
HEADER_BYTES = 4 * len(HEADER_FIELDS)
BUILTIN_DUMP = "smollm2_L14.apadump"

# Elements per slice of the finiteness scan: the slice stays in cache and a 122880-key dump is
# never pulled into memory at once.
_SCAN_ELEMENTS = 1 << 18
_F16_EXPONENT = 0x7C00
_F16_MANTISSA = 0x03FF


class DumpError(ValueError):
    """A dump file or dump arrays that break the format; the message names the field and the problem."""


@dataclass(frozen=True)
class Dump:
    """One attention problem: FP16 Q [n, nh, hd], K and V [kv, nkv, hd], Q row i at position q_offset + i.

    Arrays read from a file are read-only views of a memory map; ``path`` is that file (None for
    arrays made in memory).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    q_offset: int
    path: Path | None = None

    def __post_init__(self):
        _check_arrays(self.q, self.k, self.v, self.q_offset)
        object.__setattr__(self, "q_offset", int(self.q_offset))

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def kv(self) -> int:
        return self.k.shape[0]

    @property
    def nh(self) -> int:
        return self.q.shape[1]

    @property
    def nkv(self) -> int:
        return self.k.shape[1]

    @property
    def hd(self) -> int:
        return self.q.shape[2]

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA): query head h reads KV head h // group."""
        return self.nh // self.nkv

    @property
    def positions(self) -> np.ndarray:
        """Causal position of every Q row."""
        return np.arange(self.q_offset, self.q_offset + self.n)

    @property
    def nbytes(self) -> int:
        """Size of this dump as a file."""
        return _file_size(self.n, self.kv, self.nh, self.nkv, self.hd)

    def header(self) -> dict[str, int]:
        values = (self.n, self.kv, self.nh, self.nkv, self.hd, self.q_offset)
        return dict(zip(HEADER_FIELDS, values, strict=True))


def builtin_dump_path() -> Path:
    """The real SmolLM2 dump shipped with the package (see apa_emu/study/data/README.md)."""
    return Path(__file__).resolve().parent / "data" / BUILTIN_DUMP


def read_dump(path: str | os.PathLike, check_finite: bool = True) -> Dump:
    """Open a dump memory-mapped after checking its header against its size.

    ``check_finite`` scans every value for NaN and Inf in slices (memory stays small; a
    122880-key dump takes about a second); without it the file opens without reading the payload.
    """
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(HEADER_BYTES)
            n, kv, nh, nkv, hd, off = _header_of(path, raw, size)
            try:
                payload = np.memmap(f, dtype="<f2", mode="r", offset=HEADER_BYTES)
            except (OSError, ValueError) as e:
                raise DumpError(f"{path}: cannot map {size} bytes: {e}") from e
    except OSError as e:
        raise DumpError(f"{path}: cannot open: {e.strerror or e}") from e
    nq, nk = n * nh * hd, kv * nkv * hd
    q = payload[:nq].reshape(n, nh, hd)
    k = payload[nq : nq + nk].reshape(kv, nkv, hd)
    v = payload[nq + nk :].reshape(kv, nkv, hd)
    if check_finite:
        for name, x in (("Q", q), ("K", k), ("V", v)):
            _check_finite(x, name, where=str(path))
    return Dump(q, k, v, off, path)


def write_dump(path: str | os.PathLike, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_offset: int) -> Path:
    """Write FP16 arrays as a dump with ``files.write_atomically``: readers see the old file or the
    whole new one, symlinks are written through and anything but a regular file is refused.

    The arrays must already be float16: a silent cast could round or overflow, which the caller
    should decide about.
    """
    path = Path(path)
    _check_arrays(q, k, v, q_offset)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_finite(x, name, where="write_dump")
    header = np.array([q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], q_offset], dtype="<i4")

    def write(f):
        f.write(header.tobytes())
        for x in (q, k, v):
            f.write(np.ascontiguousarray(x, dtype="<f2"))  # the buffer itself: no second copy

    return write_atomically(path, write)


def _header_of(path: Path, raw: bytes, size: int) -> tuple[int, ...]:
    """The six header fields, checked against each other and against the file size."""
    if size < HEADER_BYTES:
        raise DumpError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = dict(zip(HEADER_FIELDS, (int(x) for x in np.frombuffer(raw, dtype="<i4")), strict=True))
    _check_header(header, where=f"{path}: header")
    n, kv, nh, nkv, hd, off = (header[f] for f in HEADER_FIELDS)
    expected = _file_size(n, kv, nh, nkv, hd)
    if size != expected:
        shape = f"n={n} kv={kv} nh={nh} nkv={nkv} hd={hd}"
        if size < expected:
            problem = f"truncated ({expected - size} bytes missing)"
        else:
            problem = f"{size - expected} trailing bytes"
        raise DumpError(f"{path}: {problem}: header {shape} needs {expected} bytes, the file has {size}")
    return n, kv, nh, nkv, hd, off


def _file_size(n: int, kv: int, nh: int, nkv: int, hd: int) -> int:
    return HEADER_BYTES + 2 * (n * nh * hd + 2 * kv * nkv * hd)


def _check_header(h: dict[str, int], where: str) -> None:
    for field in HEADER_FIELDS:
        low = 0 if field == "off" else 1
        if h[field] < low:
            need = "non-negative" if field == "off" else "positive"
            raise DumpError(f"{where}: {field} = {h[field]}: must be {need}")
        if h[field] >= 2**31:
            raise DumpError(f"{where}: {field} = {h[field]} does not fit the format's int32 header")
    if h["nh"] % h["nkv"]:
        raise DumpError(f"{where}: nh = {h['nh']} is not a multiple of nkv = {h['nkv']}")
    if h["hd"] not in HEAD_DIMS:
        raise DumpError(f"{where}: hd = {h['hd']}: supported head dims are {', '.join(map(str, HEAD_DIMS))}")
    if h["off"] + h["n"] > h["kv"]:
        raise DumpError(
            f"{where}: off + n = {h['off']} + {h['n']} exceeds kv = {h['kv']}: "
            f"the last Q row would sit past the last key"
        )


def _check_arrays(q, k, v, q_offset) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise DumpError(f"{name} must be a numpy array, got {type(x).__name__}")
        if x.dtype != np.float16:
            raise DumpError(f"{name} has dtype {x.dtype}: dumps hold float16 (cast explicitly first)")
        if x.ndim != 3:
            raise DumpError(f"{name} has shape {x.shape}: expected 3 axes")
    if k.shape != v.shape:
        raise DumpError(f"k has shape {k.shape} but v has {v.shape}: they must match")
    if q.shape[2] != k.shape[2]:
        raise DumpError(f"q has head dim {q.shape[2]} but k has {k.shape[2]}")
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)):
        raise DumpError(f"q_offset must be an integer, got {q_offset!r}")
    n, nh, hd = q.shape
    kv, nkv, _ = k.shape
    where = f"dump arrays (q {q.shape}, k {k.shape}, q_offset {q_offset})"
    _check_header(dict(n=n, kv=kv, nh=nh, nkv=nkv, hd=hd, off=int(q_offset)), where)


def _check_finite(x: np.ndarray, name: str, where: str) -> None:
    """Raise at the first NaN or Inf of x, by exponent bits so the scan never converts to float32."""
    flat = x.reshape(-1).view(np.uint16)
    for start in range(0, flat.size, _SCAN_ELEMENTS):
        exponents = flat[start : start + _SCAN_ELEMENTS] & _F16_EXPONENT
        if exponents.max() == _F16_EXPONENT:
            i = start + int(np.argmax(exponents == _F16_EXPONENT))
            kind = "NaN" if flat[i] & _F16_MANTISSA else "Inf"
            index = tuple(int(j) for j in np.unravel_index(i, x.shape))
            raise DumpError(
                f"{where}: {name} holds {kind} at index {list(index)} (its first non-finite value)"
            )
