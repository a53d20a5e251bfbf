"""A bitwise snapshot of the emulator's results, the guard of a restructure that must change no bit.

    python tools/snapshot.py save BASE.npz      # before the change
    python tools/snapshot.py compare BASE.npz   # after it: exit 1, naming each array that differs

Every toggle of Config flipped alone, the seed preset, and each call feature (window, paging,
varlen, chunked prefill, trace, warps) on small generated problems with sinks, outliers and diffuse
rows, at every head dim. Each Result's out, err_bound, hot masks, tile counts and trace records are
stored by bit pattern, so a NaN compares equal only to the same NaN.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from apa_emu import Config, KVState, attention
from apa_emu.config import CHOICES

FLIPS = dict(quant_q=False, quant_k=False, quant_p=False, quant_v=False, q_terms=1, delta=0.0, tau=0, scale=0.3,
             v_f16=True, fma=True, pad_vote=True, direct_store=True, eps=-1.0)


def inputs(seed, B, n, Hkv, G, d, S, structure):
    """FP16 q [B,n,H,d], k, v [B,S,Hkv,d]: normal, a dominant sink key, outliers or diffuse rows."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((B, n, Hkv * G, d), (B, S, Hkv, d), (B, S, Hkv, d)))
    if structure == "sink":  # key 0 aligned with every query: the other tiles' shares fall below eps
        u = rng.standard_normal(d)
        u /= np.linalg.norm(u)
        q += 3.0 * u
        k[:, 0] += 90.0 * u
    elif structure == "outliers":
        for x in (q, k, v):
            x += rng.standard_normal(x.shape) * 10.0 * (rng.random(x.shape) < 0.01)
    elif structure == "diffuse":
        q *= 0.05
    return tuple(x.astype(np.float16) for x in (q, k, v))


def configs():
    """The default, each toggle flipped alone (every choice of every choice field), the seed preset."""
    yield "default", Config()
    for name, choices in CHOICES.items():
        for c in choices[1:]:
            yield f"{name}={c}", Config(**{name: c})
    for name, value in FLIPS.items():
        yield f"{name}={value}", Config(**{name: value})
    yield "eps=1e9", Config(eps=1e9)
    yield "seed", Config.seed()


def cases():
    """(name, args, kwargs) of every call."""
    q, k, v = inputs(1, 2, 40, 2, 2, 64, 1200, "sink")
    for name, cfg in configs():
        yield f"cfg:{name}", (q, k, v, 1160, cfg), {}
    for d in (128, 256):
        for structure in ("outliers", "sink"):
            q2, k2, v2 = inputs(d, 1, 20, 1, 3, d, 700, structure)
            yield f"d{d}:{structure}", (q2, k2, v2, 680, Config()), {}
            yield f"d{d}:{structure}:seed", (q2, k2, v2, 680, Config.seed()), {}
    yield "window", (q, k, v, 1160, Config()), dict(window=700)
    yield "trace", (q, k, v, 1160, Config(eps=0.02)), dict(trace="all")
    yield "warps", (q, k, v, 1160, Config()), dict(warps=[(1, 0, 2), (0, 1, 0)], trace=[(1, 0, 2)])
    yield "unbatched", (q[0], k[0], v[0], 1160, Config()), {}
    page = 32
    per = -(-1200 // page)
    table = np.arange(2 * per, dtype=np.int32)[::-1].reshape(2, per).copy()
    table[1, 3] = -1
    pool_k = np.zeros((2 * per, page, 2, 64), np.float16)
    pool_v = np.zeros_like(pool_k)
    for b in range(2):
        for x, pool in ((k, pool_k), (v, pool_v)):
            pad = np.concatenate([x[b], np.zeros((per * page - 1200, 2, 64), np.float16)])
            pool[table[b].clip(0)] = np.where((table[b] >= 0)[:, None, None, None], pad.reshape(per, page, 2, 64),
                                              pool[table[b].clip(0)])
    yield "paged", (q, pool_k, pool_v, 1160, Config()), dict(block_table=table, seqlen_k=1200)
    cq, ck = np.array([0, 17, 40]), np.array([0, 520, 1200])
    qv, kv_, vv = (x.reshape(-1, *x.shape[2:]) for x in (q[:, :20], k[:, :600], v[:, :600]))
    yield "varlen", (qv, kv_, vv, 0, Config()), dict(cu_seqlens_q=cq, cu_seqlens_k=ck, trace="all", window=400)


def run_chunked(q, k, v, cfg):
    """Chunked prefill (§5.9) in three chunks; the results of each chunk."""
    state, res, bounds = KVState(), [], (0, 96, 160, 300)
    for a, b in zip(bounds, bounds[1:]):
        res.append(attention(q[:, a:b], k[:, :b], v[:, :b], a, cfg, kv_state=state))
    return res


def results():
    for name, args, kwargs in cases():
        yield name, attention(*args, **kwargs)
    q, k, v = inputs(7, 1, 300, 1, 2, 64, 300, "sink")
    for cfg_name, cfg in (("default", Config()), ("sampled", Config(k_stats="sampled"))):
        for i, r in enumerate(run_chunked(q, k, v, cfg)):
            yield f"chunked:{cfg_name}:{i}", r


def arrays(res) -> dict[str, np.ndarray]:
    fields = dict(out=res.out, err_bound=res.err_bound, hot=res.hot,
                  tiles=np.array([res.active_tiles, res.hot_tiles], np.int64))
    for name in ("visits", "rows"):
        recs = getattr(res, name)
        if recs is not None:
            fields[name] = np.frombuffer(np.ascontiguousarray(recs).tobytes(), np.uint8)
    return {k: np.ascontiguousarray(x).view(np.uint8) for k, x in fields.items()}


def collect(progress=True) -> dict[str, np.ndarray]:
    snap = {}
    for name, res in results():
        for field, x in arrays(res).items():
            snap[f"{name}/{field}"] = x
        if progress:
            print(f"  {name}", file=sys.stderr, flush=True)
    return snap


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("save", "compare"))
    ap.add_argument("path", type=Path)
    a = ap.parse_args(argv)
    if a.action == "save" and a.path.exists():
        ap.error(f"{a.path} exists; remove it or choose another path")
    snap = collect()
    if a.action == "save":
        np.savez_compressed(a.path, **snap)
        print(f"saved {len(snap)} arrays to {a.path}")
        return 0
    with np.load(a.path) as base:
        names = sorted(set(base.files) | set(snap))
        bad = [n for n in names if n not in base.files or n not in snap or not np.array_equal(base[n], snap[n])]
    for n in bad:
        print(f"DIFF {n}")
    print(f"{len(names) - len(bad)} of {len(names)} arrays bitwise equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
