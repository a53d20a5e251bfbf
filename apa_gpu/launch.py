"""Launch the APA kernels of ``cuda/apa.cu`` with CuPy (numerics.md is the contract).

``attention()`` validates exactly like the emulator (``apa_emu.validate``), runs prep, pass 1 and
pass 2 + merge on the current device, and returns an ``apa_emu.Result``. ``Plan`` keeps the device
buffers of one problem shape for repeated runs (the benchmark).

Every kernel argument that is a C ``int``/``float`` is passed as ``np.int32``/``np.float32``: CuPy
passes a Python float as a double. Launch errors raise at the launch; asynchronous faults raise at
the synchronisation that ends every ``attention()`` call (set ``APA_GPU_SYNC=1`` to synchronise
after every kernel, so that a fault names its kernel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from apa_emu import trace as tr
from apa_emu.api import Result, validate
from apa_emu.config import Config
from apa_emu.geometry import ROWS, TILE, Shape, cdiv

from .build import PROBE, SUPPORTED_D, Variant, build

F32 = np.float32
I32 = np.int32
WARPS = 12
THREADS = 32 * WARPS
STATS_KEYS = 256  # cuda/prep.cuh KEYS_PER_CHUNK
# "separate": prep, pass-1 and pass-2 launches; "fused": pass 1 and pass 2 in one persistent launch
# (cuda/apa.cu apa_fused). Scheduling changes no result bit.
SCHEDULES = ("separate", "fused")


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - exercised only without CuPy
        raise RuntimeError("apa_gpu needs CuPy (pip install cupy-cuda13x)") from e
    return cupy


def available() -> bool:
    """True when CuPy imports, a CUDA device is visible and nvcc can be found."""
    try:
        cp = _cupy()
        if cp.cuda.runtime.getDeviceCount() < 1:
            return False
        from .build import find_nvcc

        find_nvcc()
        return True
    except Exception:
        return False


def check_config(cfg: Config, d: int) -> None:
    """Raise NotImplementedError for what the kernel does not implement (everything else is exact)."""
    if cfg.mma != "sm90":
        raise NotImplementedError(
            f"apa_gpu: config.mma={cfg.mma!r} is an emulator model; the sm_90 kernel implements mma='sm90' only"
        )
    if d not in SUPPORTED_D:
        raise NotImplementedError(f"apa_gpu: head dim {d} is not implemented (supported: 64, 128)")


@lru_cache(maxsize=None)
def _module(variant):
    cp = _cupy()
    return cp.RawModule(path=str(build(variant)))


@lru_cache(maxsize=None)
def _smem_optin() -> int:
    cp = _cupy()
    dev = cp.cuda.runtime.getDevice()
    props = cp.cuda.runtime.getDeviceProperties(dev)
    for key in ("sharedMemPerBlockOptin", b"sharedMemPerBlockOptin"):
        if key in props:
            return int(props[key])
    return int(cp.cuda.Device(dev).attributes["MaxSharedMemoryPerBlockOptin"])


@lru_cache(maxsize=None)
def _kernel(variant, name: str):
    """A kernel of a variant's cubin, allowed the device's whole opt-in shared memory (so that
    every launch's dynamic size, whatever the shape, stays under the function's limit)."""
    k = _module(variant).get_function(name)
    k.max_dynamic_shared_size_bytes = _smem_optin() - k.shared_size_bytes
    return k


@lru_cache(maxsize=None)
def _layout(variant) -> tuple[int, ...]:
    """cuda/apa.cu apa_layout: (pass-1 smem, pass-2 smem without mask words, pass-2 mask words per W,
    visit bytes, row bytes)."""
    cp = _cupy()
    ptr = _module(variant).get_global("apa_layout")
    return tuple(int(x) for x in cp.ndarray((5,), np.int32, memptr=ptr).get())


@lru_cache(maxsize=None)
def _num_sms() -> int:
    cp = _cupy()
    return int(cp.cuda.Device(cp.cuda.runtime.getDevice()).attributes["MultiProcessorCount"])


def probe_kernel(name: str):
    """A kernel of cuda/probe.cu (tests)."""
    return _kernel(PROBE, name)


def _geom_args(s: Shape):
    """cuda/common.cuh Geom's basic sizes, as the kernels take them."""
    return (I32(s.n), I32(s.H), I32(s.Hkv), I32(s.S), I32(s.q_offset))


def _ctas(s: Shape) -> int:
    """CTAs (query blocks of WARPS warps) per (b, hk) (§6.2)."""
    return cdiv(s.nw, WARPS)


