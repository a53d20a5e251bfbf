"""Algorithm properties of the emulator (numerics.md §5–§9), against float64 and against its own
invariants. Inputs come from Hypothesis-drawn structure (sinks, diagonal mass, diffuse heads, channel
offsets, outliers) built by ``apa_emu.study.synth`` from a drawn seed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from helpers import merge_f64, merged_f64, mixed_problem, problems
from hyp import Seen, examples

from apa_emu import Config, attention, fpmath, reference
from apa_emu.merge import merge
from apa_emu.metrics import pair_metrics
from apa_emu.study.synth import synthetic

ALL_OFF = dict(quant_q=False, quant_k=False, quant_p=False, quant_v=False)


def packed_reference(q, k, v, off, rows) -> np.ndarray:
    """Float64 reference for the traced packed rows (§6.1 maps packed row r of KV head hk)."""
    H, Hkv = q.shape[1], k.shape[1]
    G = H // Hkv
    pos, head = rows["row"] // G, rows["hk"] * G + rows["row"] % G
    from apa_emu.reference import reference_rows

    return reference_rows(q, k, v, off, pos, head, Config().softmax_scale(q.shape[2]))


def test_unquantized_exact_matches_float64():
    """§3.3 + toggles off: only binary32 softmax arithmetic remains, so the merged binary32 result is
    within 1e-5 of float64 attention, and the FP16 output is that value rounded (±1 FP16 ulp). Hot
    and cold tiles both occur, and some rows merge both parts."""
    seen = Seen()

    @settings(deadline=None, max_examples=examples(12))
    @given(problems(dims=(64, 128, 256)), st.sampled_from([0.0, 0.005, 0.05, 0.3]))
    @example(mixed_problem(256), 0.3)
    def prop(problem, eps):
        q, k, v, off = problem
        res = attention(q, k, v, off, Config(eps=eps, mma="exact", p2_accum="f32", **ALL_OFF), trace="all")
        ref = packed_reference(q, k, v, off, res.rows)
        got = merged_f64(res.rows)
        rel = np.sqrt(((got - ref) ** 2).sum() / (ref**2).sum())
        assert rel <= 1e-5
        out16 = res.rows["out"].astype(np.float64)
        assert np.all(np.abs(out16 - got) <= np.spacing(np.abs(got).astype(np.float16)).astype(np.float64) + 1e-12)
        seen.update(hot=int(res.visits["hot"].sum()), cold=int((res.visits["hot"] == 0).sum()),
                    merged=int(((res.rows["l1"] > 0) & (res.rows["l2"] > 0)).sum()), d256=int(q.shape[2] == 256))

    prop()
    seen.require("hot", "cold", "merged", "d256")


def _previous_state(vis):
    """For each visit record, the (m, la) of its warp before the visit (§7: −inf and 0 at first)."""
    m_prev = np.full(vis["m"].shape, -np.inf, np.float32)
    la_prev = np.zeros(vis["la"].shape, np.float32)
    same = (vis["b"][1:] == vis["b"][:-1]) & (vis["hk"][1:] == vis["hk"][:-1]) & (vis["warp"][1:] == vis["warp"][:-1])
    m_prev[1:][same] = vis["m"][:-1][same]
    la_prev[1:][same] = vis["la"][:-1][same]
    return m_prev, la_prev


def test_hot_verdicts_follow_the_hot_test():
    """§7.7 re-evaluated from the trace: a tile is hot exactly when some row has
    tl > ε ⊗ ((la ⊗ a) ⊕ tl), with the state before the visit. ε = 0 makes the strict comparison
    observable: a tile whose P̂ all round to zero (tl = 0) must stay cold."""
    seen = Seen()

    @settings(deadline=None, max_examples=examples(12))
    @given(problems(), st.sampled_from([0.0, 0.005, 0.3, 1.0]), st.sampled_from(["sm90", "sm120"]),
           st.sampled_from([32.0, 0.0]))
    # δ = 0 keeps the frame at the sink, and the tail 16.5 below it quantizes to P̂ = 0
    @example(sink_dominated_tail(keys=1024), 0.0, "sm90", 0.0)
    def prop(problem, eps, mma, delta):
        q, k, v, off = problem
        res = attention(q, k, v, off, Config(eps=eps, mma=mma, delta=delta), trace="all")
        vis = res.visits
        m_prev, la_prev = _previous_state(vis)
        valid = np.zeros(vis["m"].shape, bool)
        R = res.meta["R"]
        valid[:] = (16 * vis["warp"][:, None] + np.arange(16)[None, :]) < R
        with np.errstate(invalid="ignore", over="ignore"):
            a = np.where(vis["c"] == m_prev, np.float32(1), fpmath.exp2_np(m_prev - vis["c"], True)).astype(np.float32)
            bound = np.float32(eps) * (la_prev * a + vis["tl"])
        hot = ((vis["tl"] > bound) & valid).any(axis=1)
        assert np.array_equal(hot, vis["hot"] == 1)
        seen.update(hot=int(hot.sum()), cold=int((~hot).sum()),
                    zero_sum_cold=int((eps == 0) * ((vis["tl"] == 0) | ~valid).all(axis=1).sum()))

    prop()
    seen.require("hot", "cold", "zero_sum_cold")


def test_cold_verdicts_are_safe():
    """§7.7: every tile pass 1 calls cold has ℓ_t ≤ ε·λ_final in the final frame, for every row."""
    seen = Seen()

    @settings(deadline=None, max_examples=examples(12))
    @given(problems(), st.sampled_from([0.002, 0.01, 0.1, 0.3]))
    @example(mixed_problem(64), 0.3)
    def prop(problem, eps):
        q, k, v, off = problem
        res = attention(q, k, v, off, Config(eps=eps), trace="all")
        vis = res.visits
        for key in {(int(b), int(h), int(w)) for b, h, w in zip(vis["b"], vis["hk"], vis["warp"])}:
            sel = vis[(vis["b"] == key[0]) & (vis["hk"] == key[1]) & (vis["warp"] == key[2])]
            final = sel[-1]
            rows = final["la"] > 0
            for rec in sel[sel["hot"] == 0]:
                # the cold branch moved the frame to c, so tl is in the frame m recorded after the step
                tl_final = rec["tl"].astype(np.float64) * np.exp2(rec["m"].astype(np.float64) - final["m"])
                assert np.all(tl_final[rows] <= eps * final["la"][rows].astype(np.float64) * (1 + 1e-5))
                seen.update(cold_with_mass=int((rec["tl"][rows] > 0).any()))

    prop()
    seen.require("cold_with_mass")


def test_negative_eps_is_pass2_alone():
    """§9.6: with ε < 0 there is no pass-1 state and every active tile is hot; the output is the
    pass-2 state alone, out = f16(o2 ⊗ (1 ⊘ l2))."""

    @settings(deadline=None, max_examples=examples(8))
    @given(problems(max_keys=400))
    def prop(problem):
        q, k, v, off = problem
        res = attention(q, k, v, off, Config(eps=-1.0), trace="all")
        assert res.visits.size == 0 and res.hot_tiles == res.active_tiles
        rows = res.rows
        assert np.all(rows["l1"] == 0) and np.all(np.isneginf(rows["m1"]))
        inv = np.float32(1) / rows["l2"]
        expect = (rows["o2"] * inv[:, None]).astype(np.float16)
        assert np.array_equal(expect.view(np.uint16), rows["out"].view(np.uint16))

    prop()


def test_binary32_scores_leave_only_the_fp16_roundings():
    """§8.1 ``p2_scores="f32"`` against float64 attention. With every tile exact and binary32 O, what
    is left of pass 2 is P16 = f16(p) and the FP16 output, each 2⁻¹¹ relative: every pair stays within
    2⁻¹⁰. Raw scores of 4–9 standard deviations times 8 (q, k of gain 2–3, d = 64) put the FP16 score
    chain's steps at ulps of 2⁻⁵–2⁻³, which moves p by up to 1 %: the same problems under FP16 scores
    must exceed 2⁻¹⁰ somewhere, or the case that tells them apart did not happen."""
    seen = Seen()

    @settings(deadline=None, max_examples=examples(6))
    @given(st.integers(0, 2**16), st.sampled_from([2.0, 3.0]))
    def prop(seed, gain):
        rng = np.random.default_rng(seed)
        q, k = ((gain * rng.standard_normal(shape)).astype(np.float16) for shape in ((32, 2, 64), (256, 1, 64)))
        v = rng.standard_normal((256, 1, 64)).astype(np.float16)
        ref = reference(q, k, v, 224)

        def rel(cfg):
            out = attention(q, k, v, 224, cfg).out.astype(np.float64)
            return np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)

        assert rel(Config(eps=-1.0, p2_accum="f32", p2_scores="f32")).max() <= 2.0**-10
        seen.update(f16_scores_past=int(rel(Config(eps=-1.0, p2_accum="f32")).max() > 2.0**-10))

    prop()
    seen.require("f16_scores_past")


def test_merge_of_two_frames_is_one_softmax():
    """§9: the emulator's merge of the states of two disjoint key sets, each in its own frame (m1 and
    m2 up to 40 apart, either larger), equals float64 softmax over all keys to binary32 accuracy
    before the final FP16 rounding; an empty part (l = 0) weighs nothing."""
    rng = np.random.default_rng(3)
    R, d, keys = 64, 8, 300
    s = rng.standard_normal((R, keys)) * 4
    s[:, :150] += rng.uniform(-40, 40, (R, 1))  # the two halves live in frames far apart
    vals = rng.standard_normal((keys, d))
    states = []
    for idx in (np.arange(150), np.arange(150, keys)):
        m = s[:, idx].max(axis=1)
        p = np.exp2(s[:, idx] - m[:, None])
        states += [m.astype(np.float32), p.sum(axis=1).astype(np.float32),
                   (p @ vals[idx]).astype(np.float32)]  # ok: float64 oracle
    m1, l1, part, m2, l2, o2 = states
    m2[:4], l2[:4], o2[:4] = -np.inf, 0, 0  # rows whose second part is empty
    got = merge(m1, l1, part, m2, l2, o2, True).astype(np.float64)
    want = merge_f64(m1, l1, part, m2, l2, o2)
    p = np.exp2(s - s.max(axis=1, keepdims=True))
    p[:4, 150:] = 0
    softmax = (p @ vals) / p.sum(axis=1, keepdims=True)  # ok: float64 oracle
    np.testing.assert_allclose(want, softmax, rtol=1e-5, atol=1e-6)
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(got - want) <= ulp + 1e-7)
    assert (m1 > m2).any() and (m1 < m2).any()


def test_emulator_output_is_the_merge_of_its_traced_parts():
    """End to end (§9): with hot and cold tiles mixed, every row's FP16 output is the float64 merge of
    its traced pass-1 and pass-2 states rounded (±1 FP16 ulp), and rows that merge both parts exist."""
    q, k, v, off = mixed_problem(64)
    res = attention(q, k, v, off, Config(eps=0.3), trace="all")
    rows = res.rows
    want = merged_f64(rows)
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(rows["out"].astype(np.float64) - want) <= ulp + 1e-12)
    both = (rows["l1"] > 0) & (rows["l2"] > 0)
    assert both.sum() > 10 and (rows["m1"][both] != rows["m2"][both]).any()


def sink_dominated_tail(keys=6144, d=64, gap=16.5):
    """One warp whose sink holds ~90 % of the mass while the output direction lives in a thin tail
    lying ``gap`` log2 units below the sink: the seed's 0.2.0 failure (apa-blog.txt)."""
    rng = np.random.default_rng(11)
    n, off = 16, keys - 16
    qmul = float(Config().softmax_scale(d)) * np.log2(np.e)
    q = np.zeros((n, 1, d), np.float32)
    q[:, 0, 0] = 8.0
    q[:, 0, 1:] = rng.standard_normal((n, d - 1)) * 0.05
    k = np.zeros((keys, 1, d), np.float32)
    k[:, 0, 1:] = rng.standard_normal((keys, d - 1)) * 0.05
    k[1:, 0, 0] = rng.standard_normal(keys - 1) * 0.3 / (8.0 * qmul)  # a thin spread of tail scores
    k[0, 0, 0] = gap / (8.0 * qmul)
    v = np.zeros((keys, 1, d), np.float32)
    v[0, 0, :] = -1.0
    v[1:, 0, :] = 20.0 + rng.standard_normal((keys - 1, d))
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), off


