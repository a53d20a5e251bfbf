"""The call contract: one step that resolves and checks an attention call for every engine.

``resolve_call`` takes ``attention``'s arguments, on NumPy, CuPy or any DLPack arrays (apa_emu/arrays.py:
torch tensors on the host or a CUDA device, imported without a copy), refuses every bad one
with a ValueError naming it, and returns a typed ``Call``: the batched inputs, their ``Shape``, the
checked pages (§5.0), the sequences of a varlen batch (§6.6), each already a call of its own, the KV
state (§5.9) and what to trace (§10). An engine then only runs a Call (``apa_emu.api.run``,
``apa_gpu.api.run``), so the emulator and the kernel refuse the same inputs with the same message. The
model is FlashAttention-3's ``Arguments → to_underlying_arguments → Params``: the host arguments are
lowered once.

Engines outside apa_emu (apa_gpu, users' own kernels) import from apa_emu only its declared contract,
held by the import-linter contracts in pyproject.toml: this module, whose ``__all__`` adds the
vocabulary of a Call's fields (the Config, the geometry, the prep statistics' layout, the varlen
sequences); ``apa_emu.result`` (the Result an engine returns); ``apa_emu.kvstate`` (§5.9) and
``apa_emu.trace`` (§10) for the parts of a call they name; and the Engine interface of
apa_emu/engines.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import arrays
from . import trace as tr
from . import varlen
from .config import Config
from .geometry import HEAD_DIMS, ROWS, TILE, Shape, cdiv
from .kvstate import KVState
from .paging import Pages, check_pages, gather
from .prep import KV_STATS, slot_keys
from .varlen import Seqs

__all__ = [
    "Call", "resolve_call", "resolve_config", "logical_kv", "validate",
    "Config", "Shape", "ROWS", "TILE", "cdiv", "KV_STATS", "slot_keys", "Seqs",
]

MAX_POSITION = 2**31 - 1  # positions are int32 in the kernel (cuda/common.cuh Geom)


@dataclass(frozen=True)
class Call:
    """A checked call. ``q`` is [B, n, H, d]; ``k``, ``v`` are [B, S, Hkv, d], or the page pools
    [pages, page_size, Hkv, d] when ``pages`` is set; in a varlen call (``seqs``) all three are the
    packed arrays [1, total, heads, d], ``shape`` is the longest sequence's, B the sequences, and
    ``parts`` holds each sequence as a checked call of its own (§6.6: bottom-right causal, its rows
    and keys sliced from the packed arrays). Arrays stay where the caller had them: NumPy on the host,
    CuPy on a device (another DLPack array imported as one of them, sharing its memory)."""

    q: Any
    k: Any
    v: Any
    shape: Shape
    squeeze: bool = False
    pages: Pages | None = None
    seqs: Seqs | None = None
    kv_state: KVState | None = None
    want: tr.TraceRequest | None = None
    warps: frozenset | None = None
    parts: tuple[Call, ...] = ()

    def sequences(self) -> list[Call | None]:
        """A varlen call as its sequences, each with its share of ``warps`` and of the traced warps,
        renumbered to b = 0; None for a sequence none of whose warps is chosen."""
        subs = []
        for b, part in enumerate(self.parts):
            warps = _share(self.warps, b)
            if warps == frozenset():
                subs.append(None)
                continue
            want = None if self.want is None else tr.TraceRequest(_share(self.want.warps, b))
            subs.append(replace(part, want=want, warps=warps))
        return subs


def _share(triples, b: int) -> frozenset | None:
    """The (b, hk, warp) triples of sequence b, renumbered to b = 0; None (every warp) stays None."""
    return None if triples is None else frozenset((0, hk, w) for bb, hk, w in triples if bb == b)


def _array_module(arrays):
    """CuPy when any input is a CuPy array, else NumPy: the call's values are checked where they are."""
    for x in arrays:
        if type(x).__module__.startswith("cupy"):
            import cupy

            return cupy
    return np


def _host_view(x, xp):
    """What ``validate`` reads of an input: itself on the host; for a device array, a zero-copy
    stand-in of its shape when it is finite float16 (its values were checked on the device), else a
    host copy, so that the first bad index is named exactly as for a host array."""
    if xp is np or not isinstance(x, xp.ndarray):
        return x
    if x.dtype == np.float16 and bool(xp.isfinite(x).all()):
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)
    return xp.asnumpy(x)


