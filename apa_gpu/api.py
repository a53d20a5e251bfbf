"""The public entry points: ``attention`` (bitwise equal to ``apa_emu.attention``) and
``prep_arrays`` (the prep outputs, for localising a mismatch), on NumPy or device arrays."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from apa_emu import trace as tr
from apa_emu.api import Result, check_state_use, check_window, validate
from apa_emu.config import Config
from apa_emu.geometry import TILE, Shape, cdiv
from apa_emu import kvstate, varlen
from apa_emu.kvstate import KVState
from apa_emu.paging import check_pages, gather, unpage
from apa_emu.prep import KV_STATS, slot_keys

from . import device
from .plan import KVImages, Plan, check_config


def available() -> bool:
    """True when the selected backend can run (see apa_gpu.device)."""
    return device.usable()


def _as_device(x, xp):
    """A C-contiguous device array whose start is 16-byte aligned (the kernels' cp.async and vector
    loads need it; a device view may start anywhere)."""
    y = xp.ascontiguousarray(xp.asarray(x))
    return y if device.backend().address(y) % 16 == 0 else y.copy()


def _validate_any(q, k, v, q_offset, xp):
    """apa_emu.validate for host or device inputs; returns (shape, squeeze)."""
    arrays = (q, k, v)
    if any(isinstance(x, xp.ndarray) for x in arrays):
        # Same checks and messages as the emulator: shapes and dtypes through zero-copy NumPy
        # stand-ins, values on the device; a non-finite array is copied back so that validate()
        # names the first bad index exactly as the emulator does.
        proxies = []
        for x in arrays:
            if isinstance(x, xp.ndarray):
                finite = x.dtype == np.float16 and bool(xp.isfinite(x).all())
                proxies.append(np.broadcast_to(np.zeros((), x.dtype), x.shape) if finite else xp.asnumpy(x))
            else:
                proxies.append(x)
        qb, kb, _, squeeze = validate(*proxies, q_offset)
    else:
        qb, kb, _, squeeze = validate(q, k, v, q_offset)
    B, n, H, d = qb.shape
    return Shape(B=B, n=n, H=H, Hkv=kb.shape[2], S=kb.shape[1], d=d, q_offset=int(q_offset)), squeeze


def _prepare(q, k, v, q_offset, cfg, stand_ins=None):
    """(shape, squeeze, batched device q, k, v) of validated inputs. ``stand_ins``: what to validate
    in place of k and v (a paged call's logical keys); k and v are then page pools, never batched."""
    xp = device.backend().xp
    shape, squeeze = _validate_any(q, *(stand_ins or (k, v)), q_offset, xp)
    check_config(cfg, shape.d)
    qd, kd, vd = (_as_device(x, xp) for x in (q, k, v))
    if squeeze:
        qd = qd[None]
        if stand_ins is None:
            kd, vd = kd[None], vd[None]
    return shape, squeeze, qd, kd, vd


def _prepare_paged(q, k, v, q_offset, cfg, block_table, seqlen_k):
    """(shape, squeeze, batched device q, the device pools, (device block table, page size)) of paged
    inputs (numerics.md §5.0), refused as the emulator refuses them: the pools' values are checked
    where the table reads them, through the emulator's gather when a pool holds a non-finite value."""
    xp = device.backend().xp
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, (np.ndarray, xp.ndarray)):
            raise ValueError(f"{name}: expected a numpy array, got {type(x).__name__}")
    host_table = xp.asnumpy(block_table) if isinstance(block_table, xp.ndarray) else block_table
    pages = check_pages(host_table, k.shape, v.shape, q.ndim, q.shape[0], seqlen_k)
    proxies = []
    for x in (k, v):
        if x.dtype == np.float16 and bool((xp if isinstance(x, xp.ndarray) else np).isfinite(x).all()):
            logical = np.broadcast_to(np.zeros((), x.dtype), (pages.table.shape[0], pages.S, *x.shape[2:]))
        else:
            logical = gather(x if isinstance(x, np.ndarray) else xp.asnumpy(x), pages)
        proxies.append(logical if q.ndim == 4 else logical[0])
    return (*_prepare(q, k, v, q_offset, cfg, proxies), (xp.asarray(pages.table), pages.page_size))