def test_cold_output_holds_no_negative_zero():
    """§7.9: a frame move that underflows a negative element of o gives −0, which update turns into +0,
    so the exported part (o ⊗ vk) has no −0. (The kernel's hot tiles run the P·V MMA with P̂ = 0; a −0
    in o would come out +0 there, and the two would differ in the sign of zero.) Here the hot tile 1
    moves the frame by δ = 32 past the cold tile 2: every element of o underflows."""
    from apa_emu.strategies import make_inputs

    q, k, v = make_inputs(0, 1, 56, 1, 1, 64, 183, "channel", batched=False)
    k[119] = v[119] = 0  # a zero key (a paged KV hole, §5.0), which this example needs
    v[:, 0, 0] = -np.abs(v[:, 0, 0])  # channel 0 negative everywhere: its products with P̂ = 0 are −0 too
    cfg = Config(eps=0.3, quant_k=False, quant_p=False, quant_v=False, tau=0)
    rows = attention(q, k, v, 127, cfg, trace="all").rows
    flushed = (rows["l1"] == 0) & (rows["m1"] > -np.inf)  # cold mass rescaled away to zero
    assert flushed.sum() > 0
    zero = rows["part"] == 0
    assert zero[flushed].all() and not np.signbit(rows["part"][zero]).any()


