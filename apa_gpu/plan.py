"""The device buffers and kernel launches of one problem (cuda/apa.cu), kept for repeated runs."""

from __future__ import annotations

import numpy as np

from apa_emu import trace as tr
from apa_emu.call import ROWS, TILE, Config, Seqs, Shape, cdiv
from apa_emu.kvstate import Stats

from . import device
from .build import SUPPORTED_D, Variant, backend_name
from .params import KERNELS

# "separate": prep, pass-1 and pass-2 launches; "fused": pass 1 and pass 2 in one persistent launch
# (cuda/apa.cu apa_fused); "bounded": pass 1's key images for one segment of tiles at a time, so that
# the device memory beyond the inputs does not grow with the context (numerics.md §6.7). Scheduling
# changes no result bit.
SCHEDULES = ("separate", "fused", "bounded")
# The bounded schedule's segment: with the sink tile, the images of the seed's window ring (apa-blog.txt:
# the sink tile and two slots of 96 tiles), which our launches fill one after the other.
SEGMENT_TILES = 192
# The seed's toggle the emulator alone models (numerics.md §12 #5): the kernel runs its default.
EMULATED = ("k_stats",)
PREP_THREADS = 128  # block of apa_prep_q (at most its __launch_bounds__)


def check_config(cfg: Config, d: int) -> None:
    """Raise NotImplementedError for what the kernel does not implement (everything else is exact)."""
    if cfg.mma != "sm90":
        raise NotImplementedError(
            f"apa_gpu: config.mma={cfg.mma!r} is an emulator model; the sm_90 kernel implements mma='sm90' only"
        )
    seed_only = [f"{name}={getattr(cfg, name)!r}" for name in EMULATED if getattr(cfg, name) != getattr(Config(), name)]
    if seed_only:
        raise NotImplementedError(f"apa_gpu: config {', '.join(seed_only)} is an emulator model of the seed "
                                  f"(numerics.md §12); the sm_90 kernel does not implement it")
    if d not in SUPPORTED_D:
        raise NotImplementedError(
            f"apa_gpu: head dim {d} is not implemented (supported: {', '.join(map(str, SUPPORTED_D))})")
    if cfg.exp2 == "fast" and backend_name() == "sim":
        raise NotImplementedError("apa_gpu: config.exp2='fast' needs the GPU's special-function unit "
                                  "(numerics.md §13); the CPU simulator has none")


class KVImages:
    """Prep's per-(b, hk) key images of pass 1 (cuda/prep.cuh): K̂, V̂ᵀ, ν (§5.8), with ``tiles`` slots,
    the certificate maxima and the estimate's means (§5.7), and the means' integer sums per tile
    ``kvsum``, for ``key_tiles`` tiles (cuda/common.cuh Geom ntkv_buf: the call's, or a KV state's room,
    which is ``tiles``) by their index. A call forms its own: every tile, or in the bounded schedule
    the sink tile and one segment at a time; a KV state (§5.9) keeps one across chunks, valid for
    ``key`` (the sizes and toggles prep read) and the state's statistics, its first ``held`` tiles
    complete."""

    ARRAYS = ("khat", "vhat", "nu", "kvstat", "kvsum")

    def __init__(self, shape: Shape, cfg: Config, tiles: int, kv_stats: int, key_tiles: int | None = None):
        xp = device.backend().xp
        B, Hkv, d = shape.B, shape.Hkv, shape.d
        self.key = self.key_of(shape, cfg)
        self.tiles = tiles
        self.held = 0
        self.khat, self.vhat = (xp.empty((B, Hkv, self.tiles, TILE * d), np.uint16) for _ in range(2))
        self.nu = xp.empty((B, Hkv, self.tiles, TILE), np.uint16) if cfg.hot_test == "output" else None
        self.kvstat = xp.zeros((B, Hkv, kv_stats), np.uint32)
        self.kvsum = xp.empty((B, Hkv, key_tiles or tiles, len(device.KV_MEANS)), np.uint64)

    @staticmethod
    def key_of(shape: Shape, cfg: Config) -> tuple:
        return (shape.B, shape.Hkv, shape.d, cfg.quant_k, cfg.quant_v, cfg.block_scale, cfg.p_groups, cfg.hot_test,
                cfg.v_f16)