def attention(q, k, v, q_offset: int = 0, config: Config | None = None, *, window: int | None = None,
              block_table=None, seqlen_k: int | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
              kv_state: KVState | None = None, trace=None, schedule: str | None = None,
              segment_tiles: int | None = None) -> Result:
    """The APA attention on the GPU, bitwise equal to ``apa_emu.attention`` (numerics.md).

    q [n, H, d] or [B, n, H, d], k, v [S, Hkv, d] or [B, S, Hkv, d], float16, NumPy or device
    arrays. ``window``: a sliding window of W keys, as the emulator. ``block_table``, ``seqlen_k``:
    paged KV (k and v page pools [pages, page_size, Hkv, d]), as the emulator (§5.0). ``cu_seqlens_q``,
    ``cu_seqlens_k``: a varlen batch, as the emulator (§6.6), in one launch. ``kv_state``: a chunk of
    a chunked prefill, as the emulator (§5.9). ``trace``: None, "all" or
    (b, hk, warp) triples, as the emulator. ``schedule``:
    "separate" (default, or $APA_GPU_SCHEDULE), "fused" (one persistent launch for both passes) or
    "bounded" (pass 1's key images for ``segment_tiles`` tiles at a time, default
    apa_gpu.plan.SEGMENT_TILES: device memory beyond the inputs that does not grow with the context,
    numerics.md §6.7). Returns an apa_emu Result with NumPy arrays.
    """
    cfg = config or Config()
    schedule = schedule or os.environ.get("APA_GPU_SCHEDULE", "separate")
    if segment_tiles is not None and schedule != "bounded":
        raise ValueError(f"segment_tiles={segment_tiles!r}: only the bounded schedule has segments, "
                         f"not schedule={schedule!r}")
    check_state_use(kv_state, window, block_table, cu_seqlens_q, cu_seqlens_k)
    pages = seqs = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        seqs = varlen.check(q, k, v, q_offset, cu_seqlens_q, cu_seqlens_k, block_table)
        packed, _, qd, kd, vd = _prepare(q, k, v, 0, cfg)  # the values, named by their packed index
        if seqlen_k is not None:
            unpage(q, k, v, None, seqlen_k)  # the emulator's refusal
        for e in seqs.shapes(packed.H, packed.Hkv, packed.d, None):
            check_window(window, e.n, e.S, e.q_offset)  # every sequence's rows keep a key
        shape = seqs.longest(packed.H, packed.Hkv, packed.d, None if window is None else int(window))
        squeeze = False
    elif block_table is None:
        if seqlen_k is not None:
            unpage(q, k, v, None, seqlen_k)  # the emulator's refusal
        shape, squeeze, qd, kd, vd = _prepare(q, k, v, q_offset, cfg)
    else:
        shape, squeeze, qd, kd, vd, pages = _prepare_paged(q, k, v, q_offset, cfg, block_table, seqlen_k)
    if seqs is None:
        shape = dataclasses.replace(shape, window=check_window(window, shape.n, shape.S, shape.q_offset))
    be = device.backend()
    frozen = images = None
    from_tile = 0
    if kv_state is not None:
        frozen = kvstate.begin(kv_state, kd, vd, shape.n, shape.q_offset, be.xp)
        if schedule == "bounded":
            kv_state.cache = None  # it forms its own images, each call: later chunks must not reuse older ones
        else:
            images, from_tile = _state_images(kv_state, frozen is not None, shape, cfg)
    bounded = {} if segment_tiles is None else dict(segment=segment_tiles)
    plan = Plan(shape, cfg, tr.TraceRequest.of(trace), schedule, seqs, images, **bounded)
    plan.run(qd, kd, vd, pages, frozen, from_tile)
    if kv_state is not None:
        kvstate.finish(kv_state, kd, plan.stats(), be.xp)
    be.synchronize()
    out = be.xp.asnumpy(plan.out).view(np.float16)
    bound = be.xp.asnumpy(plan.bound)
    hot = be.xp.asnumpy(plan.hot)[..., :shape.W]
    visits, rows = plan.trace_arrays()
    return Result(
        out=out[0] if squeeze else out,
        err_bound=bound[0] if squeeze else bound,
        hot=hot,
        active_tiles=plan.active_tiles(),
        hot_tiles=int(np.unpackbits(hot.view(np.uint8)).sum()),
        config=cfg,
        visits=visits,
        rows=rows,
        meta=dict(G=shape.G, R=shape.R, nw=shape.nw, ntiles=shape.ntiles, device="gpu"),
    )