def test_decoupled_cold_frame_recovers_the_tail():
    """δ = 0 quantizes the tail to zero next to the sink (cosine < 0.5); δ = 32 keeps it (> 0.9)."""
    q, k, v, off = sink_dominated_tail()
    ref = reference(q, k, v, off)
    cos0, _ = pair_metrics(attention(q, k, v, off, Config(eps=0.01, delta=0.0)).out, ref)
    cos32, _ = pair_metrics(attention(q, k, v, off, Config(eps=0.01, delta=32.0)).out, ref)
    assert cos0.max() < 0.5
    assert cos32.min() > 0.9


def test_reruns_and_workers_are_bitwise_identical():
    q, k, v, off = (lambda d: (d.q, d.k, d.v, d.q_offset))(synthetic(40, 700, 6, 2, 64, seed=5, q_offset=660))
    runs = [attention(q, k, v, off, Config(), workers=w) for w in (1, 1, 2)]
    for r in runs[1:]:
        assert np.array_equal(r.out.view(np.uint16), runs[0].out.view(np.uint16))
        assert np.array_equal(r.hot, runs[0].hot)


def test_trace_limited_to_chosen_warps():
    dump = synthetic(40, 300, 2, 1, 64, seed=9, q_offset=260)
    full = attention(dump.q, dump.k, dump.v, dump.q_offset, Config(), trace="all")
    one = attention(dump.q, dump.k, dump.v, dump.q_offset, Config(), trace=[(0, 0, 2)])
    assert set(one.visits["warp"]) == {2}
    assert np.array_equal(one.visits.view(np.uint8), full.visits[full.visits["warp"] == 2].view(np.uint8))
    assert np.array_equal(one.out.view(np.uint16), full.out.view(np.uint16))


