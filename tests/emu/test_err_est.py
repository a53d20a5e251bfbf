"""The error estimate err_est (numerics.md §9.8): its sums against float64 weights, its means against
float64 norms and against reordering, and its calibration against float64 attention."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hyp import Seen, examples
from helpers import mixed_problem, problems

from apa_emu import Config, attention
from apa_emu.geometry import ROWS, TILE
from apa_emu.prep import KV_STATS, nrm, prepare
from apa_emu.reference import reference
from apa_emu.study.dump import builtin_dump_path, read_dump

F32 = np.float32
COL = {name: i for i, name in enumerate(KV_STATS)}


def _weights(q, k, off, cfg, rows, hot):
    """Per traced row, float64 Σ 2^(σ − m) and Σ 2^(2(σ − m)) over its cold and its hot keys, σ the exact
    log2 score against the centred keys (what both passes' frames measure, §5.3 sh), m the pass's frame."""
    H, Hkv, d = q.shape[1], k.shape[1], q.shape[2]
    G = H // Hkv
    qmul = float(cfg.qmul(d))
    kc = k.astype(np.float64) - k.astype(np.float64).mean(axis=0)
    out = np.zeros((len(rows), 4))
    for i, rec in enumerate(rows):
        hk, r = int(rec["hk"]), int(rec["row"])
        pos, head = r // G, hk * G + r % G
        lim = off + pos
        s = qmul * (kc[:lim + 1, hk] @ q[pos, head].astype(np.float64))  # ok: float64 oracle
        t = np.arange(lim + 1) // TILE
        words = hot[0, hk, r // ROWS]
        is_hot = ((words[t // 32] >> (t % 32).astype(np.uint32)) & 1).astype(bool)
        for j, (sel, m) in enumerate(((~is_hot, rec["m1"]), (is_hot, rec["m2"]))):
            if sel.any() and np.isfinite(m):
                w = np.exp2(s[sel] - float(m))
                out[i, 2 * j:2 * j + 2] = w.sum(), (w * w).sum()
    return out


@pytest.mark.parametrize("cfg", [Config(), Config(exp2="fast", p_groups="interleaved")], ids=["default", "fast"])
def test_square_sums_are_the_passes_squared_weights(cfg):
    """§7.6/§7.8 ws1 and §8.4 P2 are Σ P̂² over the cold keys and Σ p² over the hot ones, in the
    frames m1 and m2 (§7.9 and §8.2 rescale them by α² and a²). Against float64 weights 2^(σ − m):
    pass 2's FP16 scores keep P2 within 10 %: it is about the largest weight squared, and that score's
    FP16 chain (and its FP16-rounded centred keys) errs by up to about 0.06 in log2 units on these
    problems, 2^(2·0.06) − 1 = 8.7 % (a random run found 0.056).
    Pass 1's FP4 scores move a row's few large cold weights by up to 2× (and l1 with them), so ws1 is
    held relative to l1², the same weights summed: (ws1/l1²)/(Σw²/(Σw)²) within 3×. A missed rescale
    after a frame move is off by 2^(2τ) = 256×, hot keys counted as cold by the hot share."""
    seen = Seen()

    @settings(deadline=None, max_examples=examples(6))
    @given(problems(max_keys=700), st.sampled_from([0.05, 0.3]))
    @example(mixed_problem(64), 0.3)
    def prop(problem, eps):
        q, k, v, off = problem
        c = cfg.replace(eps=eps)
        res = attention(q, k, v, off, c, trace="all")
        rows = res.rows
        f = _weights(q, k, off, c, rows, res.hot)
        cold, hot = rows["l1"] > 0, rows["l2"] > 0
        np.testing.assert_allclose(rows["p2"][hot], f[hot, 3], rtol=0.1)
        assert np.all(rows["p2"][~hot] == 0)
        big = cold & (f[:, 1] > 0)
        share = (rows["ws1"][big] / rows["l1"][big] ** 2) / (f[big, 1] / f[big, 0] ** 2)
        assert np.all((share > 1 / 3) & (share < 3)), f"share: {share.min():.3g} .. {share.max():.3g}"
        visits = res.visits
        moved = 0
        for key in {(int(a), int(b)) for a, b in zip(visits["hk"], visits["warp"])}:
            vs = visits[(visits["hk"] == key[0]) & (visits["warp"] == key[1])]
            had_cold = np.logical_or.accumulate(vs["hot"] == 0)[:-1]
            moved += int((had_cold & (vs["m"][1:] > vs["m"][:-1]).any(axis=1)).sum())
        seen.update(cold_rows=int(big.sum()), hot_rows=int(hot.sum()), merged=int((cold & hot).sum()),
                    frame_moved_after_cold=moved)

    prop()
    seen.require("cold_rows", "hot_rows", "merged", "frame_moved_after_cold")


def test_norm_means_are_exact_and_order_free():
    """§5.7's means km, ekm: f16 of each key's norm summed as an integer, so reordering the keys gives
    the same bits (a binary32 sum in key order would not, over 3000 keys), and they stay within the
    f16 rounding (2⁻¹¹) of the float64 mean of the same norms."""
    rng = np.random.default_rng(5)
    S, d = 3000, 64
    q = rng.standard_normal((4, 2, d)).astype(np.float16)
    k = (rng.standard_normal((S, 1, d)) * rng.uniform(0.2, 3, (S, 1, 1))).astype(np.float16)
    v = rng.standard_normal((S, 1, d)).astype(np.float16)
    perm = rng.permutation(S)
    a = prepare(q, k, v, S - 4, Config())
    b = prepare(q, k[perm], v, S - 4, Config())
    for name in ("km", "ekm"):
        assert a.kvstat[0, COL[name]].view(np.uint32) == b.kvstat[0, COL[name]].view(np.uint32), name
    khat = a.khat[0, :S].astype(F32)
    y = ((k[:, 0].astype(F32) - a.kmean[0]) * (F32(1) / a.kg[0])).astype(F32)
    for name, norms in (("km", nrm(khat)), ("ekm", nrm(y - khat))):
        np.testing.assert_allclose(a.kvstat[0, COL[name]], norms.astype(np.float64).mean(), rtol=2**-10)
    vn = nrm(v[:, 0].astype(F32)).astype(np.float64)
    np.testing.assert_allclose(a.kvstat[0, COL["vm"]], vn.mean(), rtol=2**-10)


@pytest.mark.parametrize("eps", [0.005, 0.05])
def test_estimate_calibration_on_the_builtin_dump(eps):
    """§9.8's claim on real data (SmolLM2 L14, 4608 pairs): err_est ≥ ‖out − float64 attention‖ on at
    least 99.9 % of pairs, and not loose: median est/error below 8 (docs/accuracy.md has the exact
    figures). ε = 0.005 leaves the error to pass 2, ε = 0.05 moves much of it to the cold tiles."""
    dump = read_dump(builtin_dump_path())
    cfg = Config(eps=eps)
    res = attention(dump.q, dump.k, dump.v, dump.q_offset, cfg, workers=2)
    err = np.linalg.norm(res.out.astype(np.float64) - reference(dump.q, dump.k, dump.v, dump.q_offset, cfg), axis=-1)
    est = res.err_est.astype(np.float64)
    assert res.err_est.dtype == np.float32 and est.shape == err.shape and np.isfinite(est).all()
    cover, tight = (est >= err).mean(), np.median(est[err > 0] / err[err > 0])
    assert cover >= 0.999, cover
    assert 1 < tight < 8, tight
    assert 0.05 < res.hot_share < 0.95  # both passes carry error


def test_estimate_with_every_quantization_off_is_the_final_rounding():
    """With the operands unquantized and binary32 arithmetic (`exact`), §9.8's model terms are ~2⁻²⁴ and
    F2, the final FP16 rounding's actual error, is what remains: the estimate covers every pair and is a
    small multiple of that rounding; with the default toggles it is hundreds of times larger."""
    q, k, v, off = mixed_problem(64)
    exact = Config(eps=0.3, mma="exact", quant_q=False, quant_k=False, quant_v=False, quant_p=False, p2_accum="f32")
    res, dflt = attention(q, k, v, off, exact), attention(q, k, v, off, Config(eps=0.3))
    ref = reference(q, k, v, off, exact)
    err = np.linalg.norm(res.out.astype(np.float64) - ref, axis=-1)
    f16_ulp = np.linalg.norm(ref, axis=-1) * 2.0**-11
    assert np.all(res.err_est >= err)
    assert np.all(res.err_est <= 3 * f16_ulp)
    assert np.median(dflt.err_est / res.err_est) > 100


def test_estimate_not_computed_rows_and_nonfinite():
    """Rows outside the chosen warps hold NaN (as out and err_bound); a row whose output is not finite
    gets +inf (§9.8 step 7)."""
    q, k, v, off = mixed_problem(64)
    res = attention(q, k, v, off, Config(eps=0.3), warps={(0, 0, 0)})
    done = ~np.isnan(res.err_bound)
    assert done.any() and (~done).any()
    np.testing.assert_array_equal(np.isnan(res.err_est), ~done)
    big = (q.astype(np.float32) * 400).astype(np.float16)  # pass 2's FP16 scores overflow (§8.7)
    with pytest.warns(Warning):
        hot = attention(big, k * np.float16(8), v, off, Config(eps=-1.0))
    bad = ~np.isfinite(hot.out.astype(np.float32)).all(axis=-1)
    assert bad.any()
    assert np.all(np.isinf(hot.err_est[bad]))


def test_pair_cold_shares_are_the_cold_tiles_square_sums(monkeypatch):
    """``apa pair``'s per-tile budget: each cold visit's term of ws1 (the trace's t2 rescaled to the final
    frame, §7.9–7.10) against a float64 Σ P̂² of the emulator's own P̂ of that tile in the same frames, and
    the terms summed against the row's ws1, on a row with both hot and cold tiles.

    Tolerances: a tile's t2 is the `sm90` chain of §7.6, 4 k-steps each within 2⁻²⁰ of its largest
    partial sum (§9.7, why 1), all terms non-negative: 2⁻¹⁸ of the float64 sum. ws1 adds per visit one
    binary32 add (2⁻²⁴), at a frame move (ws ⊗ α) ⊗ α with α = exp2s within one ulp (§2.1): 3·2⁻²³, and
    ⊗ Kf twice at export: under 2⁻¹⁸ + (visits + 1)·2⁻²¹ of the float64 sum of the terms."""
    from apa_emu import api, attention, pass1
    from apa_emu.study.commands.pair import pair
    from apa_emu.study.synth import synthetic

    dump = synthetic(16, 1024, 2, 1, 64, seed=4)
    cfg, row, head = Config(eps=0.1), 5, 1
    report = pair(dump, cfg, row, head, backend="cpu")
    hot = [b.hot for b in report.budget]
    assert any(hot) and not all(hot), hot

    # The emulator's P̂ and frame after each visit of the pair's warp, from pass 1 run in Python with its
    # jitted steps, p1_branch wrapped to record them.
    lane, branch, seen = (row * dump.group + head % dump.group) % ROWS, pass1.p1_branch, []

    def record(hot, t, tl2, t2, c, rows, ops, k, mode, phat, pcodes, pscales, amass, st, hot_words):
        branch(hot, t, tl2, t2, c, rows, ops, k, mode, phat, pcodes, pscales, amass, st, hot_words)
        seen.append((hot, phat[lane].astype(np.float64), float(st.m[lane])))

    monkeypatch.setattr(pass1, "p1_branch", record)
    monkeypatch.setattr(api, "pass1_warp", pass1.pass1_warp.py_func)
    G = dump.group
    attention(dump.q, dump.k, dump.v, dump.q_offset, cfg, warps=[(0, head // G, (row * G + head % G) // ROWS)])
    assert [h for h, _, _ in seen] == hot
    kf, m1 = float(cfg.pass1_consts().Kf), seen[-1][2]
    want = np.array([0.0 if h else (p * p).sum() * 4.0 ** (m - m1) * kf * kf for h, p, m in seen])
    got = np.array([b.cold for b in report.budget])
    np.testing.assert_allclose(got, want, rtol=2.0**-18, atol=0)
    tol = 2.0**-18 + (len(seen) + 1) * 2.0**-21
    assert abs(report.ws1 - want.sum()) <= tol * want.sum()
    assert abs(report.budget[-1].cumulative - 1) <= tol
    assert any(m != m1 for h, _, m in seen if not h)  # a cold tile before a frame move: its t2 is rescaled
