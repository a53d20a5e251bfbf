"""Generated kernel-vs-emulator problems: shapes (batch, GQA ratio, head dim, rows, keys, query offset),
input structure (normal, sink, diffuse, outliers, channel offsets, tiny/subnormal, FP16 range edges)
and the config toggles the kernel implements. Hypothesis strategies, shared by the tests and
``apa check --hypothesis`` (Hypothesis is a test extra: no module of the library imports this one but
``apa check``, and that only when asked to generate). An engine's own options have strategies of
its own (apa_gpu/strategies.py).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .config import Config
from .geometry import HEAD_DIMS

STRUCTURES = ("normal", "sink", "diffuse", "outliers", "channel", "tiny", "extreme")


def make_inputs(seed, B, n, Hkv, G, d, S, structure, batched=True):
    """FP16 q [B,n,H,d], k, v [B,S,Hkv,d] (no batch axis when not batched) of a given structure."""
    rng = np.random.default_rng(seed)
    H = Hkv * G
    q = rng.standard_normal((B, n, H, d))
    k = rng.standard_normal((B, S, Hkv, d))
    v = rng.standard_normal((B, S, Hkv, d))
    if structure == "sink":
        # key 0 (and sometimes a second key) aligned with every query: a dominant sink
        dirn = rng.standard_normal(d)
        dirn /= np.linalg.norm(dirn)
        q += 3.0 * dirn
        k[:, 0] += rng.uniform(4, 40) * dirn
        if S > 100:
            k[:, rng.integers(1, S)] += 8.0 * dirn
    elif structure == "diffuse":
        q *= 0.02
    elif structure == "outliers":
        for x in (q, k, v):
            x += rng.standard_normal(x.shape) * 10.0 * (rng.random(x.shape) < 0.002)
    elif structure == "channel":
        k += rng.standard_normal((1, 1, Hkv, d)) * rng.uniform(2, 200)
        q *= rng.uniform(0.05, 2)
    elif structure == "tiny":
        scale = 2.0 ** rng.integers(-30, -14)
        q *= scale * 2**10
        k *= scale
        v *= scale
    elif structure == "extreme":
        # magnitudes up to the top of FP16, finite; some rows and keys at the range edge
        amp = float(rng.choice([1e2, 3e3, 6e4]))
        q = np.clip(q * amp / 4, -65504, 65504)
        k = np.clip(k * amp / 4, -65504, 65504)
        v = np.clip(v * amp / 4, -65504, 65504)
        k[:, rng.integers(0, S)] = 65504.0 * np.sign(rng.standard_normal(d))
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    if not batched:
        q, k, v = q[0], k[0], v[0]
    return q, k, v


def paginate(k, v, page_size, seed):
    """k, v [S, Hkv, d] or [B, S, Hkv, d] as page pools [pages, page_size, Hkv, d] with a block table
    (numerics.md §5.0): every sequence's pages shuffled into one pool with two spare pages, and, for
    odd seeds, a random page of the first sequence a hole (its keys and values then read as zeros)."""
    rng = np.random.default_rng(seed)
    kb, vb = (x[None] if x.ndim == 3 else x for x in (k, v))
    B, S = kb.shape[:2]
    per = -(-S // page_size)
    pages = B * per + 2
    order = rng.permutation(pages)
    table = order[: B * per].reshape(B, per).astype(np.int32)
    pool_k = rng.standard_normal((pages, page_size, *kb.shape[2:])).astype(np.float16)  # spare pages: noise
    pool_v = rng.standard_normal(pool_k.shape).astype(np.float16)
    pad = per * page_size - S
    for b in range(B):
        for x, pool in ((kb, pool_k), (vb, pool_v)):
            rows = np.concatenate([x[b], np.zeros((pad, *x.shape[2:]), np.float16)])
            pool[table[b]] = rows.reshape(per, page_size, *x.shape[2:])
    if seed % 2:
        table[0, rng.integers(per)] = -1
    return pool_k, pool_v, table if k.ndim == 4 else table[0]


@st.composite
def problems(draw, dims=HEAD_DIMS):
    """A problem's shape and structure, of head dim one of ``dims`` (an engine's ``head_dims``)."""
    d = draw(st.sampled_from(dims))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 3, 4, 6]))
    batched = draw(st.booleans())
    B = draw(st.integers(1, 2)) if batched else 1
    n = draw(st.integers(1, 90))
    S = draw(st.integers(1, 330))
    off_mode = draw(st.sampled_from(["prefill", "zero", "random"]))
    if off_mode == "prefill":
        q_offset = max(0, S - n)
    elif off_mode == "zero":
        q_offset = 0
    else:
        q_offset = draw(st.integers(0, S + 80))
    structure = draw(st.sampled_from(STRUCTURES))
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(seed=seed, B=B, n=n, Hkv=Hkv, G=G, d=d, S=S, structure=structure, batched=batched), q_offset


@st.composite
def configs(draw):
    return Config(
        eps=draw(st.sampled_from([0.005, 0.005, 0.0, 0.02, 1e-4, 0.3, 1e9, -1.0])),
        quant_q=draw(st.booleans() | st.just(True)),
        quant_k=draw(st.booleans() | st.just(True)),
        quant_p=draw(st.booleans() | st.just(True)),
        quant_v=draw(st.booleans() | st.just(True)),
        q_format=draw(st.sampled_from(["nvfp4", "nvfp4", "fp8"])),
        q_terms=draw(st.sampled_from([2, 2, 1])),
        p_scale=draw(st.sampled_from(["ue4m3", "ue4m3", "pow2"])),
        block_scale=draw(st.sampled_from(["lsq", "lsq", "nearest"])),
        tile_order=draw(st.sampled_from(["diagonal", "diagonal", "ascending"])),
        delta=draw(st.sampled_from([32.0, 32.0, 0.0, 8.0, 1.5])),
        tau=draw(st.integers(0, 8) | st.just(4)),
        p2_accum=draw(st.sampled_from(["f16", "f16", "f32"])),
        p_groups=draw(st.sampled_from(["consecutive", "consecutive", "interleaved"])),
        scale=draw(st.sampled_from([None, None, None, 0.3, 1.0])),
        hot_test=draw(st.sampled_from(["mass", "mass", "output"])),
        v_f16=draw(st.booleans()),
        fma=draw(st.booleans()),
        p2_shift=draw(st.sampled_from(["sequential", "sequential", "lanes"])),
        pad_vote=draw(st.booleans()),
        direct_store=draw(st.booleans()),
    )



FP16_SAFE = 65504.0  # §8.7: pass 2's FP16 scores cannot overflow while ‖q‖·‖k‖ stays below it


@st.composite
def large_logits(draw, dims=(64, 128)):
    """(q, k, v, q_offset, config) with logits far past the usual: q and k scaled up to 30× and a
    softmax scale up to 10³, under ε that makes every tile hot, every tile cold, or some of each, so
    that pass 1's FP4 frame lands far above or below pass 2's exact one (§9.1). Only problems inside
    §8.7's range (max ‖q‖ · max ‖k‖ < 65504) are drawn."""
    d = draw(st.sampled_from(dims))
    n = draw(st.integers(1, 40))
    S = n + draw(st.integers(0, 1200))
    q, k, v = make_inputs(draw(st.integers(0, 2**32 - 1)), 1, n, 1, draw(st.sampled_from([1, 2])), d, S,
                          draw(st.sampled_from(["normal", "sink", "diffuse"])), batched=False)
    gain = draw(st.sampled_from([1.0, 2.0, 4.0, 12.0, 30.0]))
    q, k = ((x.astype(np.float64) * gain).clip(-65504, 65504).astype(np.float16) for x in (q, k))
    norm = lambda x: float(np.linalg.norm(x.astype(np.float64), axis=-1).max())  # noqa: E731
    if norm(q) * norm(k) >= FP16_SAFE:
        q = (q.astype(np.float64) * (FP16_SAFE / 2 / (norm(q) * norm(k)))).astype(np.float16)
    cfg = Config(eps=draw(st.sampled_from([0.005, 0.02, 1e-4, 0.0, -1.0, 1e9])),
                 scale=draw(st.sampled_from([None, None, 1.0, 10.0, 100.0, 1000.0])))
    return q, k, v, S - n, cfg
