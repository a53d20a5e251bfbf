"""Public entry point: validate inputs, run prep, pass 1, pass 2 and the merge warp by warp."""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass, field

import numpy as np

from . import trace as tr
from .config import Config
from .merge import merge
from .pass1 import EXACT, SM90, SM120, pass1_warp
from .pass2 import pass2_warp
from .prep import TILE, Prepared, prepare, slot_keys, unpack_rows

ROWS = tr.ROWS_PER_WARP
SUPPORTED_D = (64, 128, 256)
F32 = np.float32
_MODEL = {"sm90": SM90, "sm120": SM120, "exact": EXACT}


@dataclass
class Result:
    """Output of one run. ``out`` has the shape of q; hot masks are per (b, hk, warp) (§10)."""

    out: np.ndarray
    hot: np.ndarray
    active_tiles: int
    hot_tiles: int
    config: Config
    visits: np.ndarray | None = None
    rows: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def hot_share(self) -> float:
        return self.hot_tiles / self.active_tiles if self.active_tiles else 0.0


def validate(q, k, v, q_offset) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Check shapes, dtypes, head layout and values; return batched [B, ...] views and whether the
    input had no batch axis. Every problem is a ValueError naming the argument."""
    arrays = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, np.ndarray):
            raise ValueError(f"{name}: expected a numpy array, got {type(x).__name__}")
        if x.dtype != np.float16:
            raise ValueError(f"{name}: expected dtype float16, got {x.dtype}")
        if x.ndim not in (3, 4):
            raise ValueError(f"{name}: expected shape [n, heads, d] or [batch, n, heads, d], got {x.shape}")
        arrays[name] = x
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v: batch axis must be present in all or none (ndim {q.ndim}, {k.ndim}, {v.ndim})")
    squeeze = q.ndim == 3
    qb, kb, vb = (x[None] if squeeze else x for x in (q, k, v))
    if not (qb.shape[0] == kb.shape[0] == vb.shape[0]):
        raise ValueError(f"q, k, v: batch sizes differ ({qb.shape[0]}, {kb.shape[0]}, {vb.shape[0]})")
    if kb.shape != vb.shape:
        raise ValueError(f"k, v: shapes differ ({k.shape} vs {v.shape})")
    B, n, H, d = qb.shape
    S, Hkv = kb.shape[1], kb.shape[2]
    if kb.shape[3] != d:
        raise ValueError(f"k: head dim {kb.shape[3]} differs from q's {d}")
    if d not in SUPPORTED_D:
        raise ValueError(f"q: head dim {d} is not supported (supported: {', '.join(map(str, SUPPORTED_D))})")
    if n < 1 or S < 1 or H < 1 or Hkv < 1 or B < 1:
        raise ValueError(f"q, k: every dimension must be at least 1 (q {q.shape}, k {k.shape})")
    if H % Hkv:
        raise ValueError(f"q, k: query heads {H} are not a multiple of KV heads {Hkv}")
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)):
        raise ValueError(f"q_offset: expected an integer, got {q_offset!r}")
    if q_offset < 0:
        raise ValueError(f"q_offset: {q_offset} leaves query row 0 with no key (it must be >= 0)")
    for name, x in (("q", qb), ("k", kb), ("v", vb)):
        bad = ~np.isfinite(x)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}: non-finite value {x[idx]} at index {idx if not squeeze else idx[1:]}")
    return qb, kb, vb, squeeze


@dataclass
class _Warp:
    b: int
    hk: int
    w: int
    rows: np.ndarray  # packed row indices (clamped for padding)
    valid: np.ndarray
    lim: np.ndarray
    last_tile: int


def warp_of(row: int, head: int, G: int) -> tuple[int, int]:
    """(hk, warp) computing query position ``row`` of head ``head`` (§6.1–6.2)."""
    return head // G, (row * G + head % G) // ROWS


def _warps(prep: Prepared, b: int, hk: int):
    R, G, S = prep.R, prep.G, prep.S
    for w in range(-(-R // ROWS)):
        r = np.arange(w * ROWS, (w + 1) * ROWS)
        valid = r < R
        lim = np.where(valid, np.minimum(prep.q_offset + r // G, S - 1), -1).astype(np.int64)
        p_wmax = prep.q_offset + (min(w * ROWS + ROWS - 1, R - 1) // G)
        last = min(p_wmax // TILE, prep.ntiles - 1)
        yield _Warp(b, hk, w, np.minimum(r, R - 1), valid, lim, last)


def _visit_order(last: int, tile_order: str) -> np.ndarray:
    if tile_order == "diagonal":
        return np.array([0] + list(range(last, 0, -1)), dtype=np.int64)
    return np.arange(last + 1, dtype=np.int64)


class _Runner:
    """Runs the warps of one (batch, KV head); shared read-only by worker processes (fork)."""

    def __init__(self, prep: Prepared, cfg: Config, want_trace: tr.TraceRequest | None):
        self.prep, self.cfg, self.want = prep, cfg, want_trace
        self.model = _MODEL[cfg.mma]
        self.slots = slot_keys(cfg.p_groups).astype(np.int64)
        self.soft = cfg.exp2 == "soft"
        self.kf = F32(F32(2.0**cfg.tau) / F32(1536))
        self.dummy_u8 = np.zeros((1, ROWS, 16), np.uint8)

    def run(self, wp: _Warp):
        cfg, prep = self.cfg, self.prep
        d, hk = prep.d, 0  # the prep holds this (b, hk) alone
        nwords = -(-prep.ntiles // 32)
        valid = wp.valid
        traced = self.want is not None and self.want.wants(wp.b, wp.hk, wp.w)
        part = np.zeros((ROWS, d), F32)
        m1 = np.full(ROWS, -np.inf, F32)
        l1 = np.zeros(ROWS, F32)
        hot = np.zeros(nwords, np.uint32)
        order = _visit_order(wp.last_tile, cfg.tile_order)
        nv = order.shape[0] if traced and cfg.eps >= 0 else 0
        tr_tile, tr_hot = np.zeros(nv, np.int32), np.zeros(nv, np.uint8)
        tr_f = [np.zeros((nv, ROWS), F32) for _ in range(5)]
        qrows = np.where(valid[:, None], prep.qhat[hk, wp.rows], 0).astype(F32)
        cq = np.where(valid, prep.cq[hk, wp.rows], 1).astype(F32)
        if cfg.eps < 0:
            for t in range(wp.last_tile + 1):
                hot[t // 32] |= np.uint32(1 << (t % 32))
        else:
            if self.model == SM120:
                qc = np.ascontiguousarray(prep.q_codes[:, hk, wp.rows] * valid[None, :, None])
                qs = np.ascontiguousarray(prep.q_scales[:, hk, wp.rows] * valid[None, :, None])
                kc, ks = prep.k_codes[hk], prep.k_scales[hk]
                vc, vs = prep.v_codes_t[hk], prep.v_scales_t[hk]
            else:
                qc = qs = self.dummy_u8
                kc = ks = self.dummy_u8[0]
                vc = vs = self.dummy_u8
            pass1_warp(
                self.model, qrows, qc, qs, valid, wp.lim, cq,
                prep.khat[hk], kc, ks, prep.vhat_t[hk], vc, vs,
                order, self.slots, F32(cfg.eps), F32(cfg.delta), cfg.tau, self.soft,
                cfg.p_scale == "pow2", cfg.quant_p, self.kf, F32(prep.vg[hk] * self.kf),
                part, m1, l1, hot, traced, tr_tile, tr_hot, *tr_f,
            )
        tiles = np.array([t for t in range(wp.last_tile + 1) if hot[t // 32] >> np.uint32(t % 32) & 1], np.int64)
        m2 = np.full(ROWS, -np.inf, F32)
        l2 = np.zeros(ROWS, F32)
        o2 = np.zeros((ROWS, d), F32)
        q16 = np.where(valid[:, None], prep.q16[hk, wp.rows], 0).astype(F32)
        pass2_warp(
            self.model == EXACT, cfg.p2_accum == "f32", q16, valid, wp.lim,
            prep.sh[hk, wp.rows].astype(F32), prep.qmul, prep.k16[hk], prep.v16_t[hk],
            tiles, self.soft, m2, l2, o2,
        )
        out = merge(m1, l1, part, m2, l2, o2, self.soft)
        visits = None
        if traced:
            visits = np.zeros(nv, tr.VISIT_DTYPE)
            visits["b"], visits["hk"], visits["warp"] = wp.b, wp.hk, wp.w
            visits["visit"] = np.arange(nv)
            visits["tile"], visits["hot"] = tr_tile, tr_hot
            for name, arr in zip(("c", "m", "tl", "la", "lc"), tr_f):
                visits[name] = arr
        return dict(out=out, hot=hot, active=wp.last_tile + 1, nhot=len(tiles), visits=visits,
                    traced=traced, m1=m1, l1=l1, part=part, m2=m2, l2=l2, o2=o2)


_RUNNER: _Runner | None = None


def _run_index(args):
    return _RUNNER.run(args)


def attention(q, k, v, q_offset: int = 0, config: Config | None = None, *, trace=None,
              warps=None, workers: int = 1, progress=None) -> Result:
    """Emulate the APA kernel bit for bit (numerics.md). q [n, H, d] or [B, n, H, d] float16;
    k, v [S, Hkv, d] (or batched). ``trace``: None, "all" or (b, hk, warp) triples. ``warps``: only
    compute these (b, hk, warp) triples (a warp's result depends only on its own rows, §6.2); the
    output rows of other warps are NaN. ``workers``: processes over independent warps (results do
    not depend on it). ``progress``: a callable ``progress(done, total)`` or None."""
    cfg = config or Config()
    qb, kb, vb, squeeze = validate(q, k, v, q_offset)
    want = tr.TraceRequest.of(trace)
    B, n, H, d = qb.shape
    Hkv = kb.shape[2]
    G = H // Hkv
    R, ntiles = n * G, -(-kb.shape[1] // TILE)
    nw = -(-R // ROWS)
    chosen = None if warps is None else {tuple(int(x) for x in t) for t in warps}
    groups = [(b, hk) for b in range(B) for hk in range(Hkv)
              if chosen is None or any(t[0] == b and t[1] == hk for t in chosen)]
    total = nw * len(groups) if chosen is None else len(chosen)

    # One (batch, KV head) at a time: its prep is all a warp reads (§5), so memory stays at one
    # head's share of the dump whatever the number of heads.
    global _RUNNER
    all_warps, results, scales = [], [], {}
    for b, hk in groups:
        heads = slice(hk * G, (hk + 1) * G)
        prep = prepare(qb[b][:, heads], kb[b][:, hk:hk + 1], vb[b][:, hk:hk + 1], int(q_offset), cfg)
        scales[(b, hk)] = (float(prep.kg[0]), float(prep.vg[0]))
        todo = [wp for wp in _warps(prep, b, hk) if chosen is None or (b, hk, wp.w) in chosen]
        _RUNNER = _Runner(prep, cfg, want)
        if workers > 1 and len(todo) > 1:
            with mp.get_context("fork").Pool(min(workers, os.cpu_count() or 1, len(todo))) as pool:
                chunk = max(1, len(todo) // (8 * workers))
                for res in pool.imap(_run_index, todo, chunksize=chunk):
                    results.append(res)
                    if progress:
                        progress(len(results), total)
        else:
            for wp in todo:
                results.append(_RUNNER.run(wp))
                if progress:
                    progress(len(results), total)
        all_warps += todo
        _RUNNER = None
    warps = all_warps

    rows_out = np.full((B, Hkv, nw * ROWS, d), np.nan, np.float16)
    hot = np.zeros((B, Hkv, nw, -(-ntiles // 32)), np.uint32)
    visits, row_recs = [], []
    for wp, res in zip(warps, results):
        rows_out[wp.b, wp.hk, wp.w * ROWS:(wp.w + 1) * ROWS] = res["out"]
        hot[wp.b, wp.hk, wp.w] = res["hot"]
        if res["traced"]:
            visits.append(res["visits"])
            nvalid = int(wp.valid.sum())
            rec = np.zeros(nvalid, tr.row_dtype(d))
            rec["b"], rec["hk"], rec["row"] = wp.b, wp.hk, wp.w * ROWS + np.arange(nvalid)
            for name in ("m1", "l1", "part", "m2", "l2", "o2", "out"):
                rec[name] = res[name][:nvalid]
            row_recs.append(rec)
    out = np.stack([unpack_rows(rows_out[b, :, :R], n, G) for b in range(B)])
    return Result(
        out=out[0] if squeeze else out,
        hot=hot,
        active_tiles=sum(r["active"] for r in results),
        hot_tiles=sum(r["nhot"] for r in results),
        config=cfg,
        visits=np.concatenate(visits) if want is not None and visits else None,
        rows=np.concatenate(row_recs) if want is not None and row_recs else None,
        meta=dict(G=G, R=R, nw=nw, ntiles=ntiles, head_scales=scales),
    )