def _ok():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((8, 2, 64)).astype(np.float16), rng.standard_normal((64, 1, 64)).astype(np.float16),
            rng.standard_normal((64, 1, 64)).astype(np.float16))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v: (q.astype(np.float32), k, v, 0), "q: expected dtype float16"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48], 0), "head dim 48 is not supported"),
        (lambda q, k, v: (np.concatenate([q, q[:, :1]], 1), np.concatenate([k, k], 1), np.concatenate([v, v], 1), 0),
         "not a multiple of KV heads"),
        (lambda q, k, v: (q, k, v[:-1], 0), "k, v: shapes differ"),
        (lambda q, k, v: (q, k, v, -1), "q_offset: -1 leaves query row 0 with no key"),
        (lambda q, k, v: (q, np.where(np.arange(64)[:, None, None] == 5, np.float16(np.nan), k), v, 0), "k: non-finite"),
        (lambda q, k, v: (q, k, np.where(np.arange(64)[:, None, None] == 7, np.float16(np.inf), v), 0), "v: non-finite"),
        (lambda q, k, v: (q[0], k, v, 0), "expected shape"),
        (lambda q, k, v: (q, k, v, 1.5), "q_offset: expected an integer"),
    ],
)
def test_bad_inputs_raise(mutate, match):
    q, k, v = _ok()
    args = mutate(q, k, v)
    with pytest.raises(ValueError, match=match):
        attention(*args[:3], args[3])