def validate(q, k, v, q_offset) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Check shapes, dtypes, head layout and values; return batched [B, ...] views and whether the
    input had no batch axis. Every problem is a ValueError naming the argument."""
    q, k, v = _float16s(q, k, v)
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v: batch axis must be present in all or none (ndim {q.ndim}, {k.ndim}, {v.ndim})")
    squeeze = q.ndim == 3
    qb, kb, vb = (x[None] if squeeze else x for x in (q, k, v))
    _check_dims(qb, kb, vb, q.shape, k.shape, v.shape)
    _check_offset(q_offset, qb.shape[1])
    for name, x in (("q", qb), ("k", kb), ("v", vb)):
        # all strides zero: one value seen everywhere (a stand-in for a device array checked there)
        bad = ~np.isfinite(x if any(x.strides) else x[(slice(0, 1),) * x.ndim])
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}: non-finite value {x[idx]} at index {idx if not squeeze else idx[1:]}")
    return qb, kb, vb, squeeze


def _float16s(q, k, v):
    arrays = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise ValueError(f"{name}: expected a NumPy or DLPack array, got {type(x).__name__}")
        if x.dtype.kind != "f" or x.dtype.itemsize != 2:
            raise ValueError(f"{name}: expected dtype float16, got {x.dtype}")
        if x.ndim not in (3, 4):
            raise ValueError(f"{name}: expected shape [n, heads, d] or [batch, n, heads, d], got {x.shape}")
        arrays.append(x.astype(np.float16, copy=False))  # a byte-swapped float16 is converted, not refused
    return arrays


def _check_dims(qb, kb, vb, q_shape, k_shape, v_shape) -> None:
    if not (qb.shape[0] == kb.shape[0] == vb.shape[0]):
        raise ValueError(f"q, k, v: batch sizes differ ({qb.shape[0]}, {kb.shape[0]}, {vb.shape[0]})")
    if kb.shape != vb.shape:
        raise ValueError(f"k, v: shapes differ ({k_shape} vs {v_shape})")
    B, n, H, d = qb.shape
    S, Hkv = kb.shape[1], kb.shape[2]
    if kb.shape[3] != d:
        raise ValueError(f"k: head dim {kb.shape[3]} differs from q's {d}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head dim {d} is not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
    if n < 1 or S < 1 or H < 1 or Hkv < 1 or B < 1:
        raise ValueError(f"q, k: every dimension must be at least 1 (q {q_shape}, k {k_shape})")
    if H % Hkv:
        raise ValueError(f"q, k: query heads {H} are not a multiple of KV heads {Hkv}")


def _check_offset(q_offset, n: int) -> None:
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)):
        raise ValueError(f"q_offset: expected an integer, got {q_offset!r}")
    q_offset = int(q_offset)  # a Python int: NumPy fixed-width arithmetic would wrap around
    if q_offset < 0:
        raise ValueError(f"q_offset: {q_offset} leaves query row 0 with no key (it must be >= 0)")
    if int(q_offset) + n - 1 > MAX_POSITION:
        raise ValueError(f"q_offset: {q_offset} puts query positions past {MAX_POSITION} (int32 positions)")


def resolve_config(config) -> Config:
    """``config=``: None (the default Config) or a Config. Checked here, once for every engine, so that
    a string or a dict is one ValueError rather than an AttributeError deep in an engine."""
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise ValueError(f"config: expected an apa_emu Config or None, got {type(config).__name__} {config!r} "
                         f"(e.g. Config(eps=0.1))")
    return config


def check_triples(name: str, triples, shape: Shape) -> None:
    """``warps=``/``trace=``: every (b, hk, warp) must exist, or its rows would silently stay NaN."""
    if triples is None:
        return
    for t in tr.integer_triples(name, triples):
        if not (0 <= t[0] < shape.B and 0 <= t[1] < shape.Hkv and 0 <= t[2] < shape.nw):
            raise ValueError(f"{name}: warp {t} does not exist (b < {shape.B}, hk < {shape.Hkv}, "
                             f"warp < {shape.nw})")


def window_keys(window) -> int | None:
    """``window=``: None (full causal) or W ≥ 1 keys (§6.1), as a Python int."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
        raise ValueError(f"window: expected a positive integer (keys per row) or None, got {window!r}")
    window = int(window)  # a Python int: a NumPy unsigned window would wrap around in check_reach
    if window < 1:
        raise ValueError(f"window={window}: must be >= 1 (the keys a row sees, its own position included)")
    if window > np.iinfo(np.int64).max:  # positions are int64 (§6.1); a larger window would overflow them
        raise ValueError(f"window={window}: must be at most 2**63 - 1 (a window past every key is full causal: "
                         f"window=None)")
    return window


