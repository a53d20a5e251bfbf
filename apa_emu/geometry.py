"""Geometry of one call (numerics.md §6): GQA packing, warps, tiles and the visiting order.

The host twin of ``cuda/common.cuh`` ``Geom`` and ``WarpRows``: the emulator, the GPU launcher, the
studies and the tests all take their geometry from here, so each formula is written once per side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

ROWS = 16  # packed rows per warp (§6.2)
TILE = 64  # keys per tile (§6.3)
GROUP = 16  # keys per P group and values per quantization block (§4.4, §7.3)
GROUPS = TILE // GROUP  # P groups per tile: the k-steps of the P̂ chains (§7.6, §7.8)
HEAD_DIMS = (64, 128, 256)  # head dims the spec defines (§5)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class WarpRows(NamedTuple):
    """The 16 packed rows of one warp (§6.2): indices clamped to a real row, validity, key limits."""

    w: int
    rows: np.ndarray  # int64 [16], padding rows clamped to R − 1
    valid: np.ndarray  # bool [16]
    lim: np.ndarray  # int64 [16], §6.1 (a padding row holds the last real row's limit, as the kernel)
    lo: np.ndarray  # int64 [16], the first visible key (§6.1; 0 without a window)
    first_tile: int  # F_w (§6.3)
    last_tile: int  # T_w (§6.3)


@dataclass(frozen=True)
class Shape:
    """The sizes of one call and everything §6 derives from them."""

    B: int
    n: int
    H: int
    Hkv: int
    S: int
    d: int
    q_offset: int
    window: int | None = None  # sliding window of W keys (§6.1); None: full causal

    @property
    def G(self) -> int:
        return self.H // self.Hkv

    @property
    def R(self) -> int:
        """Packed rows per (b, hk) (§6.1)."""
        return self.n * self.G

    @property
    def nw(self) -> int:
        """Warps per (b, hk) (§6.2)."""
        return cdiv(self.R, ROWS)

    @property
    def Rp(self) -> int:
        """Packed rows padded to whole warps."""
        return ROWS * self.nw

    @property
    def ntiles(self) -> int:
        """ntkv = ⌈S/64⌉ (§6.3)."""
        return cdiv(self.S, TILE)

    @property
    def W(self) -> int:
        """Hot-mask words per warp (§10)."""
        return cdiv(self.ntiles, 32)

    def lim(self, r) -> np.ndarray:
        """§6.1: lim_r = min(q_offset + r div G, S − 1), in Python integers (no overflow)."""
        r = np.asarray(r, dtype=object)
        return np.minimum(self.q_offset + r // self.G, self.S - 1).astype(np.int64)

    def lo(self, r) -> np.ndarray:
        """§6.1: lo_r = max(0, p_r − W + 1) with a window, else 0."""
        r = np.asarray(r, dtype=object)
        if self.window is None:
            return np.zeros(r.shape, np.int64)
        return np.maximum(self.q_offset + r // self.G - self.window + 1, 0).astype(np.int64)

    def first_tiles(self, w=None) -> np.ndarray:
        """F_w of warps ``w`` (default: every warp) (§6.3): the first row's first key, in tiles."""
        w = np.arange(self.nw) if w is None else np.asarray(w)
        return (self.lo(ROWS * w) // TILE).astype(np.int64)

    def last_tiles(self, w=None) -> np.ndarray:
        """T_w of warps ``w`` (default: every warp) (§6.3)."""
        w = np.arange(self.nw) if w is None else np.asarray(w)
        rmax = np.minimum(ROWS * w + ROWS - 1, self.R - 1)
        return np.minimum(self.lim(rmax) // TILE, self.ntiles - 1).astype(np.int64)

    def active_tiles(self) -> int:
        """Active tiles of the whole call, Σ over (b, hk, w) of T_w − F_w + 1 (§6.3)."""
        return self.B * self.Hkv * int((self.last_tiles() - self.first_tiles() + 1).sum())

    def warp_rows(self, w: int) -> WarpRows:
        r = np.arange(w * ROWS, (w + 1) * ROWS)
        valid = r < self.R
        rows = np.minimum(r, self.R - 1)
        return WarpRows(w, rows, valid, self.lim(rows), self.lo(rows), int(self.first_tiles(w)),
                        int(self.last_tiles(w)))


def warp_of(row: int, head: int, G: int) -> tuple[int, int]:
    """(hk, warp) computing query position ``row`` of head ``head`` (§6.1–6.2)."""
    return head // G, (row * G + head % G) // ROWS


def visit_order(first_tile: int, last_tile: int, ascending: bool) -> np.ndarray:
    """Pass 1's visiting order of tiles F_w .. T_w (§6.4; Pass1Flags.ascending): diagonal is tile 0
    first when it is active, then the diagonal backwards; ascending is F_w .. T_w."""
    if not ascending:
        sink = [0] if first_tile == 0 else []
        return np.array([*sink, *range(last_tile, max(first_tile, 1) - 1, -1)], dtype=np.int64)
    return np.arange(first_tile, last_tile + 1, dtype=np.int64)
