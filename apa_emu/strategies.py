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
from .problems import STRUCTURES, Problem, make_inputs, paginate  # noqa: F401  (re-exported: the strategies' inputs)


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


def _some_of(values, allowed, empty: bool) -> bool:
    """Whether ``values`` is a collection (not a string) of ``allowed`` items, non-empty unless ``empty``."""
    try:
        chosen = set(values) if not isinstance(values, (str, bytes)) else None
    except TypeError:
        return False
    return chosen is not None and (empty or bool(chosen)) and chosen <= set(allowed)


def engine_problems(features=frozenset(), dims=HEAD_DIMS, seen=None):
    """``_engine_problems`` of ``features`` (some of apa_emu.engines.FEATURES) and ``dims`` (some of
    HEAD_DIMS), each checked now: a ValueError naming the argument, not an error at the first draw."""
    from .engines import FEATURES

    if not _some_of(features, FEATURES, empty=True):
        raise ValueError(f"problems: features={features!r}: expected a set of {', '.join(sorted(FEATURES))}")
    if not _some_of(dims, HEAD_DIMS, empty=False):
        raise ValueError(f"problems: dims={dims!r}: expected some of {HEAD_DIMS}")
    if seen is not None and not hasattr(seen, "update"):
        raise ValueError(f"problems: seen={seen!r}: expected a Seen (a Counter) or None")
    return _engine_problems(frozenset(features), tuple(dims), seen)


@st.composite
def _engine_problems(draw, features, dims, seen):
    """A ``Problem`` (apa_emu.problems) an engine implementing ``features`` (apa_emu.engines.FEATURES)
    and head dims ``dims`` can run: ``problems()``, with a window, paged keys or a varlen batch where
    the engine honours them. ``seen``, a Counter (apa_emu.testing.Seen), counts what was drawn: the
    structure, GQA, a batch, d = 256, a window, pages, varlen."""
    shape, q_offset = draw(problems(dims))
    kind = draw(st.sampled_from(["dense", *sorted({"window", "paging", "varlen"} & set(features))]))
    problem = Problem(**shape, q_offset=q_offset)
    if kind == "window":
        last = q_offset + shape["n"] - 1
        least = max(1, last - shape["S"] + 2)  # every row keeps a key (§6.1)
        problem = Problem(**shape, q_offset=q_offset, window=draw(st.integers(least, least + 200)))
    elif kind == "paging":
        problem = Problem(**shape, q_offset=q_offset, page_size=draw(st.sampled_from([1, 5, 16, 48, 64, 256])))
    elif kind == "varlen":
        seqs = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 150)), min_size=1, max_size=3))
        seqlens = tuple((n, n + extra) for n, extra in seqs)  # bottom-right causal: keys >= rows
        problem = Problem(**{**shape, "B": 1, "batched": False, "n": max(n for n, _ in seqlens),
                             "S": max(S for _, S in seqlens)}, seqlens=seqlens)
    if seen is not None:
        seen[f"structure={problem.structure}"] += 1
        seen.update(event for event, happened in (("GQA", problem.G > 1), ("batch", problem.B > 1),
                                                  ("d=256", problem.d == 256), (kind, kind != "dense"))
                    if happened)
    return problem


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
        p2_scores=draw(st.sampled_from(["f16", "f16", "f32"])),
        p_groups=draw(st.sampled_from(["consecutive", "consecutive", "interleaved"])),
        scale=draw(st.sampled_from([None, None, None, 0.3, 1.0])),
        hot_test=draw(st.sampled_from(["mass", "mass", "output", "budget"])),
        v_f16=draw(st.booleans()),
        fma=draw(st.booleans()),
        p2_shift=draw(st.sampled_from(["sequential", "sequential", "lanes"])),
        pad_vote=draw(st.booleans()),
        direct_store=draw(st.booleans()),
        exp2=draw(st.sampled_from(["soft", "soft", "fast"])),
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


def peer_problems(dims=(64, 128), max_rows: int = 320):
    """``_peer_problems`` of head dims ``dims``, checked now (a ValueError naming it)."""
    if not _some_of(dims, HEAD_DIMS, empty=False):
        raise ValueError(f"peer problems: dims={dims!r}: expected some of {HEAD_DIMS}")
    return _peer_problems(tuple(dims), max_rows)


@st.composite
def _peer_problems(draw, dims, max_rows):
    """A ``Problem`` a peer kernel (apa_emu.peers) runs: ``problems()``'s structure, GQA and head dim,
    one batch element, causal with equal lengths (S = n, q_offset 0); no window, pages or varlen. The
    rows around the 128-row query and 64-row key blocks are drawn more often."""
    shape, _ = draw(problems(dims))
    edges = [1, 63, 64, 65, 127, 128, 129, 191, 192, 255, 256, 257, 320]
    n = draw(st.integers(1, max_rows) | st.sampled_from([e for e in edges if e <= max_rows]))
    return Problem(**{**shape, "B": 1, "batched": False, "n": n, "S": n}, q_offset=0)