@pytest.mark.parametrize("bad", [dict(tau=9), dict(mma="sm100"), dict(q_terms=3), dict(eps=float("nan")),
                                 dict(mma="sm120", quant_v=False), dict(delta=-1.0)])
def test_bad_config_raises(bad):
    with pytest.raises(ValueError, match="config"):
        Config(**bad)



def test_head_dim_256_and_batch():
    """d = 256 runs through every step; a batch entry equals the same problem run alone."""
    a = synthetic(24, 200, 4, 2, 256, seed=21)
    b = synthetic(24, 200, 4, 2, 256, seed=22)
    batched = attention(np.stack([a.q, b.q]), np.stack([a.k, b.k]), np.stack([a.v, b.v]), a.q_offset, Config())
    alone = attention(b.q, b.k, b.v, b.q_offset, Config())
    assert np.array_equal(batched.out[1].view(np.uint16), alone.out.view(np.uint16))
    cos, _ = pair_metrics(alone.out, reference(b.q, b.k, b.v, b.q_offset))
    assert cos.min() > 0.99


def test_sm120_end_to_end_against_sm90_and_float64():
    """`sm120` (§3.2) through the whole pass 1 on sink-structured input. Its FP4 products see the same
    Q̂, K̂, P̂ and V̂ values as `sm90`'s FP16 ones, so outputs agree within 1 % rel. L2 in pure FP4 (every
    tile cold; a wrong row sum, §7.6, would rescale whole rows) while still differing in some bits;
    with hot tiles mixed in (ε = 0.3) the error against float64 shrinks."""
    dump = synthetic(32, 900, 4, 2, 64, seed=41, q_offset=868)
    ref = reference(dump.q, dump.k, dump.v, dump.q_offset)
    runs = {(mma, eps): attention(dump.q, dump.k, dump.v, dump.q_offset, Config(mma=mma, eps=eps))
            for mma in ("sm120", "sm90") for eps in (1e9, 0.3)}
    fp4, mixed = runs["sm120", 1e9], runs["sm120", 0.3]
    assert fp4.hot_tiles == 0 and 0 < mixed.hot_tiles < mixed.active_tiles
    _, rel_models = pair_metrics(fp4.out, runs["sm90", 1e9].out.astype(np.float64))
    assert 0 < rel_models.max() <= 0.01
    _, rel_fp4 = pair_metrics(fp4.out, ref)
    _, rel_mixed = pair_metrics(mixed.out, ref)
    assert rel_mixed.mean() < 0.5 * rel_fp4.mean()


