"""Chunked prefill with a KV state (numerics.md §5.9): the statistics a long prompt's chunks share.

``begin`` checks a call against its state and decides, as the spec does, whether it restats or runs
frozen on the state's statistics; ``finish`` records what the call left. Both take the array module
of the inputs (NumPy or CuPy), so the emulator and the kernel's launcher decide the same way on the
same bits, and nothing but a few numbers ever leaves the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

F32 = np.float32
QMAX = F32(2688)  # the largest NVFP4 value, 6·448 (§5.9 overflow)
FINGER_CHANNELS = 16


class Stats(NamedTuple):
    """§5.1–5.2 statistics per (b, hk): kmean [B, Hkv, d], kg and vg [B, Hkv], binary32."""

    kmean: np.ndarray
    kg: np.ndarray
    vg: np.ndarray


@dataclass
class KVState:
    """What a chunk leaves for the next (§5.9). Start with ``KVState()`` and pass the same object to
    every chunk of one prompt; the call updates it."""

    length: int = 0  # len: keys of the previous call
    stats_length: int = 0  # slen: keys the statistics were made for
    stats: Stats | None = None  # host arrays
    fingerprint: np.ndarray | None = None  # uint16 [3, 16]
    last: str = ""  # why the last call restatted ("" when it ran frozen)
    # begin's decision for the call under way; finish makes it ``last``, so a call that never finished
    # (an error, Ctrl-C) leaves the state describing the one before it
    pending: str = field(default="", repr=False, compare=False)
    history: list = field(default_factory=list)  # (S, reason) per call
    cache: object = field(default=None, repr=False, compare=False)  # an implementation's (the kernel's key images)

    @property
    def chunks(self) -> int:
        return len(self.history)

    @property
    def restats(self) -> int:
        return sum(1 for _, reason in self.history if reason)

    def __repr__(self) -> str:
        return (f"KVState(length={self.length}, stats_length={self.stats_length}, chunks={self.chunks}, "
                f"restats={self.restats}, last={self.last!r})")


def _fingerprint(k, S: int, xp) -> np.ndarray:
    """K[b 0, s, hk 0, channels 0..15] at s = 0, S div 2, S − 1, as FP16 bits (k batched [B, S, Hkv, d])."""
    x = k[0, [0, S // 2, S - 1], 0, :FINGER_CHANNELS]
    return np.array(x if xp is np else xp.asnumpy(x)).view(np.uint16)


def overflows(k, v, first: int, stats: Stats, xp, v_f16: bool = False) -> bool:
    """§5.9, §5.10: whether a key first .. S − 1 exceeds 2688 under the statistics, in K or in V (the
    V value §5.5 quantizes under ``v_f16``, §5.10)."""
    kmean = xp.asarray(stats.kmean)[:, None]  # [B, 1, Hkv, d]
    inv_kg = (F32(1) / xp.asarray(stats.kg))[:, None, :, None]
    inv_vg = (F32(1) / xp.asarray(stats.vg))[:, None, :, None]
    xk = (k[:, first:].astype(F32) - kmean) * inv_kg
    xv = v[:, first:].astype(F32) * inv_vg
    if v_f16:
        xv = xv.astype(np.float16)
    return bool((xp.abs(xk) > QMAX).any()) or bool((xp.abs(xv) > QMAX).any())


def begin(state, k, v, n: int, q_offset: int, xp=np) -> Stats | None:
    """Check a call (k, v batched [B, S, Hkv, d], validated; ``state`` a KVState, apa_emu.call
    check_state_use) against ``state``; the frozen statistics, or None when the call restats. Holds the
    reason for ``finish``; the state itself is not changed."""
    B, S, Hkv, d = k.shape
    if state.length and q_offset != state.length:
        raise ValueError(f"kv_state: the chunk starts at q_offset={q_offset}, but the state holds {state.length} "
                         f"keys; a chunk must follow the state (pass a new KVState() to start a prompt)")
    if S != q_offset + n:
        raise ValueError(f"kv_state: k has {S} keys, but a chunk of {n} rows at q_offset={q_offset} needs "
                         f"{q_offset + n} (the context so far, this chunk's keys last)")
    if state.stats is not None and state.stats.kmean.shape != (B, Hkv, d):
        raise ValueError(f"kv_state: the state's statistics are for (batch, kv heads, d) = "
                         f"{state.stats.kmean.shape}, this call has {(B, Hkv, d)}")
    if state.length == 0:
        reason = "first"
    elif 8 * S >= 9 * state.stats_length:
        reason = "growth"
    elif not np.array_equal(_fingerprint(k, state.length, xp), state.fingerprint):
        reason = "fingerprint"
    elif overflows(k, v, state.length, state.stats, xp):
        reason = "overflow"
    else:
        reason = ""
    state.pending = reason
    return None if reason else state.stats


def finish(state: KVState, k, stats: Stats, xp=np) -> None:
    """After the call: len = S and its fingerprint; on a restat, ``stats`` (the call's own) and slen."""
    S = k.shape[1]
    state.last = state.pending
    if state.last:
        state.stats = Stats(*(np.array(x, F32) for x in stats))  # the kernel's cached images are formed under these
        state.stats_length = S
    state.history.append((S, state.last))
    state.length = S
    state.fingerprint = _fingerprint(k, S, xp)


__all__ = ["KVState", "Stats", "begin", "finish"]