def check_reach(shape: Shape) -> None:
    """Every query row of a windowed call must keep a key (§6.1)."""
    window, n, S = shape.window, shape.n, shape.S
    if window is None:
        return
    last = shape.q_offset + n - 1
    if last - window + 1 > S - 1:
        raise ValueError(f"window={window}: query row {n - 1} (position {last}) would see no key: its window "
                         f"starts at key {last - window + 1}, past the last key {S - 1}")


def check_state_use(kv_state, window, block_table, cu_seqlens_q, cu_seqlens_k, warps=None) -> None:
    """§5.9: a KV state is a KVState, defined for a dense causal chunk only."""
    if kv_state is None:
        return
    if not isinstance(kv_state, KVState):
        raise ValueError(f"kv_state: expected an apa_emu.KVState, got {type(kv_state).__name__}")
    for name, value in (("window", window), ("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k), ("warps", warps)):
        if value is not None:
            raise ValueError(f"kv_state: chunked prefill with {name}= is not supported; pass one or the other")


def _no_seqlen_k(seqlen_k) -> None:
    if seqlen_k is not None:
        raise ValueError("seqlen_k: only with a block_table (a contiguous k holds its S keys)")


def _shape(qb, kb, q_offset) -> Shape:
    B, n, H, d = qb.shape
    return Shape(B=B, n=n, H=H, Hkv=kb.shape[2], S=kb.shape[1], d=d, q_offset=int(q_offset))


def _resolve_varlen(q, k, v, q_offset, window, block_table, seqlen_k, cu_seqlens_q, cu_seqlens_k, xp) -> Call:
    """§6.6: the packed arrays, checked by their packed index; every sequence's rows keep a key. Each
    sequence becomes a call of its own here, on slices of the checked arrays."""
    seqs = varlen.check(q, k, v, q_offset, cu_seqlens_q, cu_seqlens_k, block_table)
    qb, kb, vb, _ = validate(*(_host_view(x, xp) for x in (q, k, v)), 0)
    _no_seqlen_k(seqlen_k)
    each, longest = seqs.shapes(qb.shape[2], kb.shape[2], qb.shape[3], window_keys(window))
    for shape in each:
        check_reach(shape)
    qp, kp, vp = (qb, kb, vb) if xp is np else (x[None] for x in (q, k, v))
    cq, ck = seqs.cq, seqs.ck
    parts = tuple(Call(qp[:, cq[b]:cq[b + 1]], kp[:, ck[b]:ck[b + 1]], vp[:, ck[b]:ck[b + 1]], shape, squeeze=True)
                  for b, shape in enumerate(each))
    return Call(qp, kp, vp, longest, seqs=seqs, parts=parts)


def _resolve_paged(q, k, v, q_offset, block_table, seqlen_k, xp) -> Call:
    """§5.0: the pools' values are checked where the table reads them: through ``gather`` when a pool
    holds a non-finite value, so that the bad key is named by its logical index."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, (np.ndarray, xp.ndarray)):
            raise ValueError(f"{name}: expected a NumPy or DLPack array, got {type(x).__name__}")
    pages = check_pages(block_table, k.shape, v.shape, q.ndim, q.shape[0], seqlen_k)
    logical = []
    for x in (k, v):
        if x.dtype == np.float16 and bool((xp if isinstance(x, xp.ndarray) else np).isfinite(x).all()):
            keys = np.broadcast_to(np.zeros((), x.dtype), (pages.table.shape[0], pages.S, *x.shape[2:]))
        else:
            keys = gather(x if isinstance(x, np.ndarray) else xp.asnumpy(x), pages)
        logical.append(keys if q.ndim == 4 else keys[0])
    qb, kb, _, squeeze = validate(_host_view(q, xp), *logical, q_offset)
    return Call(qb if xp is np else q[None] if squeeze else q, k, v, _shape(qb, kb, q_offset), squeeze, pages)


def _resolve_dense(q, k, v, q_offset, seqlen_k, xp) -> Call:
    _no_seqlen_k(seqlen_k)
    qb, kb, vb, squeeze = validate(*(_host_view(x, xp) for x in (q, k, v)), q_offset)
    batched = (x[None] if squeeze else x for x in (q, k, v))
    if xp is np:
        batched = qb, kb, vb  # validate's float16 views (a byte-swapped input converted)
    return Call(*batched, _shape(qb, kb, q_offset), squeeze)


def resolve_call(q, k, v, q_offset=0, *, window=None, block_table=None, seqlen_k=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, kv_state: KVState | None = None, trace=None, warps=None) -> Call:
    """``attention``'s arguments (see ``apa_emu.attention``), checked and lowered once. q, k and v are
    imported as NumPy or CuPy arrays sharing the caller's memory (apa_emu/arrays.py), the block table
    and cu_seqlens brought to the host. Inputs on a device are checked there, and only what names a bad
    value comes back to the host."""
    check_state_use(kv_state, window, block_table, cu_seqlens_q, cu_seqlens_k, warps)
    q, k, v = (arrays.imported(name, x, "dtype float16") for name, x in (("q", q), ("k", k), ("v", v)))
    block_table, cu_seqlens_q, cu_seqlens_k = (arrays.host(name, x, "an integer array") for name, x in
                                               (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q),
                                                ("cu_seqlens_k", cu_seqlens_k)))
    xp = _array_module((q, k, v))
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        call = _resolve_varlen(q, k, v, q_offset, window, block_table, seqlen_k, cu_seqlens_q, cu_seqlens_k, xp)
        return _with_warps(call, trace, warps)
    if block_table is None:
        call = _resolve_dense(q, k, v, q_offset, seqlen_k, xp)
    else:
        call = _resolve_paged(q, k, v, q_offset, block_table, seqlen_k, xp)
    shape = replace(call.shape, window=window_keys(window))
    check_reach(shape)
    return _with_warps(replace(call, shape=shape, kv_state=kv_state), trace, warps)


def _with_warps(call: Call, trace, warps) -> Call:
    """The call with what to trace and which warps to run, each triple checked to exist (in a varlen
    call, b is the sequence and the warp one of the longest sequence's; then each sequence checks its
    share against its own warps)."""
    want = tr.TraceRequest.of(trace)
    _check_warps(call.shape, warps, want)
    chosen = None if warps is None else frozenset(tr.integer_triples("warps", warps))
    call = replace(call, want=want, warps=chosen)
    for sub in filter(None, call.sequences()):
        _check_warps(sub.shape, None if sub.warps is None else sorted(sub.warps), sub.want)
    return call


def _check_warps(shape: Shape, warps, want: tr.TraceRequest | None) -> None:
    for name, triples in (("warps", warps), ("trace", None if want is None else want.warps)):
        check_triples(name, triples, shape)


def logical_kv(call: Call):
    """A host call's contiguous keys and values [B, S, Hkv, d]: the pools gathered through the block
    table (§5.0), which defines a paged call, else the inputs."""
    if call.pages is None:
        return call.k, call.v
    return (gather(x, call.pages).astype(np.float16, copy=False) for x in (call.k, call.v))


def owner(call: Call, index) -> tuple[tuple[int, int, int], int]:
    """The (b, hk, warp) computing the pair at ``index`` and its packed row there (§6.2; in a varlen
    call b is the sequence and the row its own)."""
    *lead, row, head = (int(i) for i in index)
    G = call.shape.G
    if call.seqs is not None:
        b = int(np.searchsorted(call.seqs.cq, row, side="right")) - 1
        row -= int(call.seqs.cq[b])
    else:
        b = lead[0] if lead else 0
    packed = row * G + head % G
    return (b, head // G, packed // ROWS), packed