def test_fast_exp2_end_to_end():
    """The fast mode on the CPU (§2, §7.5) with hot and cold tiles mixed: its binary16 P' moves some
    E2M1 codes, so outputs differ from the soft mode, but the accuracy against float64 is the same
    within 5 % and the hot verdicts flip on at most 5 % of the hot tiles."""
    dump = synthetic(40, 1200, 4, 2, 128, seed=43, q_offset=1160)
    ref = reference(dump.q, dump.k, dump.v, dump.q_offset)
    soft = attention(dump.q, dump.k, dump.v, dump.q_offset, Config(eps=0.3))
    fast = attention(dump.q, dump.k, dump.v, dump.q_offset, Config(eps=0.3, exp2="fast"))
    assert 0 < soft.hot_tiles < soft.active_tiles
    assert (fast.out != soft.out).any()
    _, rel_soft = pair_metrics(soft.out, ref)
    _, rel_fast = pair_metrics(fast.out, ref)
    assert abs(rel_fast.mean() - rel_soft.mean()) <= 0.05 * rel_soft.mean()
    flips = np.unpackbits((soft.hot ^ fast.hot).view(np.uint8)).sum()
    assert flips <= 0.05 * soft.hot_tiles


@pytest.mark.parametrize("exponent", [-20, -12])
def test_subnormal_inputs_keep_their_values(exponent):
    """FP16 subnormal q, k, v (§1.2: subnormals are kept, nothing flushes): with the toggles off and
    the exact model the output matches float64 attention of the same inputs within 1 FP16 ulp, so
    the tiny values were neither flushed nor mis-scaled in prep (§5.2 head scales are powers of 2)."""
    dump = synthetic(16, 200, 2, 1, 64, seed=47)
    q, k, v = ((x.astype(np.float64) * 2.0**exponent).astype(np.float16) for x in (dump.q, dump.k, dump.v))
    assert (np.abs(v[v != 0]) < 2.0**-14).any()  # subnormal values really occur
    res = attention(q, k, v, dump.q_offset, Config(mma="exact", p2_accum="f32", eps=0.05, **ALL_OFF))
    ref = reference(q, k, v, dump.q_offset)
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(res.out.astype(np.float64) - ref) <= 2 * ulp)
    assert np.any(res.out != 0)


def test_fp16_output_overflow_is_reproduced_not_hidden():
    """§8.5: pass 2 keeps O in FP16 across all hot tiles, as the seed does. Diffuse rows (all scores
    0) over 16384 keys with V = 8 sum to 131072 > 65504: the FP16 accumulator overflows to inf and
    the output is non-finite; binary32 accumulation (p2_accum = "f32") gives the exact answer 8."""
    keys, d = 16384, 64
    q = np.zeros((16, 1, d), np.float16)
    k = np.zeros((keys, 1, d), np.float16)
    v = np.full((keys, 1, d), 8, np.float16)
    off = keys - 16
    f16 = attention(q, k, v, off, Config(eps=-1.0), trace="all")
    f32 = attention(q, k, v, off, Config(eps=-1.0, p2_accum="f32"))
    assert not np.isfinite(f16.out).any() and np.isinf(f16.rows["o2"]).any()
    assert np.all(f32.out == 8)


def test_prep_too_large_for_memory_is_refused_up_front(monkeypatch):
    """A KV head whose prep cannot fit is refused before any work, naming the need."""
    import apa_emu.api as api

    dump = synthetic(16, 4096, 1, 1, 64, seed=3)
    monkeypatch.setattr(api, "available_bytes", lambda: 2**20)
    with pytest.raises(MemoryError, match=r"4096 keys \(d = 64\) needs about 0\.0 GiB; 0\.0 GiB"):
        attention(dump.q, dump.k, dump.v, dump.q_offset)
    monkeypatch.setattr(api, "available_bytes", lambda: 2**40)
    assert attention(dump.q, dump.k, dump.v, dump.q_offset).out.shape == dump.q.shape


