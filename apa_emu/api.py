"""The emulator's entry point: resolve the call (apa_emu/call.py), then run prep, pass 1, pass 2 and the
merge warp by warp."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from . import trace as tr
from . import arrays, kvstate, varlen
from .call import Call, logical_kv, resolve_call, resolve_config
from .kvstate import KVState
from .config import Config
from .constants import EXACT, SM120, Flags
from .geometry import ROWS, TILE, Shape, WarpRows, visit_order
from .merge import budget_beta, certificate, estimate, merge_y
from .pass1 import FP4Operands, P1Mode, P1Operands, P1Out, P1Rows, pass1_warp
from .pass2 import P2Mode, P2Out, P2Rows, pass2_warp
from .fpmath import ex2_tables
from .prep import Prepared, call_stats, prep_bytes, prepare_lowered, slot_map, unpack_rows
from .result import Result, like_input, run_checked

F32 = np.float32


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none): what a call, or ``apa synth``, may
    allocate without swapping or meeting the OOM killer."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(shape: Shape) -> None:
    """Refuse up front, naming the need, a call whose prep of one KV head cannot fit in memory."""
    need, have = prep_bytes(shape.S, shape.d), available_bytes()
    if have is not None and need > have:
        raise MemoryError(f"apa_emu: prep of one KV head of {shape.S} keys (d = {shape.d}) needs about "
                          f"{need / 2**30:.1f} GiB; {have / 2**30:.1f} GiB of memory is available")


@dataclass
class WarpResult:
    """What one warp computed: its output rows, hot mask and counts, the §7.10 and §8.6 states
    (for the trace) and, when traced, its visit and row records."""

    w: int
    out: np.ndarray  # [16, d] f16
    err_bound: np.ndarray  # [16] f32 (§9.7)
    err_est: np.ndarray  # [16] f32 (§9.8)
    active: int  # T_w − F_w + 1 (§6.3)
    nhot: int
    p1: P1Out
    p2: P2Out
    visits: np.ndarray | None = None
    rows: np.ndarray | None = None


def _hot_tiles(hot_words: np.ndarray, last_tile: int) -> np.ndarray:
    """The hot tiles of a mask in ascending order, the order pass 2 visits them (§8)."""
    t = np.arange(last_tile + 1)
    return t[(hot_words[t // 32] >> (t % 32).astype(np.uint32)) & 1 == 1].astype(np.int64)


class HeadRunner:
    """Runs the warps of one (batch, KV head) of a call, one ``run(w)`` each: pass 1, pass 2, the merge
    and the error estimates (§7–9). ``prep``: that head's prep (§5), alone at index 0, as
    ``prepare_lowered`` forms it; ``flags``: the call's toggles, lowered once (Config.flags), which are
    all it reads of the config besides the numeric constants it takes from ``cfg``. Used alone, it
    lets a benchmark time the passes apart from the prep (tools/bench_emu.py) and a test replay a
    warp's visits (``p1_inputs``)."""

    def __init__(self, shape: Shape, b: int, hk: int, prep: Prepared, cfg: Config, flags: Flags,
                 want: tr.TraceRequest | None = None):
        self.shape, self.b, self.hk, self.prep, self.flags, self.want = shape, b, hk, prep, flags, want
        self.soft = flags.model.soft
        self.consts = cfg.pass1_consts()
        ex2, ex2_f16 = ex2_tables(self.soft)
        self.mode = flags.pass1.lower(P1Mode, flags.model, slots=slot_map(flags.pass1.interleaved).astype(np.int64),
                                      vk=F32(prep.vg[0] * self.consts.Kf), vg=prep.vg[0], ex2=ex2, ex2_f16=ex2_f16)
        self.p2_mode = flags.pass2.lower(P2Mode, flags.model, exact=flags.model.model == EXACT, qmul=prep.qmul,
                                         ex2=ex2)
        self.cert = cfg.cert_consts(prep.d)
        self.est = cfg.est_consts(prep.d)

    def _rows(self, x: np.ndarray, wr: WarpRows, pad) -> np.ndarray:
        """The warp's rows of a per-row prep array, ``pad`` in padding rows (numerics.md §6.2)."""
        sel = x[0, wr.rows]
        valid = wr.valid.reshape((-1,) + (1,) * (sel.ndim - 1))
        return np.where(valid, sel, pad).astype(x.dtype)

    def _p1_rows(self, x: np.ndarray, wr: WarpRows, pad) -> np.ndarray:
        """A per-row prep array as pass 1 reads it: under ``pad_vote`` a padding row holds row R − 1's
        (§6.2; ``wr.rows`` is clamped there), else ``pad``."""
        return np.ascontiguousarray(x[0, wr.rows]) if self.flags.pass1.pad_vote else self._rows(x, wr, pad)

    def _fp4(self, wr: WarpRows) -> FP4Operands:
        p = self.prep
        if self.mode.model != SM120:
            return FP4Operands.unused()
        codes, scales = (np.moveaxis(self._p1_rows(np.moveaxis(x, 0, 2), wr, 0), 1, 0) for x in (p.q_codes, p.q_scales))
        return FP4Operands(np.ascontiguousarray(codes), np.ascontiguousarray(scales),
                           p.k_codes[0], p.k_scales[0], p.v_codes_t[0], p.v_scales_t[0])

    def _pass1(self, wr: WarpRows, traced: bool) -> tuple[P1Out, tr.VisitTrace]:
        p = self.prep
        out = P1Out.new(p.d, self.shape.ntiles)
        if self.flags.pass2.all_hot:  # §9.6: every active tile is hot, pass 1 does not run
            for t in range(wr.first_tile, wr.last_tile + 1):
                out.hot_words[t // 32] |= np.uint32(1 << (t % 32))
            return out, tr.visit_trace(0)
        ops, rows, order = self.p1_inputs(wr)
        trace = tr.visit_trace(order.shape[0] if traced else 0)
        pass1_warp(ops, rows, self.mode, self.consts, order, traced, trace, out)
        return out, trace

    def p1_inputs(self, wr: WarpRows) -> tuple[P1Operands, P1Rows, np.ndarray]:
        """What ``pass1_warp`` reads of warp ``wr`` besides the mode and constants: its operands, rows
        and visiting order (§6.4). Tests replay single visits from them."""
        p, pad_vote = self.prep, self.flags.pass1.pad_vote
        order = visit_order(wr.first_tile, wr.last_tile, self.flags.pass1.ascending)
        nu = p.nu_t[0] if self.mode.output else np.zeros((1, TILE), F32)
        ops = P1Operands(self._p1_rows(p.qhat, wr, 0), p.khat[0], p.vhat_t[0], nu, self._fp4(wr))
        cq = self._p1_rows(p.cq, wr, 1)
        beta = np.zeros(ROWS, F32)
        if self.mode.budget:  # §7.7: padding rows that vote read qstat's +0 and the c_q pass 1 has
            qstat = self._rows(p.qstat, wr, 0)
            beta = budget_beta(self.consts.eps, cq, qstat[:, 0], qstat[:, 1], p.kvstat[0], self.est.rho, p.d)
        if pad_vote:  # §6.2: padding rows run with their own unclamped key ranges
            r = np.arange(wr.w * ROWS, (wr.w + 1) * ROWS)
            rows = P1Rows(wr.valid, np.ones(ROWS, bool), self.shape.lim(r), self.shape.lo(r), cq, beta)
        else:
            rows = P1Rows(wr.valid, wr.valid, wr.lim, wr.lo, cq, beta)
        return ops, rows, order

    def _pass2(self, wr: WarpRows, tiles: np.ndarray) -> P2Out:
        p = self.prep
        out = P2Out.new(p.d)
        pass2_warp(self.p2_mode, P2Rows(wr.valid, wr.lim, wr.lo, p.sh[0, wr.rows]), self._rows(p.q16, wr, 0), p.k16[0],
                   p.v16_t[0], tiles, out)
        return out

    def _visit_records(self, w: int, trace: tr.VisitTrace) -> np.ndarray:
        nv = trace.tile.shape[0]
        rec = np.zeros(nv, tr.VISIT_DTYPE)
        rec["b"], rec["hk"], rec["warp"], rec["visit"] = self.b, self.hk, w, np.arange(nv)
        for name in tr.VISIT_FIELDS:
            rec[name] = getattr(trace, name)
        return rec

    def _row_records(self, res: WarpResult, wr: WarpRows) -> np.ndarray:
        nvalid = int(wr.valid.sum())
        rec = np.zeros(nvalid, tr.row_dtype(self.prep.d))
        rec["b"], rec["hk"], rec["row"] = self.b, self.hk, wr.w * ROWS + np.arange(nvalid)
        state = {**res.p1._asdict(), **res.p2._asdict(), "out": res.out, "err_bound": res.err_bound,
                 "err_est": res.err_est}
        for name in tr.ROW_FIELDS:
            rec[name] = state[name][:nvalid]
        return rec

    def run(self, w: int) -> WarpResult:
        wr = self.shape.warp_rows(w)
        traced = self.want is not None and self.want.wants(self.b, self.hk, w)
        p1, trace = self._pass1(wr, traced)
        tiles = _hot_tiles(p1.hot_words, wr.last_tile)
        p2 = self._pass2(wr, tiles)
        if self.mode.direct and not len(tiles):  # §9.5: the seed's direct store
            y = p1.part
        else:
            y = merge_y(p1.m1, p1.l1, p1.part, p2.m2, p2.l2, p2.o2, self.soft, self.flags.pass2.fma)
        out = y.astype(np.float16)
        p = self.prep
        cq, qstat = self._rows(p.cq, wr, 1), self._rows(p.qstat, wr, 0)
        bound = certificate(p1.m1, p1.l1, p1.ad1, p2.m2, p2.l2, out, wr.lo, wr.lim, len(tiles), cq, qstat,
                            p.kvstat[0], p.qmul, self.cert, self.soft)
        est = estimate(p1.m1, p1.l1, p1.ws1, p2.m2, p2.l2, p2.p2, p2.o2, y, out, len(tiles), cq, qstat, p.kvstat[0],
                       self._rows(p.sh, wr, 0), self.est, self.soft)
        res = WarpResult(w, out, *(np.where(wr.valid, x, F32(0)).astype(F32) for x in (bound, est)),
                         wr.last_tile - wr.first_tile + 1, len(tiles), p1, p2)
        if traced:
            res.visits, res.rows = self._visit_records(w, trace), self._row_records(res, wr)
        return res


# Set in each worker process by the pool's initializer; with fork, the runner is inherited, not pickled.
_WORKER_RUNNER: HeadRunner | None = None


def _init_worker(runner: HeadRunner) -> None:
    global _WORKER_RUNNER
    _WORKER_RUNNER = runner
    # Ctrl-C goes to the parent alone, which then ends the pool: no worker prints a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def worker_pool(method: str, n: int, initializer, initargs=()):
    """A process pool that Ctrl-C cannot split: ``Pool()`` cleans up the workers it has started only
    on an Exception, so a KeyboardInterrupt inside it, or between a fork and the child's registration,
    leaves a worker that nothing ends and that holds the terminal's pipes open after the parent exits.
    SIGINT stays pending until the pool exists and the ``with`` holds it; its exit then ends every
    worker (who inherit the mask, and ignore SIGINT anyway)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with mp.get_context(method).Pool(n, initializer=initializer, initargs=initargs) as pool:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            yield pool
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _run_in_worker(w: int) -> WarpResult:
    return _WORKER_RUNNER.run(w)


def attention(q, k, v, q_offset: int = 0, config: Config | None = None, *, window: int | None = None,
              block_table=None, seqlen_k: int | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
              kv_state: KVState | None = None, trace=None, warps=None, workers: int = 1, progress=None) -> Result:
    """Emulate the APA kernel bit for bit (numerics.md).

    Parameters
    ----------
    q : float16 [n, H, d] or [B, n, H, d], a NumPy array or any host array that speaks DLPack (a CPU
        torch tensor, a JAX array), read without a copy; a tensor that requires grad is detached
        (inference only). The emulator runs on the host: an array on a device (a CUDA tensor, a CuPy
        array) is refused in one line; pass ``x.cpu()``, or call ``apa_gpu.attention``.
    k, v : float16 [S, Hkv, d] or [B, S, Hkv, d], of the kinds q may be; H must be a multiple of Hkv, d one
        of 64, 128, 256.
    q_offset : causal position of query row 0 (bottom-right causal: q_offset = S − n).
    config : the numerics toggles (default ``Config()``).
    window : a sliding window of W keys: query position p sees keys max(0, p − W + 1) .. p (§6.1);
        None is full causal.
    block_table : int [B, max_pages] (or [max_pages]) for paged KV (§5.0): k and v are then page pools
        [pages, page_size, Hkv, d]; key s of batch b is row s % page_size of page
        block_table[b, s // page_size], and -1 (a hole) reads as zeros.
    seqlen_k : keys per sequence with a block table (default max_pages · page_size).
    cu_seqlens_q, cu_seqlens_k : int [B + 1] for a varlen batch (§6.6): q [total_q, H, d] and k, v
        [total_k, Hkv, d] pack B sequences, each its own bottom-right causal problem (q_offset 0 here).
        Hot masks are padded to the longest sequence's; trace records carry b = the sequence.
    kv_state : a KVState for chunked prefill (§5.9): this call is one chunk of n query rows, k and v the
        context so far with the chunk's keys last (q_offset = the state's length); the call restats or
        reuses the state's statistics as the spec says, and updates the state.
    trace : None, "all" or (b, hk, warp) triples: per-visit and per-row records (§10).
    warps : only compute these (b, hk, warp) triples (a warp's result depends only on its own rows,
        §6.2); the output rows of other warps are NaN.
    workers : processes over independent warps (results do not depend on it).
    progress : a callable ``progress(done, total)`` or None.

    Returns
    -------
    Result, with ``out`` shaped like q; its arrays of q's kind (a torch tensor in: torch tensors out,
    sharing the emulator's memory), except §10's records (visits, rows), which stay NumPy.
    """
    arrays.require_host(q=q, k=k, v=v)
    call = resolve_call(q, k, v, q_offset, window=window, block_table=block_table, seqlen_k=seqlen_k,
                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, kv_state=kv_state, trace=trace,
                        warps=warps)
    cfg = resolve_config(config)
    res = run_checked(call, lambda c: run(c, cfg, workers=workers, progress=progress if c is call else None))
    return like_input(res, q)


def run(call: Call, cfg: Config, *, workers: int = 1, progress=None) -> Result:
    """The emulator's Result of a resolved call: a varlen call sequence by sequence (§6.6), packed."""
    workers = _check_count("workers", workers)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress: expected a callable progress(done, total) or None, got {progress!r}")
    if call.seqs is not None:
        parts = [None if sub is None else run(sub, cfg, workers=workers, progress=progress)
                 for sub in call.sequences()]
        return varlen.pack(parts, call.q[0], call.seqs.cq)
    shape = call.shape
    kb, vb = logical_kv(call)
    _check_memory(shape)
    frozen = None if call.kv_state is None else kvstate.begin(call.kv_state, kb, vb, shape.n, shape.q_offset)
    if frozen is None and cfg.k_stats == "sampled":
        frozen = call_stats(kb, vb, cfg.v_f16)  # §5.10: its overflow redo is one decision for the call
    results, stats = _run_heads(call, cfg, kb, vb, frozen, workers, progress)
    if call.kv_state is not None:
        kvstate.finish(call.kv_state, kb, kvstate.Stats(*(np.array([[stats[b, hk][i] for hk in range(shape.Hkv)]
                                                                     for b in range(shape.B)]) for i in range(3))))
    return _assemble(call, cfg, results, stats)


def _run_heads(call: Call, cfg: Config, kb, vb, frozen, workers: int, progress):
    """One (batch, KV head) at a time: its prep is all a warp reads (§5), so memory stays at one
    head's share of the input whatever the number of heads. Returns the warps' results and each
    head's (kmean, kg, vg)."""
    shape, chosen, qb = call.shape, call.warps, call.q
    G = shape.G
    groups = [(b, hk) for b in range(shape.B) for hk in range(shape.Hkv)
              if chosen is None or any(t[:2] == (b, hk) for t in chosen)]
    total = shape.nw * len(groups) if chosen is None else len(chosen)
    results: list[tuple[int, int, WarpResult]] = []
    stats = {}
    flags, qmul = cfg.flags(), cfg.qmul(shape.d)  # the call's toggles, lowered once for all its heads
    for b, hk in groups:
        heads = slice(hk * G, (hk + 1) * G)
        prep = prepare_lowered(qb[b][:, heads], kb[b][:, hk:hk + 1], vb[b][:, hk:hk + 1], shape.q_offset, flags,
                               qmul, first_key=int(shape.lo(0)),
                               stats=None if frozen is None else tuple(x[b, hk:hk + 1] for x in frozen))
        stats[b, hk] = prep.kmean[0], prep.kg[0], prep.vg[0]
        todo = [w for w in range(shape.nw) if chosen is None or (b, hk, w) in chosen]
        runner = HeadRunner(shape, b, hk, prep, cfg, flags, call.want)
        for res in _run_warps(runner, todo, workers):
            results.append((b, hk, res))
            if progress:
                progress(len(results), total)
    return results, stats


def _run_warps(runner: HeadRunner, todo: list[int], workers: int):
    """The warps' results in order, over ``workers`` processes when there are several warps."""
    if workers > 1 and len(todo) > 1:
        n_proc = min(workers, os.cpu_count() or 1, len(todo))
        with worker_pool("fork", n_proc, _init_worker, (runner,)) as pool:
            yield from pool.imap(_run_in_worker, todo, chunksize=max(1, len(todo) // (8 * workers)))
    else:
        for w in todo:
            yield runner.run(w)


def _assemble(call: Call, cfg: Config, results, stats) -> Result:
    """The warps' rows unpacked into q's layout (§6.2), their hot masks, counts and trace records."""
    shape, want = call.shape, call.want
    B, n, d, G, nw = shape.B, shape.n, shape.d, shape.G, shape.nw
    rows_out = np.full((B, shape.Hkv, shape.Rp, d), np.nan, np.float16)
    rows_bound = np.full((B, shape.Hkv, shape.Rp, 2), np.nan, F32)
    hot = np.zeros((B, shape.Hkv, nw, shape.W), np.uint32)
    for b, hk, res in results:
        rows_out[b, hk, res.w * ROWS:(res.w + 1) * ROWS] = res.out
        rows_bound[b, hk, res.w * ROWS:(res.w + 1) * ROWS] = np.stack([res.err_bound, res.err_est], axis=1)
        hot[b, hk, res.w] = res.p1.hot_words
    out = np.stack([unpack_rows(rows_out[b, :, :shape.R], n, G) for b in range(B)])
    bound, est = (np.stack([unpack_rows(rows_bound[b, :, :shape.R], n, G)[..., i] for b in range(B)]) for i in range(2))
    visits = [res.visits for _, _, res in results if res.visits is not None]
    row_recs = [res.rows for _, _, res in results if res.rows is not None]
    return Result(
        out=out[0] if call.squeeze else out,
        err_bound=bound[0] if call.squeeze else bound,
        err_est=est[0] if call.squeeze else est,
        hot=hot,
        active_tiles=sum(res.active for _, _, res in results),
        hot_tiles=sum(res.nhot for _, _, res in results),
        config=cfg,
        visits=np.concatenate(visits) if want is not None and visits else None,
        rows=np.concatenate(row_recs) if want is not None and row_recs else None,
        meta=dict(G=G, R=shape.R, nw=nw, ntiles=shape.ntiles,
                  head_scales={bh: (float(x[1]), float(x[2])) for bh, x in stats.items()}),
    )
