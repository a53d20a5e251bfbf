"""Chunked prefill with a KV state (numerics.md §5.9): a restat chunk is a fresh call bit for bit; a
frozen chunk is one too when the frozen statistics happen to equal the chunk's own (an oracle that
does not go through the state's code), and its certificate holds against float64 whatever they are;
each restat rule fires where the spec says and nowhere else; bad chunks are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hyp import examples

from apa_emu import Config, KVState, attention, reference

FIELDS = ("out", "err_bound", "hot")


def _same(a, b) -> bool:
    traces = all((getattr(a, f) is None and getattr(b, f) is None) or getattr(a, f).tobytes() == getattr(b, f).tobytes()
                 for f in ("visits", "rows"))
    return traces and all(getattr(a, f).tobytes() == getattr(b, f).tobytes() for f in FIELDS)


def _balanced(rng, S, Hkv, d, amax):
    """Keys whose every 2j, 2j+1 pair sums to zero per channel, all |x| ≤ amax with x = ±amax present
    in the first pair: any prefix of even length has K mean 0 and the same maxima (§5.1–5.2)."""
    half = rng.uniform(-amax, amax, (S // 2, Hkv, d)).astype(np.float16)
    half[0] = amax
    x = np.empty((S, Hkv, d), np.float16)
    x[0::2], x[1::2] = half, -half
    return x


@st.composite
def prompts(draw):
    d = draw(st.sampled_from([64, 128]))
    Hkv, G = draw(st.sampled_from([(1, 2), (2, 2), (1, 3)]))
    first = 2 * draw(st.integers(40, 200))  # the first chunk: even, so its prefix is balanced
    # later chunks end below 1.125 × the first (no growth restat)
    cuts = sorted({first, *(first + 2 * draw(st.integers(1, first // 16 - 1)) for _ in range(draw(st.integers(1, 3))))})
    seed = draw(st.integers(0, 2**31 - 1))
    return d, Hkv, G, cuts, seed


@settings(deadline=None, max_examples=examples(10))
@given(prompts(), st.sampled_from([Config(), Config(eps=0.05, hot_test="output"), Config(tile_order="ascending")]))
def test_frozen_chunks_with_the_prompts_statistics_are_fresh_calls(prompt, cfg):
    """Balanced keys and values keep K mean and maxima fixed across chunks, so a frozen chunk must be
    the fresh call bit for bit (every trace field too); chunks below 1.125× run frozen."""
    d, Hkv, G, cuts, seed = prompt
    rng = np.random.default_rng(seed)
    S = cuts[-1]
    q = (rng.standard_normal((S, Hkv * G, d)) * 0.7).astype(np.float16)
    k, v = _balanced(rng, S, Hkv, d, 3.0), _balanced(rng, S, Hkv, d, 2.0)
    state, start, frozen = KVState(), 0, 0
    for end in cuts:
        chunk = attention(q[start:end], k[:end], v[:end], start, cfg, kv_state=state, trace="all")
        fresh = attention(q[start:end], k[:end], v[:end], start, cfg, trace="all")
        assert _same(chunk, fresh), (state, start, end)
        frozen += state.last == ""
        start = end
    assert state.restats == 1 and frozen == len(cuts) - 1, state.history  # the interesting case happened
    assert state.length == S and state.stats_length == cuts[0]


@settings(deadline=None, max_examples=examples(8))
@given(prompts(), st.sampled_from([Config(), Config(eps=-1.0), Config(eps=0.02)]))
def test_chunks_hold_their_certificate(prompt, cfg):
    """Real-like keys (a sink, a drifting mean): frozen chunks differ from fresh calls, but their
    outputs stay within their certificate against float64 attention, and restat chunks are fresh calls."""
    d, Hkv, G, cuts, seed = prompt
    rng = np.random.default_rng(seed)
    S = cuts[-1]
    q = rng.standard_normal((S, Hkv * G, d)).astype(np.float16)
    k = (rng.standard_normal((S, Hkv, d)) + np.linspace(0, 1, S)[:, None, None]).astype(np.float16)
    v = rng.standard_normal((S, Hkv, d)).astype(np.float16)
    k[0] += 5
    state, start = KVState(), 0
    for end in cuts:
        chunk = attention(q[start:end], k[:end], v[:end], start, cfg, kv_state=state)
        if state.last:
            assert _same(chunk, attention(q[start:end], k[:end], v[:end], start, cfg))
        ref = reference(q[start:end], k[:end], v[:end], start)
        err = np.linalg.norm(chunk.out.astype(np.float64) - ref, axis=-1)
        assert np.all(err <= chunk.err_bound), (state, start, end)
        start = end
    assert state.chunks == len(cuts) and state.restats < len(cuts)


def _prompt(S=1200, Hkv=1, d=64, seed=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((S, 2 * Hkv, d)).astype(np.float16)
    k = rng.standard_normal((S, Hkv, d)).astype(np.float16)
    v = rng.standard_normal((S, Hkv, d)).astype(np.float16)
    return q, k, v


def _after_first(q, k, v, first=1000):
    state = KVState()
    attention(q[:first], k[:first], v[:first], 0, kv_state=state, warps=None)
    assert state.last == "first" and state.stats_length == first
    return state


def test_growth_rule_is_exact_at_nine_eighths():
    """8·S ≥ 9·slen: 1125 keys after statistics of 1000 restat, 1124 do not."""
    q, k, v = _prompt()
    state = _after_first(q, k, v)
    attention(q[1000:1124], k[:1124], v[:1124], 1000, kv_state=state)
    assert state.last == "" and state.stats_length == 1000
    state = _after_first(q, k, v)
    attention(q[1000:1125], k[:1125], v[:1125], 1000, kv_state=state)
    assert state.last == "growth" and state.stats_length == 1125


@pytest.mark.parametrize("key", [0, 500, 999])
def test_fingerprint_change_restats(key):
    """A different context at one of the fingerprint's keys (0, len div 2, len − 1) restats."""
    q, k, v = _prompt()
    state = _after_first(q, k, v)
    k2 = k.copy()
    k2[key, 0, 5] = -k2[key, 0, 5] if k2[key, 0, 5] != 0 else np.float16(1)
    attention(q[1000:1050], k2[:1050], v[:1050], 1000, kv_state=state)
    assert state.last == "fingerprint"
    k3 = k.copy()
    k3[key, 0, 16] += np.float16(1)  # channel 16 is outside the fingerprint: the caller's promise
    state = _after_first(q, k, v)
    attention(q[1000:1050], k3[:1050], v[:1050], 1000, kv_state=state)
    assert state.last == ""