class Plan:
    """Device buffers and launch parameters of one (shape, config, trace request).

    ``seqs``: a varlen batch (apa_emu.varlen.Seqs, §6.6), launched at once: ``shape`` is then the
    longest sequence's sizes (B = the sequences), which size the per-(b, hk) buffers, and the kernels
    read each sequence's own from cu_seqlens (cuda/common.cuh Geom). ``images``: a KV state's key
    images (§5.9), used in place of the call's own (not under the bounded schedule). ``segment``: the
    bounded schedule's tiles per segment (None: SEGMENT_TILES; refused with another schedule)."""

    @staticmethod
    def check(shape: Shape, cfg: Config, schedule: str = "separate", segment: int | None = None) -> int:
        """Refuse what the kernel cannot run (a config, a schedule, segments), before any device work;
        returns the bounded schedule's tiles per segment."""
        check_config(cfg, shape.d)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if segment is not None and schedule != "bounded":
            raise ValueError(f"segment_tiles={segment!r}: only the bounded schedule has segments, "
                             f"not schedule={schedule!r}")
        segment = SEGMENT_TILES if segment is None else segment
        if isinstance(segment, bool) or not isinstance(segment, (int, np.integer)) or segment < 1:
            raise ValueError(f"segment={segment!r}: expected a positive number of tiles")
        return int(segment)

    def __init__(self, shape: Shape, cfg: Config, want: tr.TraceRequest | None = None, schedule: str = "separate",
                 seqs: Seqs | None = None, images: KVImages | None = None, segment: int | None = None):
        segment = self.check(shape, cfg, schedule, segment)
        self.bounded = schedule == "bounded"
        if self.bounded and images is not None:
            raise ValueError("the bounded schedule forms its own key images; a KV state's are not used with it")
        self.shape, self.cfg, self.want, self.schedule = shape, cfg, want, schedule
        self.segment = int(segment)
        s = shape
        self.variant = Variant(d=s.d, trace=want is not None, p2_f32=cfg.p2_accum == "f32",
                               p2_s32=cfg.p2_scores == "f32", exp2_fast=cfg.exp2 == "fast")
        self.layout = lay = device.layout(self.variant)
        # The toggles each kernel struct carries, lowered by Config once (apa_emu/constants.py).
        self.prep_flags, self.pass1_flags, self.pass2_flags = cfg.prep_flags(), cfg.pass1_flags(), cfg.pass2_flags()
        self.all_hot = self.pass2_flags.all_hot
        self.qmul = cfg.qmul(s.d)
        self.smem1 = lay.p1_smem
        self.smem2 = lay.p2_smem + 4 * lay.p2_mask_words * s.W  # every warp's hot-mask words: grows with S
        self.ctas = cdiv(s.nw, lay.warps)  # CTAs (query blocks) per (b, hk) (§6.2)
        self.items = s.B * s.Hkv * self.ctas
        xp = device.backend().xp
        B, Hkv, d = s.B, s.Hkv, s.d
        self.ksum = xp.zeros((B, Hkv, d), np.uint64)
        self.amax = xp.zeros((B, Hkv, 2), np.uint32)
        self.kmean = xp.empty((B, Hkv, d), np.float32)
        self.scales = xp.empty((B, Hkv, 2), np.float32)
        self.qhat = xp.empty((B, Hkv, s.Rp, d), np.uint16)
        self.cq = xp.empty((B, Hkv, s.Rp), np.float32)
        self.sh = xp.empty((B, Hkv, s.Rp), np.float32)
        self.qstat = xp.empty((B, Hkv, s.Rp, 3), np.float32)
        # A KV state's images, or this call's own: every tile, or the sink tile and one segment (§6.7).
        slots = 1 + min(self.segment, s.ntiles) if self.bounded else s.ntiles
        self.images = images or KVImages(s, cfg, slots, lay.kv_stats, s.ntiles)
        for name in KVImages.ARRAYS:
            setattr(self, name, getattr(self.images, name))
        self.part = xp.empty((B, Hkv, s.Rp, d), np.float32)
        self.ml = xp.empty((B, Hkv, s.Rp, lay.p1_ml), np.float32)
        self.carry = xp.empty((B, Hkv, s.Rp, lay.p1_carry), np.float32) if self.bounded else None
        self.kv_maps, self._maps_for = None, None  # pass 2's tensor maps, and the k and v they describe
        # The hot words and the state's images are strided by the state's room (S_buf), or by S.
        S_buf = images.tiles * TILE if images is not None else 0
        self.hot = xp.zeros((B, Hkv, s.nw, cdiv(S_buf // TILE or s.ntiles, 32)), np.uint32)
        self.entries = None if seqs is None else seqs.shapes(s.H, s.Hkv, d, s.window)[0]
        rows = (B, s.n) if seqs is None else (int(seqs.cq[-1]),)  # varlen: packed [total_q, ...]
        self.out = xp.empty((*rows, s.H, d), np.uint16)
        self.bound = xp.empty((*rows, s.H), np.float32)
        self.est = xp.empty((*rows, s.H), np.float32)
        self.counters = xp.zeros(4, np.uint32)
        self.flags = xp.zeros(max(self.items, 1), np.uint32)
        cu = (None, None) if seqs is None else (xp.asarray(seqs.cq.astype(np.int32)), xp.asarray(seqs.ck.astype(np.int32)))
        self.sizes = dict(n=s.n, H=s.H, Hkv=s.Hkv, S=s.S, q_offset=s.q_offset, window=s.window or 0,
                          S_buf=S_buf, cu_q=cu[0], cu_k=cu[1])
        self._trace_setup(xp)

    def entry(self, b: int) -> Shape:
        """The Shape of batch entry b (a varlen sequence's own)."""
        return self.shape if self.entries is None else self.entries[b]

    def active_tiles(self) -> int:
        return self.shape.active_tiles() if self.entries is None else sum(e.active_tiles() for e in self.entries)

    # -- trace ----------------------------------------------------------------------------------
    def _trace_setup(self, xp):
        """Record buffers and each traced warp's first record; null pointers without a trace (the
        plain build never touches them)."""
        s = self.shape
        self.visit_base = self.row_base = self.visits = self.rows = None
        self.n_visits = self.n_rows = 0
        self.traced = []
        if self.want is None:
            return
        vb = np.full((s.B, s.Hkv, s.nw), -1, np.int32)
        rb = np.full((s.B, s.Hkv, s.nw), -1, np.int32)
        nv = nr = 0
        for b in range(s.B):
            e = self.entry(b)
            # visits per warp: its active tiles (§6.3), none when ε < 0 (pass 1 does not run, §9.6)
            nvis = np.zeros(e.nw, np.int64) if self.all_hot else e.last_tiles() - e.first_tiles() + 1
            for hk in range(s.Hkv):
                for w in range(e.nw):
                    if not self.want.wants(b, hk, w):
                        continue
                    self.traced.append((b, hk, w))
                    vb[b, hk, w], rb[b, hk, w] = nv, nr
                    nv += int(nvis[w])
                    nr += min(ROWS, e.R - ROWS * w)
        self.n_visits, self.n_rows = nv, nr
        self.visit_base, self.row_base = xp.asarray(vb), xp.asarray(rb)
        self.visits = xp.zeros(max(nv, 1) * tr.VISIT_DTYPE.itemsize, np.uint8)
        self.rows = xp.zeros(max(nr, 1) * tr.row_dtype(s.d).itemsize, np.uint8)

    # -- launches -------------------------------------------------------------------------------
    def _pass1_entry(self, name):
        """The kernel entry of pass 1 (or the fused launch) for the call's hot test: the budget test's is
        a kernel of its own (cuda/apa.cu), whose registers the other tests' do not share."""
        return f"{name}_budget" if self.pass1_flags.budget else name

    def launch(self, name, grid, block, params, smem=0):
        """Every kernel launch of the plan goes through here, so that a profiler can wrap it on one plan
        (tools/bench_gpu.py times each launch this way)."""
        device.launch(device.kernel(self.variant, name, KERNELS[name]), grid, block, params, smem)

    def prep(self, q, k, v, pages=None, stats=None, from_tile=0):
        """numerics.md §5 on device arrays q [B,n,H,d], k, v [B,S,Hkv,d] (float16, contiguous), or page
        pools [pages, page_size, Hkv, d] with ``pages`` = (device int32 block table [B, max_pages],
        page_size) (§5.0). ``stats``: a frozen chunk's statistics (apa_emu.kvstate.Stats, §5.9), which
        replace §5.1–5.2; ``from_tile``: the key images below it are the KV state's, formed under them.
        The bounded schedule forms only the sink tile's images here, and each segment's in attend."""
        s, lay = self.shape, self.layout
        table, page_size = pages if pages is not None else (None, 0)
        kv_pages = dict(table=table, page_size=page_size, max_pages=0 if table is None else table.shape[1])
        self._tensor_maps(k, v, table is None)
        self._prep_params = dict(  # pass 2 reads k, v and pages from here too
            sz=self.sizes, q=q, k=k, v=v, pages=kv_pages, ksum=self.ksum, amax=self.amax, kmean=self.kmean,
            scales=self.scales, qhat=self.qhat, cq=self.cq, sh=self.sh, qstat=self.qstat, kvstat=self.kvstat,
            kvsum=self.kvsum, khat=self.khat, vhat=self.vhat, nu=self.nu, qmul=self.qmul, **self.prep_flags._asdict(),
            span=self._span(0, 0))
        p = self._prep_params
        self.ksum.fill(0)
        self.amax.fill(0)
        if from_tile == 0:
            self.kvstat.fill(0)  # else the maxima over the held tiles' keys, which the new ones extend
        bhd = (s.Hkv, s.B)
        xp = device.backend().xp
        if stats is None:
            self.launch("apa_prep_stats", (cdiv(s.S, lay.keys_per_chunk), *bhd), lay.stats_threads, p)
            self.launch("apa_prep_finalize", bhd, s.d, p)
        else:
            self.kmean[...] = xp.asarray(stats.kmean)
            self.scales[...] = xp.asarray(np.stack([stats.kg, stats.vg], axis=-1))
        self.launch("apa_prep_q", (cdiv(s.Rp * (s.d // 16), PREP_THREADS), *bhd), PREP_THREADS, p)
        if self.bounded:
            self._form(0, 1)
        else:
            self._form(from_tile, s.ntiles)
            self.images.held = s.S // TILE
            self._means()

    def _tensor_maps(self, k, v, contiguous: bool) -> None:
        """Pass 2's tensor maps of contiguous k and v ([rows, Hkv, d], every batch entry's keys; cuda/
        pipeline.cuh load_tensors), kept while k and v stay where they are; paged: none (cp.async rows)."""
        be = device.backend()
        where = (be.address(k), be.address(v), k.size) if contiguous else None
        if where != self._maps_for:
            rows = k.size // (self.shape.Hkv * self.shape.d)
            self.kv_maps = None if where is None else be.xp.asarray(
                np.concatenate([be.tensor_map(x, rows, self.shape.Hkv, self.shape.d) for x in (k, v)]))
            self._maps_for = where

    def _span(self, lo: int, hi: int, first: int = 0) -> dict:
        """cuda/common.cuh TileSpan of a launch over tiles lo .. hi-1 whose non-sink tiles start at
        ``first`` in the images: all at their own index, or the bounded schedule's sink tile at slot 0
        and its segment after it (§6.7)."""
        return dict(lo=lo, hi=hi, sink=int(self.bounded), first=first, stride=self.images.tiles)

    def _form(self, lo: int, hi: int, first: int = 0) -> None:
        """Pass 1's key images and the certificate's maxima of tiles lo .. hi-1 (§5.4–5.8)."""
        if hi <= lo:
            return
        lay, grid = self.layout, (hi - lo, self.shape.Hkv, self.shape.B)
        p = dict(self._prep_params, span=self._span(lo, hi, first))
        self.launch("apa_prep_k", grid, lay.k_threads, p)
        self.launch("apa_prep_v", grid, lay.v_threads, p, lay.v_smem)

    def _means(self) -> None:
        """§5.7's means from the per-tile sums of every tile formed (the estimate's, §9.8)."""
        self.launch("apa_prep_means", (self.shape.Hkv, self.shape.B), self.layout.mean_threads, self._prep_params)

    def segments(self) -> list[tuple[int, int]]:
        """The bounded schedule's segments of tiles after the sink tile, in the order pass 1 visits
        them (§6.7): descending for the diagonal order, ascending for the ascending one."""
        T, n = self.segment, self.shape.ntiles
        out = [(lo, min(lo + T, n)) for lo in range(1, max(n, 2), T)]
        return out if self.cfg.tile_order == "ascending" else out[::-1]

    def attend(self, q):
        """Pass 1 (unless ε < 0), then pass 2 and the merge (numerics.md §7–9); in the bounded
        schedule, each segment's key images first and pass 1 over it, then the means of them all (under
        the budget test, §7.7, before pass 1)."""
        s, cfg = self.shape, self.cfg
        threads = 32 * self.layout.warps
        pass1 = dict(qhat=self.qhat, cq=self.cq, khat=self.khat, vhat=self.vhat, scales=self.scales, nu=self.nu,
                     qstat=self.qstat, kvstat=self.kvstat, rho=cfg.est_consts(s.d).rho, part=self.part, ml=self.ml,
                     carry=self.carry, span=self._span(0, s.ntiles), hot=self.hot,
                     trace_visits=self.visits, visit_base=self.visit_base,
                     **cfg.pass1_consts()._asdict(), **self.pass1_flags._asdict())
        p = self._prep_params
        pass2 = dict(q=q, k=p["k"], v=p["v"], pages=p["pages"], kv_maps=self.kv_maps, sh=self.sh, part=self.part,
                     ml=self.ml, hot=self.hot, out=self.out, cq=self.cq, qstat=self.qstat, kvstat=self.kvstat,
                     bound=self.bound, est=self.est, trace_rows=self.rows, row_base=self.row_base, qmul=self.qmul,
                     **self.pass2_flags._asdict(), cert=cfg.cert_consts(s.d)._asdict(),
                     est_k=cfg.est_consts(s.d)._asdict())
        self.hot.fill(0)
        if self.schedule == "fused":
            self.counters.fill(0)
            self.flags.fill(0)
            n_tickets = self.items * (1 if self.all_hot else 2)
            grid = (max(1, min(device.backend().num_sms, n_tickets)),)
            self.launch(self._pass1_entry("apa_fused"), grid, threads,
                         dict(sz=self.sizes, B=s.B, counters=self.counters, flags=self.flags, pass1=pass1,
                              pass2=pass2),
                         max(self.smem1, self.smem2))
            return
        grid = (self.ctas, s.Hkv, s.B)
        if self.bounded:
            early = self.pass1_flags.budget and not self.all_hot  # §7.7: βr reads the means before pass 1,
            if early:  # so every segment's sums are formed once before it (its images again below)
                for lo, hi in self.segments():
                    self._form(lo, hi, lo)
                self._means()
            for lo, hi in self.segments():
                self._form(lo, hi, lo)
                if not self.all_hot:  # the segment holding tile 1 also visits the sink tile 0
                    span = self._span(0 if lo == 1 else lo, hi, lo)
                    self.launch(self._pass1_entry("apa_pass1_segment"), grid, threads,
                                 dict(sz=self.sizes, pass1=dict(pass1, span=span)), self.smem1)
            if not early:
                self._means()
        elif not self.all_hot:
            self.launch(self._pass1_entry("apa_pass1"), grid, threads, dict(sz=self.sizes, pass1=pass1), self.smem1)
        self.launch("apa_pass2", grid, threads, dict(sz=self.sizes, pass2=pass2), self.smem2)

    def stats(self) -> Stats:
        """The statistics prep used (§5.1–5.2), on the host."""
        xp = device.backend().xp
        scales = xp.asnumpy(self.scales)
        return Stats(xp.asnumpy(self.kmean), scales[..., 0], scales[..., 1])

    def run(self, q, k, v, pages=None, stats=None, from_tile=0):
        self.prep(q, k, v, pages, stats, from_tile)
        self.attend(q)
        return self.out

    # -- results --------------------------------------------------------------------------------
    def trace_arrays(self):
        """(visits, rows) as the emulator returns them (None when nothing is traced)."""
        if self.want is None or not self.traced:
            return None, None
        s, xp = self.shape, device.backend().xp
        rows = xp.asnumpy(self.rows)[: self.n_rows * tr.row_dtype(s.d).itemsize].view(tr.row_dtype(s.d))
        visits = xp.asnumpy(self.visits)[: self.n_visits * tr.VISIT_DTYPE.itemsize].view(tr.VISIT_DTYPE)
        return visits, rows
