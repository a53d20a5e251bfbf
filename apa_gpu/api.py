"""The public entry points: ``attention`` (bitwise equal to ``apa_emu.attention``) and
``prep_arrays`` (the prep outputs, for localising a mismatch), on NumPy, CuPy or any DLPack arrays
(torch tensors on the host or the device)."""

from __future__ import annotations

import os

import numpy as np

from apa_emu import kvstate
from apa_emu.call import KV_STATS, TILE, Call, Config, Shape, cdiv, resolve_call, resolve_config, slot_keys
from apa_emu.kvstate import KVState
from apa_emu.result import Result, like_input, run_checked

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


def attention(q, k, v, q_offset: int = 0, config: Config | None = None, *, window: int | None = None,
              block_table=None, seqlen_k: int | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
              kv_state: KVState | None = None, trace=None, schedule: str | None = None,
              segment_tiles: int | None = None) -> Result:
    """The APA attention on the GPU, bitwise equal to ``apa_emu.attention`` (numerics.md).

    q [n, H, d] or [B, n, H, d], k, v [S, Hkv, d] or [B, S, Hkv, d], float16: NumPy arrays, CuPy
    arrays or any array that speaks DLPack (torch tensors, JAX arrays), on the host or the CUDA device,
    read without a copy where their layout allows (a strided one is copied contiguous; a tensor that
    requires grad is detached: inference only). ``window``: a sliding window of W keys, as the emulator. ``block_table``, ``seqlen_k``:
    paged KV (k and v page pools [pages, page_size, Hkv, d]), as the emulator (§5.0). ``cu_seqlens_q``,
    ``cu_seqlens_k``: a varlen batch, as the emulator (§6.6), in one launch. ``kv_state``: a chunk of
    a chunked prefill, as the emulator (§5.9). ``trace``: None, "all" or
    (b, hk, warp) triples, as the emulator. ``schedule``:
    "separate" (default, or $APA_GPU_SCHEDULE), "fused" (one persistent launch for both passes) or
    "bounded" (pass 1's key images for ``segment_tiles`` tiles at a time, default
    apa_gpu.plan.SEGMENT_TILES: device memory beyond the inputs that does not grow with the context,
    numerics.md §6.7). Returns an apa_emu Result whose arrays are of q's kind, on q's device (a CUDA
    torch tensor in: CUDA torch tensors out, copied back from the host; NumPy for NumPy), except §10's
    records (visits, rows), which stay NumPy.
    """
    call = resolve_call(q, k, v, q_offset, window=window, block_table=block_table, seqlen_k=seqlen_k,
                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, kv_state=kv_state, trace=trace)
    cfg = resolve_config(config)
    return like_input(run_checked(call, lambda c: run(c, cfg, schedule=schedule, segment_tiles=segment_tiles)), q)


def run(call: Call, cfg: Config, *, schedule: str | None = None, segment_tiles: int | None = None) -> Result:
    """The kernel's Result of a resolved call (apa_emu.call), in one launch per pass whatever the batch."""
    schedule = schedule or os.environ.get("APA_GPU_SCHEDULE", "separate")
    shape = call.shape
    Plan.check(shape, cfg, schedule, segment_tiles)  # before anything reaches the device
    be = device.backend()
    qd, kd, vd = (_as_device(x, be.xp) for x in (call.q, call.k, call.v))
    pages = None if call.pages is None else (be.xp.asarray(call.pages.table), call.pages.page_size)
    frozen = images = None
    from_tile = 0
    if call.kv_state is not None:
        frozen = kvstate.begin(call.kv_state, kd, vd, shape.n, shape.q_offset, be.xp)
        if schedule == "bounded":
            call.kv_state.cache = None  # it forms its own images, each call: later chunks must not reuse older ones
        else:
            images, from_tile = _state_images(call.kv_state, frozen is not None, shape, cfg)
    plan = Plan(shape, cfg, call.want, schedule, call.seqs, images, segment_tiles)
    plan.run(qd, kd, vd, pages, frozen, from_tile)
    if call.kv_state is not None:
        kvstate.finish(call.kv_state, kd, plan.stats(), be.xp)
    be.synchronize()
    return _result(call, cfg, plan)


def _result(call: Call, cfg: Config, plan: Plan) -> Result:
    be, shape = device.backend(), call.shape
    out = be.xp.asnumpy(plan.out).view(np.float16)
    bound, est = be.xp.asnumpy(plan.bound), be.xp.asnumpy(plan.est)
    hot = be.xp.asnumpy(plan.hot)[..., :shape.W]
    visits, rows = plan.trace_arrays()
    return Result(
        out=out[0] if call.squeeze else out,
        err_bound=bound[0] if call.squeeze else bound,
        err_est=est[0] if call.squeeze else est,
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
    cfg = resolve_config(config)
    call = resolve_call(q, k, v, q_offset)
    s = call.shape
    Plan.check(s, cfg)
    qd, kd, vd = (_as_device(x, device.backend().xp) for x in (call.q, call.k, call.v))
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


__all__ = ["attention", "available", "check_config", "prep_arrays", "run"]