@pytest.mark.parametrize("which, scale", [("k", 2688), ("v", 2688)])
def test_overflow_restats(which, scale):
    """A new key beyond 2688 under the frozen head scale restats; one just inside does not."""
    q, k, v = _prompt()
    state = _after_first(q, k, v)
    kg, vg = float(state.stats.kg[0, 0]), float(state.stats.vg[0, 0])
    g = kg if which == "k" else vg
    base = float(state.stats.kmean[0, 0, 3]) if which == "k" else 0.0
    for value, reason in ((base + 2 * scale * g, "overflow"), (base + 0.9 * scale * g, "")):
        x = {"k": k.copy(), "v": v.copy()}
        x[which][1020, 0, 3] = np.float16(value)
        assert np.isfinite(x[which][1020, 0, 3])
        s = _after_first(q, k, v)
        attention(q[1000:1050], x["k"][:1050], x["v"][:1050], 1000, kv_state=s)
        assert s.last == reason, (value, s)


@pytest.mark.parametrize("call, message", [
    (lambda q, k, v, s: attention(q[1000:1050], k[:1050], v[:1050], 990, kv_state=s), "starts at q_offset=990"),
    (lambda q, k, v, s: attention(q[1000:1050], k[:1060], v[:1060], 1000, kv_state=s), "k has 1060 keys"),
    (lambda q, k, v, s: attention(q[1000:1050], k[:1050], v[:1050], 1000, kv_state=s, window=64), "window="),
    (lambda q, k, v, s: attention(q[1000:1050], k[:1050], v[:1050], 1000, kv_state=s, warps=[(0, 0, 0)]),
     "warps="),
    (lambda q, k, v, s: attention(np.concatenate([q, q], 1)[1000:1050], np.concatenate([k, k], 1)[:1050],
                                  np.concatenate([v, v], 1)[:1050], 1000, kv_state=s),
     r"statistics are for \(batch, kv heads, d\)"),
    (lambda q, k, v, s: attention(q[1000:1050], k[:1050], v[:1050], 1000, kv_state={}), "expected an apa_emu.KVState"),
])
def test_bad_chunks_are_refused(call, message):
    q, k, v = _prompt()
    state = _after_first(q, k, v)
    with pytest.raises(ValueError, match=message):
        call(q, k, v, state)
    assert state.length == 1000 and state.chunks == 1  # a refused chunk leaves the state alone


def test_frozen_chunk_quantizes_with_the_states_scales():
    """A new key three times the statistics' K maximum (below the overflow limit) leaves the state's
    head scale in use: the frozen chunk's kg is the first chunk's, a fresh call's is larger, and the
    outputs differ."""
    q, k, v = _prompt()
    state = _after_first(q, k, v)
    kg = float(state.stats.kg[0, 0])
    k2 = k.copy()
    k2[1010, 0] = np.float16(3) * np.abs(k[:1000]).max()
    chunk = attention(q[1000:1050], k2[:1050], v[:1050], 1000, kv_state=state)
    fresh = attention(q[1000:1050], k2[:1050], v[:1050], 1000)
    assert state.last == "" and chunk.meta["head_scales"][0, 0][0] == kg
    assert fresh.meta["head_scales"][0, 0][0] >= 2 * kg
    assert chunk.out.tobytes() != fresh.out.tobytes()


def test_first_chunk_may_start_past_a_prefix():
    """The first chunk may sit anywhere (its earlier keys a prefix whose queries are not run): it
    restats and is the fresh call; the next must follow it."""
    q, k, v = _prompt()
    state = KVState()
    first = attention(q[100:300], k[:300], v[:300], 100, kv_state=state, trace="all")
    assert state.last == "first" and state.length == 300
    assert _same(first, attention(q[100:300], k[:300], v[:300], 100, trace="all"))
    attention(q[300:320], k[:320], v[:320], 300, kv_state=state)
    assert state.last == "" and state.length == 320


def test_an_interrupted_chunk_leaves_the_state_as_the_last_finished_one():
    """A chunk stopped mid-run (its progress callback raising, as Ctrl-C would) changes nothing the
    next chunk reads: ``last``, ``length`` and the history still describe the chunk before it
    (fuzz-2026-12 S6), and running the chunk again gives the uninterrupted result."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((160, 2, 64), (160, 1, 64), (160, 1, 64)))
    state, fresh = KVState(), KVState()
    for st in (state, fresh):
        attention(q[:80], k[:80], v[:80], 0, kv_state=st)

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        attention(q[80:], k, v, 80, kv_state=state, progress=stop)
    assert (state.last, state.length, state.history) == ("first", 80, [(80, "first")])
    again = attention(q[80:], k, v, 80, kv_state=state)
    assert again.out.tobytes() == attention(q[80:], k, v, 80, kv_state=fresh).out.tobytes()
    assert state.history == fresh.history == [(80, "first"), (160, "growth")]