def _state_images(state: KVState, frozen: bool, shape: Shape, cfg: Config) -> tuple[KVImages, int]:
    """The KV state's device key images for this chunk and the first tile prep must form (§5.9): a
    frozen chunk forms only the tiles from the previous call's last complete one on; a restat, a
    changed config or a context past the images' room forms them all (in images with twice the room)."""
    images = state.cache
    fits = images is not None and images.key == KVImages.key_of(shape, cfg)
    if not fits or shape.S > images.tiles * TILE:
        room = max(2 * shape.S, 2 * images.tiles * TILE if fits else 0)
        images = state.cache = KVImages(shape, cfg, cdiv(room, TILE), len(KV_STATS))
    if not frozen:
        images.held = 0  # until prep has formed them under the new statistics
    return images, min(images.held, state.length // TILE)


def _image_index(rows: int, cols: int) -> np.ndarray:
    """[rows, cols] half offsets of a tile image (cuda/mma.cuh sw128_half: K-major rows of 64
    halves, 16-byte chunk c of row r at chunk c ^ (r mod 8), every further 64 columns a block)."""
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    return (c // 64) * rows * 64 + r * 64 + (((c // 8) % 8) ^ (r % 8)) * 8 + c % 8


def prep_arrays(q, k, v, q_offset: int = 0, config: Config | None = None) -> dict:
    """Prep outputs (numerics.md §5) as NumPy arrays, laid out like apa_emu.prep.Prepared, for
    localising a mismatch: kmean [B,Hkv,d], kg, vg [B,Hkv], qhat [B,Hkv,R,d], cq, sh [B,Hkv,R],
    khat [B,Hkv,T*64,d] (key order), vhat_t [B,Hkv,T,d,64] (slot order), all float32."""
    cfg = config or Config()
    s, _, qd, kd, vd = _prepare(q, k, v, q_offset, cfg)
    plan = Plan(s, cfg, None)
    plan.prep(qd, kd, vd)
    be = device.backend()
    be.synchronize()
    get = be.xp.asnumpy
    h = lambda a: get(a).view(np.float16).astype(np.float32)  # noqa: E731
    slots = slot_keys(cfg.p_groups)
    khat_slot = h(plan.khat).reshape(s.B, s.Hkv, s.ntiles, TILE * s.d)[..., _image_index(TILE, s.d)]
    khat = np.empty_like(khat_slot)
    khat[:, :, :, slots] = khat_slot  # slot j holds key slots[j]
    vhat = h(plan.vhat).reshape(s.B, s.Hkv, s.ntiles, TILE * s.d)[..., _image_index(s.d, TILE)]
    sc = get(plan.scales)
    return dict(
        kmean=get(plan.kmean), kg=sc[..., 0], vg=sc[..., 1],
        qhat=h(plan.qhat)[:, :, : s.R], cq=get(plan.cq)[:, :, : s.R], sh=get(plan.sh)[:, :, : s.R],
        qstat=get(plan.qstat)[:, :, : s.R], kvstat=get(plan.kvstat).view(np.float32),
        khat=khat.reshape(s.B, s.Hkv, s.ntiles * TILE, s.d), vhat_t=vhat,
    )


__all__ = ["attention", "available", "check_config", "prep_arrays"]
