"""Chunked prefill against whole-prompt prefill on a dump (numerics.md §5.9, ``apa chunked``).

A dump holds the last n query rows of a prompt of S keys. The whole-prompt run is the dump's call;
the chunked run feeds the same rows in chunks of C through a KVState, each chunk with the keys up to
its last row, so that later chunks quantize with the first chunk's statistics until the context
outgrows them (1.125×) or a new key overflows. Both are compared pair by pair with float64
attention, on the study engine (the emulator or the kernel); the reference is computed once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from apa_emu.call import resolve_call
from apa_emu.config import Config
from apa_emu.engines import Engine
from apa_emu.kvstate import KVState

from . import fp64
from .engine import metrics, reference
from .scan import cos_stats


@dataclass
class Side:
    """One way of running the dump: its hot share, per-pair cosines, which pairs are finite, and
    certificate violations."""

    hot_tiles: int = 0
    active_tiles: int = 0
    cos: list | None = None
    finite: list | None = None
    violations: int = 0

    @property
    def hot_share(self) -> float:
        return self.hot_tiles / self.active_tiles if self.active_tiles else 0.0

    def summary(self) -> dict:
        """The cosines' statistics over the finite pairs, as ``apa scan`` takes them (a non-finite
        output has no cosine: counted as 0 it would pass for a wrong answer), and how many are not."""
        cos = np.where(np.concatenate(self.finite), np.concatenate(self.cos), np.nan)
        stats = cos_stats(cos)
        return dict(hot_share=self.hot_share, **{k: stats[k] for k in ("mean_cos", "min_cos", "below_0_999",
                                                                       "nonfinite")}, violations=self.violations)


@dataclass
class ChunkedReport:
    chunk: int
    chunks: int
    restats: int
    reasons: list  # per KV head, the restat reason of each chunk ("" = frozen)
    whole: dict
    chunked: dict

    def to_json(self) -> dict:
        return asdict(self)


def _run(engine: Engine, q, k, v, q_offset: int, cfg: Config, kv_state=None):
    return engine.run(resolve_call(q, k, v, q_offset, kv_state=kv_state), cfg)


def chunked_study(dump, cfg: Config, chunk: int, engine: Engine, progress=None) -> ChunkedReport:
    """Whole-prompt and chunked prefill of every pair of ``dump``, chunks of ``chunk`` query rows."""
    n, G, off = dump.n, dump.group, dump.q_offset
    scale = float(cfg.softmax_scale(dump.hd))
    rows, heads = np.repeat(np.arange(n), G), np.tile(np.arange(G), n)
    sides = {"whole": Side(cos=[], finite=[]), "chunked": Side(cos=[], finite=[])}
    starts = list(range(0, n, chunk))
    reasons, restats = [], 0
    steps, done = dump.nkv * (len(starts) + 1), 0
    for hk in range(dump.nkv):
        q = engine.put(dump.q[:, hk * G:(hk + 1) * G])
        k, v = engine.put(dump.k[:, hk:hk + 1]), engine.put(dump.v[:, hk:hk + 1])
        ref = reference(engine, q, k, v, off, rows, heads, scale)
        whole = _run(engine, q, k, v, off, cfg)
        done += 1
        if progress:
            progress(done, steps)
        state, parts = KVState(), []
        for a in starts:
            b = min(n, a + chunk)
            parts.append(_run(engine, q[a:b], k[:off + b], v[:off + b], off + a, cfg, kv_state=state))
            done += 1
            if progress:
                progress(done, steps)
        reasons.append([r for _, r in state.history])
        restats += state.restats
        for side, results in (("whole", [whole]), ("chunked", parts)):
            out = np.concatenate([r.out for r in results])
            bound = np.concatenate([r.err_bound for r in results])
            sums = metrics(engine, out[rows, heads], ref.out)
            s = sides[side]
            s.cos.append(fp64.cos_rel(sums)[0])
            s.finite.append(np.isfinite(out[rows, heads].astype(np.float32)).all(axis=-1))
            s.violations += int((np.sqrt(sums.diff_sq) > bound[rows, heads]).sum())
            s.hot_tiles += sum(r.hot_tiles for r in results)
            s.active_tiles += sum(r.active_tiles for r in results)
        engine.release()
    return ChunkedReport(chunk, len(starts), restats, reasons, sides["whole"].summary(), sides["chunked"].summary())