@pytest.mark.parametrize("kwargs, match", [
    (dict(warps=[(0, 0, 9)]), r"warps: warp \(0, 0, 9\) does not exist"),
    (dict(trace=[(0, 1, 0)]), r"trace: warp \(0, 1, 0\) does not exist"),
    (dict(workers=0), "workers: expected a positive integer"),
    (dict(workers="2"), "workers: expected a positive integer"),
    (dict(progress=42), "progress: expected a callable"),
])
def test_bad_call_arguments_raise(kwargs, match):
    q, k, v = _ok()
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, 0, **kwargs)


def test_q_offset_past_int32_and_byte_swapped_inputs():
    q, k, v = _ok()
    with pytest.raises(ValueError, match="q_offset: .* past 2147483647"):
        attention(q, k, v, 2**63)
    swapped = [x.astype(">f2") for x in (q, k, v)]
    assert np.array_equal(attention(*swapped, 0).out.view(np.uint16), attention(q, k, v, 0).out.view(np.uint16))


@pytest.mark.parametrize("bad", [dict(scale="abc"), dict(eps=1e39), dict(delta=1e39), dict(eps=True)])
def test_bad_config_values_name_the_field(bad):
    with pytest.raises(ValueError, match=f"config.{next(iter(bad))}"):
        Config(**bad)


@pytest.mark.parametrize("item, match", [("tau=abc", "tau expects an integer"), ("eps=x", "eps expects a number"),
                                         ("quant_q=maybe", "quant_q expects on/off")])
def test_config_overrides_name_the_key(item, match):
    with pytest.raises(ValueError, match=match):
        Config.from_overrides([item])