def _q_mode(cfg: Config) -> int:
    if not cfg.quant_q:
        return 2
    return 1 if cfg.q_format == "fp8" else 0


class Plan:
    """Device buffers and launch parameters of one (shape, config, trace request)."""

    def __init__(self, shape: Shape, cfg: Config, want: tr.TraceRequest | None = None, schedule: str = "separate"):
        cp = _cupy()
        check_config(cfg, shape.d)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
        self.cp, self.shape, self.cfg, self.want, self.schedule = cp, shape, cfg, want, schedule
        s = shape
        self.variant = Variant(d=s.d, trace=want is not None, p2_f32=cfg.p2_accum == "f32",
                               exp2_fast=cfg.exp2 == "fast")
        self.all_hot = cfg.eps < 0
        smem1, smem2_tiles, smem2_words, visit_bytes, row_bytes = _layout(self.variant)
        if visit_bytes != tr.VISIT_DTYPE.itemsize or row_bytes != tr.row_dtype(s.d).itemsize:
            raise RuntimeError(f"apa_gpu: kernel trace records ({visit_bytes}, {row_bytes} bytes) do not match "
                               f"apa_emu.trace ({tr.VISIT_DTYPE.itemsize}, {tr.row_dtype(s.d).itemsize})")
        self.smem1 = smem1
        self.smem2 = smem2_tiles + 4 * smem2_words * s.W  # + the hot-mask words (merge.cuh)
        self.qmul = cfg.qmul(s.d)
        self.p1_consts = tuple(cfg.pass1_consts())
        # buffers
        B, Hkv, d = s.B, s.Hkv, s.d
        self.ksum = cp.zeros((B, Hkv, d), np.uint64)
        self.amax = cp.zeros((B, Hkv, 2), np.uint32)
        self.kmean = cp.empty((B, Hkv, d), F32)
        self.scales = cp.empty((B, Hkv, 2), F32)
        self.qhat = cp.empty((B, Hkv, s.Rp, d), np.uint16)
        self.cq = cp.empty((B, Hkv, s.Rp), F32)
        self.sh = cp.empty((B, Hkv, s.Rp), F32)
        self.khat = cp.empty((B, Hkv, s.ntiles, TILE * d), np.uint16)  # tile images (cuda/prep.cuh)
        self.vhat = cp.empty((B, Hkv, s.ntiles, TILE * d), np.uint16)
        self.kimg = cp.empty((B, Hkv, s.ntiles, TILE * d), np.uint16)  # FP16 tile images for pass 2
        self.vimg = cp.empty((B, Hkv, s.ntiles, TILE * d), np.uint16)
        self.part = cp.empty((B, Hkv, s.Rp, d), F32)
        self.ml = cp.empty((B, Hkv, s.Rp, 2), F32)
        self.hot = cp.zeros((B, Hkv, s.nw, s.W), np.uint32)
        self.out = cp.empty((B, s.n, s.H, d), np.uint16)
        self.dummy = cp.zeros(16, np.int32)
        self.items = s.B * s.Hkv * _ctas(s)
        self.counters = cp.zeros(4, np.uint32)
        self.flags = cp.zeros(max(self.items, 1), np.uint32)
        self._trace_setup()

    # -- trace ----------------------------------------------------------------------------------
    def _trace_setup(self):
        cp, s = self.cp, self.shape
        self.visit_base = self.row_base = self.visits = self.rows = self.dummy
        self.n_visits = self.n_rows = 0
        self.traced = []
        if self.want is None:
            return
        # visits per warp: its active tiles (§6.3), none when ε < 0 (pass 1 does not run, §9.6)
        nvis = np.zeros(s.nw, np.int64) if self.all_hot else s.last_tiles() + 1
        vb = np.full((s.B, s.Hkv, s.nw), -1, np.int32)
        rb = np.full((s.B, s.Hkv, s.nw), -1, np.int32)
        nv = nr = 0
        for b in range(s.B):
            for hk in range(s.Hkv):
                for w in range(s.nw):
                    if not self.want.wants(b, hk, w):
                        continue
                    self.traced.append((b, hk, w))
                    vb[b, hk, w], rb[b, hk, w] = nv, nr
                    nv += int(nvis[w])
                    nr += min(ROWS, s.R - ROWS * w)
        self.n_visits, self.n_rows = nv, nr
        self.visit_base, self.row_base = cp.asarray(vb), cp.asarray(rb)
        self.visits = cp.zeros(max(nv, 1) * tr.VISIT_DTYPE.itemsize, np.uint8)
        self.rows = cp.zeros(max(nr, 1) * tr.row_dtype(s.d).itemsize, np.uint8)

    # -- launches -------------------------------------------------------------------------------
    def _launch(self, name, grid, block, args, smem=0):
        k = _kernel(self.variant, name)
        if smem > k.max_dynamic_shared_size_bytes:
            # pass 2 keeps every warp's hot-mask words in shared memory: 4·13 bytes per 32 tiles
            raise ValueError(f"apa_gpu: S={self.shape.S} keys needs {smem} bytes of shared memory in {name}, "
                             f"more than the device's {k.max_dynamic_shared_size_bytes}")
        k(grid, (block,), args, shared_mem=smem)
        if os.environ.get("APA_GPU_SYNC"):
            try:
                self.cp.cuda.get_current_stream().synchronize()
            except Exception as e:
                raise RuntimeError(f"apa_gpu: kernel {name} failed: {e}") from e

    def prep(self, q, k, v):
        """numerics.md §5 on device arrays q [B,n,H,d], k, v [B,S,Hkv,d] (float16, contiguous)."""
        s, cfg, g = self.shape, self.cfg, _geom_args(self.shape)
        lsq, inter = I32(cfg.block_scale == "lsq"), I32(cfg.p_groups == "interleaved")
        self.ksum.fill(0)
        self.amax.fill(0)
        self._launch("apa_prep_stats", (-(-s.S // STATS_KEYS), s.Hkv, s.B), 256, (k, v, self.ksum, self.amax, *g))
        self._launch("apa_prep_finalize", (s.Hkv, s.B), s.d, (self.ksum, self.amax, self.kmean, self.scales, *g))
        nb = s.d // 16
        self._launch("apa_prep_q", (-(-s.Rp * nb // 128), s.Hkv, s.B), 128,
                     (q, self.kmean, self.scales, self.qhat, self.cq, self.sh, *g, self.qmul,
                      I32(_q_mode(cfg)), I32(cfg.q_terms), lsq))
        self._launch("apa_prep_k", (-(-s.ntiles * TILE * nb // 128), s.Hkv, s.B), 128,
                     (k, self.kmean, self.scales, self.khat, *g, I32(cfg.quant_k), lsq, inter))
        self._launch("apa_prep_v", (-(-s.ntiles * 4 * s.d // 128), s.Hkv, s.B), 128,
                     (v, self.scales, self.vhat, *g, I32(cfg.quant_v), lsq, inter))
        self._launch("apa_prep_kv16", (-(-s.ntiles * TILE * (s.d // 8) // 128), s.Hkv, s.B), 128,
                     (k, v, self.kimg, self.vimg, *g))

    def attend(self, q):
        """Pass 1 (unless ε < 0), then pass 2 and the merge (numerics.md §7–9)."""
        s, cfg, g = self.shape, self.cfg, _geom_args(self.shape)
        grid = (_ctas(s), s.Hkv, s.B)
        self.hot.fill(0)
        if self.schedule == "fused":
            self.counters.fill(0)
            self.flags.fill(0)
            n_tickets = self.items * (1 if self.all_hot else 2)
            grid = (max(1, min(_num_sms(), n_tickets)),)
            self._launch("apa_fused", grid, THREADS,
                         (self.qhat, self.cq, self.khat, self.vhat, self.scales, self.part, self.ml, self.hot,
                          self.visits, self.visit_base, q, self.kimg, self.vimg, self.sh, self.out, self.rows,
                          self.row_base,
                          self.counters, self.flags, I32(s.B), *g, *self.p1_consts,
                          I32(cfg.tile_order == "ascending"), I32(cfg.p_scale == "pow2"),
                          I32(cfg.p_groups == "interleaved"), I32(cfg.quant_p), self.qmul, I32(self.all_hot)),
                         max(self.smem1, self.smem2))
            return
        if not self.all_hot:
            self._launch("apa_pass1", grid, THREADS,
                         (self.qhat, self.cq, self.khat, self.vhat, self.scales, self.part, self.ml, self.hot,
                          self.visits, self.visit_base, *g, *self.p1_consts,
                          I32(cfg.tile_order == "ascending"), I32(cfg.p_scale == "pow2"),
                          I32(cfg.p_groups == "interleaved"), I32(cfg.quant_p)),
                         self.smem1)
        self._launch("apa_pass2", grid, THREADS,
                     (q, self.kimg, self.vimg, self.sh, self.part, self.ml, self.hot, self.out, self.rows,
                      self.row_base,
                      *g, self.qmul, I32(self.all_hot)),
                     self.smem2)

    def run(self, q, k, v):
        self.prep(q, k, v)
        self.attend(q)
        return self.out

    # -- results --------------------------------------------------------------------------------
    def trace_arrays(self):
        """(visits, rows) as the emulator returns them (None when nothing is traced)."""
        if self.want is None or not self.traced:
            return None, None
        s = self.shape
        rows = self.rows.get()[: self.n_rows * tr.row_dtype(s.d).itemsize].view(tr.row_dtype(s.d))
        visits = self.visits.get()[: self.n_visits * tr.VISIT_DTYPE.itemsize].view(tr.VISIT_DTYPE)
        return visits.copy(), rows.copy()


def _as_device(x, cp):
    """A C-contiguous device array whose start is 16-byte aligned (the kernels' cp.async and vector
    loads need it; a CuPy view may start anywhere)."""
    y = cp.ascontiguousarray(cp.asarray(x))
    ptr = y.data.ptr if hasattr(y.data, "ptr") else y.ctypes.data
    return y if ptr % 16 == 0 else y.copy()


def _validate_any(q, k, v, q_offset):
    """apa_emu.validate for NumPy or CuPy inputs; returns (shape, squeeze)."""
    cp = _cupy()
    arrays = (q, k, v)
    if any(isinstance(x, cp.ndarray) for x in arrays):
        # Same checks and messages as the emulator: shapes and dtypes through zero-copy NumPy
        # stand-ins, values on the device; a non-finite array is copied back so that validate()
        # names the first bad index exactly as the emulator does.
        proxies = []
        for x in arrays:
            if isinstance(x, cp.ndarray):
                finite = x.dtype == np.float16 and bool(cp.isfinite(x).all())
                proxies.append(np.broadcast_to(np.zeros((), x.dtype), x.shape) if finite else cp.asnumpy(x))
            else:
                proxies.append(x)
        qb, kb, _, squeeze = validate(*proxies, q_offset)
    else:
        qb, kb, _, squeeze = validate(q, k, v, q_offset)
    B, n, H, d = qb.shape
    return Shape(B=B, n=n, H=H, Hkv=kb.shape[2], S=kb.shape[1], d=d, q_offset=int(q_offset)), squeeze


def attention(q, k, v, q_offset: int = 0, config: Config | None = None, *, trace=None,
              schedule: str | None = None) -> Result:
    """The APA attention on the GPU, bitwise equal to ``apa_emu.attention`` (numerics.md).

    q [n, H, d] or [B, n, H, d], k, v [S, Hkv, d] or [B, S, Hkv, d], float16, NumPy or CuPy.
    ``trace``: None, "all" or (b, hk, warp) triples, as the emulator. ``schedule``: "separate"
    (default, or $APA_GPU_SCHEDULE) or "fused" (one persistent launch for both passes). Returns an
    apa_emu Result with NumPy arrays.
    """
    cp = _cupy()
    cfg = config or Config()
    shape, squeeze = _validate_any(q, k, v, q_offset)
    check_config(cfg, shape.d)
    want = tr.TraceRequest.of(trace)
    qd, kd, vd = (_as_device(x, cp) for x in (q, k, v))
    if squeeze:
        qd, kd, vd = qd[None], kd[None], vd[None]
    plan = Plan(shape, cfg, want, schedule or os.environ.get("APA_GPU_SCHEDULE", "separate"))
    plan.run(qd, kd, vd)
    cp.cuda.get_current_stream().synchronize()
    out = plan.out.get().view(np.float16)
    hot = plan.hot.get()
    visits, rows = plan.trace_arrays()
    hot_tiles = int(np.unpackbits(hot.view(np.uint8)).sum())
    return Result(
        out=out[0] if squeeze else out,
        hot=hot,
        active_tiles=shape.active_tiles(),
        hot_tiles=hot_tiles,
        config=cfg,
        visits=visits,
        rows=rows,
        meta=dict(G=shape.G, R=shape.R, nw=shape.nw, ntiles=shape.ntiles, device="gpu"),
    )


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
    cp = _cupy()
    cfg = config or Config()
    shape, squeeze = _validate_any(q, k, v, q_offset)
    check_config(cfg, shape.d)
    qd, kd, vd = (_as_device(x, cp) for x in (q, k, v))
    if squeeze:
        qd, kd, vd = qd[None], kd[None], vd[None]
    plan = Plan(shape, cfg, None)
    plan.prep(qd, kd, vd)
    cp.cuda.get_current_stream().synchronize()
    s = shape
    h = lambda a: a.get().view(np.float16).astype(F32)  # noqa: E731
    from apa_emu.prep import slot_keys

    slots = slot_keys(cfg.p_groups)
    khat_slot = h(plan.khat).reshape(s.B, s.Hkv, s.ntiles, TILE * s.d)[..., _image_index(TILE, s.d)]
    khat = np.empty_like(khat_slot)
    khat[:, :, :, slots] = khat_slot  # slot j holds key slots[j]
    vhat = h(plan.vhat).reshape(s.B, s.Hkv, s.ntiles, TILE * s.d)[..., _image_index(s.d, TILE)]
    sc = plan.scales.get()
    return dict(
        kmean=plan.kmean.get(), kg=sc[..., 0], vg=sc[..., 1],
        qhat=h(plan.qhat)[:, :, : s.R], cq=plan.cq.get()[:, :, : s.R], sh=plan.sh.get()[:, :, : s.R],
        khat=khat.reshape(s.B, s.Hkv, s.ntiles * TILE, s.d), vhat_t=vhat,
    )


def run_probe_mma(A, B, C, f16_out: bool):
    """m16n8k16 on the GPU for tiles A [T,16,16], B [T,8,16] (binary16 bits or float16), C [T,16,8]
    (float32, or float16 when f16_out). Returns D like C (tests/test_gpu_mma.py)."""
    cp = _cupy()
    A = cp.asarray(np.ascontiguousarray(A).view(np.uint16))
    Bd = cp.asarray(np.ascontiguousarray(B).view(np.uint16))
    T = A.shape[0]
    if f16_out:
        Cd = cp.asarray(np.ascontiguousarray(C).view(np.uint16))
        D = cp.empty_like(Cd)
        probe_kernel("apa_probe_mma_f16")((-(-T // 4),), (128,), (A, Bd, Cd, D, I32(T)))
        return D.get().view(np.float16)
    Cd = cp.asarray(np.ascontiguousarray(C, dtype=F32))
    D = cp.empty_like(Cd)
    probe_kernel("apa_probe_mma_f32")((-(-T // 4),), (128,), (A, Bd, Cd, D, I32(T)))
    return D.get()


def run_probe_exp2(x, variant: str = "soft"):
    """exp2 of every element: "soft" (exp2s), "fast" (the hardware exp2), or the exp2s variants
    "core" (x in [0, 1)) and "nonpos" (x ≤ 0) of cuda/fpmath.cuh."""
    cp = _cupy()
    xd = cp.asarray(np.ascontiguousarray(x, dtype=F32))
    y = cp.empty_like(xd)
    n = xd.size
    mode = I32(("soft", "fast", "core", "nonpos").index(variant))
    probe_kernel("apa_probe_exp2")((max(1, -(-n // 256)),), (256,), (xd, y, np.int64(n), mode))
    return y.get()


def run_probe_codes(x):
    """(E2M1 codes, E4M3 codes) of binary32 values."""
    cp = _cupy()
    xd = cp.asarray(np.ascontiguousarray(x, dtype=F32))
    n = xd.size
    a, b = cp.empty(n, np.uint8), cp.empty(n, np.uint8)
    probe_kernel("apa_probe_codes")((max(1, -(-n // 256)),), (256,), (xd, a, b, np.int64(n)))
    return a.get().reshape(np.shape(x)), b.get().reshape(np.shape(x))


def run_probe_quant16(x, lsq: bool = True):
    """quant16 of x [nblocks, 16]: (codes [nblocks, 16], sb [nblocks])."""
    cp = _cupy()
    xd = cp.asarray(np.ascontiguousarray(x, dtype=F32))
    nb = xd.shape[0]
    codes, sb = cp.empty((nb, 16), np.uint8), cp.empty(nb, np.uint8)
    probe_kernel("apa_probe_quant16")((max(1, -(-nb // 128)),), (128,), (xd, codes, sb, np.int64(nb), I32(lsq)))
    return codes.get(), sb.get()


def run_probe_tables():
    """(LG2 [9], UE4M3 dec [127]) as the kernel holds them."""
    cp = _cupy()
    lg2, dec = cp.empty(9, F32), cp.empty(127, F32)
    probe_kernel("apa_probe_tables")((1,), (128,), (lg2, dec))
    return lg2.get(), dec.get()


__all__ = ["attention", "available", "Plan", "Shape", "prep_arrays", "check_config"]