def test_gqa_packing_follows_the_spec():
    """§6.1 with several KV heads: packed row r of KV head hk is query position r div G of head
    hk·G + (r mod G), and unpacking inverts it. (`attention` packs one KV head at a time, so only this
    test sees the Hkv > 1 path.)"""
    from apa_emu.prep import pack_rows, unpack_rows

    n, Hkv, G, d = 5, 3, 4, 2
    q = np.random.default_rng(0).standard_normal((n, Hkv * G, d))
    packed = pack_rows(q, Hkv)
    for hk in range(Hkv):
        for r in range(n * G):
            assert np.array_equal(packed[hk, r], q[r // G, hk * G + r % G])
    assert np.array_equal(unpack_rows(packed, n, G), q)


def test_v_f16_rounds_the_scaled_value_to_fp16():
    """§5.5 ``v_f16`` (the seed's f16(v/vg)): v = 2⁻⁸(1 + 2⁻¹⁰) under vg = 128 (amax V = 60000:
    up2(4·60000/2688) = 128) is x = 2⁻¹⁵ + 2⁻²⁵, exact in binary32; in FP16 it is a subnormal tie between
    512 and 513 units of 2⁻²⁴ and rounds to the even 2⁻¹⁵. Read as the unquantized binary32 operand."""
    from apa_emu.prep import prepare

    q = np.ones((1, 1, 64), np.float16)
    k = np.ones((2, 1, 64), np.float16)
    v = np.zeros((2, 1, 64), np.float16)
    v[0, 0, 0] = 60000
    v[1, 0, 5] = np.float16(2.0**-8 * (1 + 2.0**-10))
    assert float(v[1, 0, 5]) == 2.0**-8 * (1 + 2.0**-10)
    for v_f16, want in ((False, 2.0**-15 + 2.0**-25), (True, 2.0**-15)):
        cfg = Config(mma="exact", quant_v=False, v_f16=v_f16)
        p = prepare(q, k, v, 1, cfg)
        assert p.vg[0] == 128
        assert p.vhat_t[0, 0, 5, 1] == np.float32(want)  # tile 0, channel 5, slot 1 = key 1


def test_fma_lifts_the_row_maximum_groups_scale_one_step():
    """§1.8 ``fma`` at §7.4's u = fma(gm, c_q, A ⊖ c), the seed's fmaf. Take gm = 100, c_q = 1 + 2⁻²²
    and the frame c = gm ⊗ c_q of the group that holds the row maximum: the exact product
    100 + 100·2⁻²² lies 2⁻²⁰ above c = 100 + 3·2⁻¹⁷ (it rounds down), and A ⊖ c = −96 − 3·2⁻¹⁷ is
    exact. Unfused, u = c ⊕ (A ⊖ c) = 4 exactly: mi = 0, UE4M3 code 8·(4 + 7) = 88, scale 16. Fused,
    u = 100 + 100·2⁻²² − 96 − 3·2⁻¹⁷ = 4 + 2⁻²⁰ exactly: exp2(2⁻²⁰) > 1 gives mi = 1, code 89, scale 18."""
    from apa_emu.formats import ue4m3_value
    from apa_emu.fpmath import ex2_tables
    from apa_emu.pass1 import P1Mode, p1_pscale

    gm, cq = np.float32(100), np.float32(1 + 2.0**-22)
    c = gm * cq
    assert float(c) == 100 + 3 * 2.0**-17
    k = Config().pass1_consts()
    assert k.A == 4
    for fma, code, scale in ((False, 88, 16), (True, 89, 18)):
        mode = P1Mode(0, *ex2_tables(True), False, True, np.arange(64), np.float32(1), False, fma, False, np.float32(1))
        kb = p1_pscale(gm, cq, c, k, mode)[0]
        assert (kb, float(ue4m3_value(np.uint8(kb)))) == (code, scale)


def test_fma_sites_change_bits_and_only_under_the_toggle():
    """Config ``fma`` (§1.8) on a problem with hot and cold tiles: it moves output bits (the seed's
    contraction is not a no-op), by FP16 rounding steps, not by a broken path."""
    from apa_emu.strategies import make_inputs

    q, k, v = make_inputs(3, 1, 64, 2, 3, 64, 900, "sink", batched=False)
    cfg = Config(eps=0.05)
    base = attention(q, k, v, 900 - 64, cfg)
    fused = attention(q, k, v, 900 - 64, cfg.replace(fma=True))
    assert 0 < base.hot_tiles < base.active_tiles
    assert (base.out != fused.out).any()
    assert np.abs(base.out.astype(np.float64) - fused.out.astype(np.float64)).max() < 0.01


def test_seed_preset():
    """Config.seed() and ``--config preset=seed``: the seed's modelled arithmetic (numerics.md §12),
    toggles after the preset applied on top of it; a preset after a toggle, or another name, refused."""
    seed = Config.seed()
    assert (seed.mma, seed.fma, seed.p_groups, seed.v_f16) == ("sm120", True, "interleaved", True)
    assert (seed.k_stats, seed.pad_vote, seed.p2_shift, seed.direct_store) == ("sampled", True, "lanes", True)
    assert Config.from_overrides(["preset=seed"]) == seed
    assert Config.from_overrides(["preset=seed", "eps=0.02"]) == seed.replace(eps=0.02)
    with pytest.raises(ValueError, match="must come first"):
        Config.from_overrides(["eps=0.02", "preset=seed"])
    with pytest.raises(ValueError, match="the one preset is 'seed'"):
        Config.from_overrides(["preset=seed-0.8"])
    q, k, v = (np.random.default_rng(2).standard_normal((m, 2, 64)).astype(np.float16) for m in (20, 140, 140))
    res = attention(q, k, v, 120, seed)  # runs end to end under the sm120 model
    assert np.isfinite(res.out.astype(np.float32)).all()
