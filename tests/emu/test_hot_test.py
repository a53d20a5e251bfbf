"""The output hot test (numerics.md §5.8, §7.6–7.8): ν against a float64 norm, its scale invariance
against the mass test, and the tiles it moves out of pass 2; the budget hot test (§7.7) against a
float64 oracle of its rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hyp import Seen, examples

import apa_emu.prep
from apa_emu import Config, attention
from apa_emu.api import HeadRunner
from apa_emu.geometry import GROUPS, ROWS, TILE, Shape
from apa_emu.merge import budget_beta
from apa_emu.pass1 import p1_frame, p1_phat, p1_scores
from apa_emu.prep import prep_stats, prepare, slot_map, value_weights
from apa_emu.problems import make_inputs

F32 = np.float32


def _sink_problem(seed=16, n=70, H=3, S=700, d=64):
    """Random rows over a sink key (key 0) that every query aligns with, whose value is small."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, H, d))
    k = rng.standard_normal((S, 1, d))
    v = rng.standard_normal((S, 1, d))
    k[0] += 6 * q.mean(axis=(0, 1))
    v[0] *= 0.05
    return (x.astype(np.float16) for x in (q, k, v))


@settings(deadline=None, max_examples=examples(40))
@given(st.integers(1, 300), st.sampled_from([64, 128, 256]), st.integers(0, 299),
       st.sampled_from(["consecutive", "interleaved"]), st.sampled_from([1e-6, 1.0, 3e4]), st.integers(0, 2**31 - 1))
def test_value_weights_against_float64_norms(S, d, first, groups, amp, seed):
    """ν = f16(nrm(v) ⊗ (1 ⊘ vg)) lies within 2⁻⁹ above and 2⁻¹¹ below ‖v‖/vg (float64), sits in slot
    order, and is +0 for keys past S and below the first visible key."""
    first = min(first, S - 1)
    rng = np.random.default_rng(seed)
    v = np.clip(rng.standard_normal((S, 2, d)) * amp * rng.uniform(0, 1, (S, 2, 1)), -65504, 65504).astype(np.float16)
    k = np.zeros_like(v)
    _, _, vg = prep_stats(k, v)
    T = -(-S // 64)
    interleaved = Config(p_groups=groups).prep_flags().interleaved
    nu = value_weights(v, vg, interleaved, first, T)
    assert nu.shape == (2, T, 64) and nu.dtype == F32
    by_key = np.empty_like(nu)
    by_key[..., slot_map(interleaved)] = nu
    by_key = by_key.reshape(2, T * 64)
    exact = np.linalg.norm(v.astype(np.float64), axis=2).T / vg.astype(np.float64)[:, None]  # [2, S]
    got = by_key[:, first:S].astype(np.float64)
    want = exact[:, first:]
    normal = want > 2.0**-14  # FP16 subnormal results round to an absolute quantum instead
    assert np.all(got[normal] <= want[normal] * (1 + 2.0**-9)) and np.all(got[normal] >= want[normal] * (1 - 2.0**-11))
    assert np.all(np.abs(got - want)[~normal] <= 2.0**-24 + want[~normal] * 2.0**-9)
    assert np.all(by_key[:, :first] == 0) and np.all(by_key[:, S:] == 0)
    assert np.all(got < 65504)


@pytest.mark.parametrize("groups", ["consecutive", "interleaved"])
def test_constant_weights_make_the_output_test_the_mass_test(monkeypatch, groups):
    """With every ν = 2, tv = 2·tl exactly (a power of two commutes with every rounding), so the
    output test takes the mass test's hot tiles, and its trace holds tv = 2·tl and lv = 2·la on every
    visit: lv is rescaled, and updated in both branches, exactly as la."""
    q, k, v = _sink_problem()
    mass = attention(q, k, v, 640, Config(eps=0.2, p_groups=groups), trace="all")
    monkeypatch.setattr(apa_emu.prep, "value_weights", lambda v, vg, g, f, T: np.full((v.shape[1], T, 64), F32(2)))
    out = attention(q, k, v, 640, Config(eps=0.2, p_groups=groups, hot_test="output"), trace="all")
    assert 0 < mass.hot_tiles < mass.active_tiles  # hot and cold tiles both occur
    np.testing.assert_array_equal(out.hot, mass.hot)
    np.testing.assert_array_equal(out.out.view(np.uint16), mass.out.view(np.uint16))
    vis, ref = out.visits, mass.visits
    assert (ref["m"][:, None, :] != ref["c"][:, None, :]).any() and (np.diff(ref["m"], axis=0) != 0).any()
    np.testing.assert_array_equal(vis["tv"], 2 * vis["tl"])
    np.testing.assert_array_equal(vis["lv"], 2 * vis["la"])
    assert not ref["tv"].any() and not ref["lv"].any()  # the mass test traces them as +0 (§10)


def test_zero_values_are_never_hot_under_the_output_test():
    """A sink tile whose keys carry zero values holds most of the mass, so the mass test makes it hot
    in every warp; it adds nothing to the output, and the output test (tv = 0) never makes it hot."""
    q, k, v = _sink_problem()
    v[:64] = 0
    seen = Seen()
    for ht in ("mass", "output"):
        res = attention(q, k, v, 640, Config(eps=0.2, hot_test=ht), trace="all")
        tile0 = res.visits["tile"] == 0
        seen[ht + "_tile0_hot"] = int(res.visits["hot"][tile0].sum())
        seen[ht + "_visits"] = int(tile0.sum())
        if ht == "output":
            assert not res.visits["tv"][tile0].any()
    assert seen["mass_tile0_hot"] == seen["mass_visits"] > 0
    assert seen["output_tile0_hot"] == 0


def test_hot_test_choice_is_checked():
    with pytest.raises(ValueError, match="hot_test='value'"):
        Config(hot_test="value")
    assert Config.from_overrides(["hot_test=output"]).hot_test == "output"


def _beta64(eps, cq, qstat, kvstat, d):
    """§7.7's βr in float64 from prep's binary32 inputs (§9.8 steps 1–2, ρ = 2⁻⁷ with P' quantized)."""
    km, ekm, vm, evm = (float(x) for x in kvstat[5:9])
    qn, eq = qstat[:, 0].astype(np.float64), qstat[:, 1].astype(np.float64)
    s1 = ((eq * km) ** 2 + (qn * ekm) ** 2) * (cq.astype(np.float64) * np.log(2.0)) ** 2 * 2 / d
    return eps**2 * vm**2 / ((s1 + 2.0**-7) * vm**2 + evm**2)


def _scale(x, to):
    """2^(x − to) in float64, 1 where x = to (both −inf included)."""
    with np.errstate(invalid="ignore"):
        return np.where(x == to, 1.0, np.exp2(x.astype(np.float64) - to.astype(np.float64)))


def _judge(over, fits, hot: bool, seen, where: str) -> None:
    """A visit's verdict against the rule: hot when a row is over budget, cold when every row fits;
    between the two, counted only."""
    if over.any():
        assert hot, f"{where}: rows {np.flatnonzero(over)} over budget, tile cold"
        seen["over_budget_hot"] += 1
    elif fits.all():
        assert not hot, f"{where}: every row within budget, tile hot"
        seen["within_budget_cold"] += 1
    else:
        seen["borderline"] += 1


def _check_budget_rule(q, k, v, off, cfg, seen, tol=1e-3):
    """Replays every warp's visits (the trace's frames, the emulator's own P̂ per visit) and holds each
    verdict against the rule of §7.7 in float64: hot where a row's ((ws·a²) + t2) exceeds βr·L² by more
    than tol, cold where every row's stays below by more than tol (between: counted, not judged); ws is
    the float64 Σ P̂² of the row's cold visits in the current frame, and at the end ws1 = ws·Kf² (§7.10)."""
    res = attention(q, k, v, off, cfg, trace="all")
    n, H, d = q.shape
    S, Hkv = k.shape[:2]
    G = H // Hkv
    shape = Shape(B=1, n=n, H=H, Hkv=Hkv, S=S, d=d, q_offset=off)
    zero_s = np.zeros((ROWS, TILE), F32)
    for hk in range(Hkv):
        prep = prepare(q[:, hk * G:(hk + 1) * G], k[:, hk:hk + 1], v[:, hk:hk + 1], off, cfg, first_key=0)
        runner = HeadRunner(shape, 0, hk, prep, cfg, cfg.flags())
        mode, consts = runner.mode, runner.consts
        for w in range(shape.nw):
            wr = shape.warp_rows(w)
            ops, rows, order = runner.p1_inputs(wr)
            sel = res.visits[(res.visits["hk"] == hk) & (res.visits["warp"] == w)]
            vs = sel[np.argsort(sel["visit"])]
            np.testing.assert_array_equal(vs["tile"], order)
            ok = wr.valid
            beta = np.where(ok, _beta64(float(consts.eps), rows.cq, prep.qstat[0, np.where(ok, wr.rows, 0)],
                                        prep.kvstat[0], d), 0.0)
            m = np.full(ROWS, -np.inf, F32)
            la, ws = np.zeros(ROWS), np.zeros(ROWS)
            fit_cold = np.zeros(ROWS, bool)  # the row fitted its budget on a cold visit
            s, gm, c = np.zeros((ROWS, TILE), F32), np.zeros((ROWS, GROUPS), F32), np.zeros(ROWS, F32)
            phat, pcodes = np.zeros((ROWS, TILE), F32), np.zeros((ROWS, TILE), np.uint8)
            pscales, amass = np.zeros((ROWS, GROUPS), np.uint8), np.zeros((ROWS, GROUPS), F32)
            for rec, t in zip(vs, order):
                p1_scores(mode.model, ops, t, zero_s, s)
                p1_frame(s, t * TILE, rows, mode.slots, consts.tau, m, gm, c)
                np.testing.assert_array_equal(c[ok], rec["c"][ok])
                p1_phat(s, t * TILE, rows, gm, c, consts, mode, phat, pcodes, pscales, amass)
                t2 = (phat.astype(np.float64) ** 2).sum(axis=1)
                a = _scale(m, c)
                big = la * a + rec["tl"]
                lhs, rhs = ws * a * a + t2, beta * big * big
                over, fits = ok & (lhs > rhs * (1 + tol)), ~ok | (lhs < rhs * (1 - tol)) | (lhs == 0)
                hot = bool(rec["hot"])
                _judge(over, fits, hot, seen, f"hk {hk} warp {w} tile {t}")
                if hot:
                    seen["spent_budget"] += int((over & fit_cold).sum())  # cold earlier, then over budget and hot
                else:
                    fit_cold |= ok & fits & (t2 > 0)
                m_new = np.where(ok, rec["m"], m).astype(F32)
                with np.errstate(invalid="ignore"):  # a row without a visible key yet: ws = 0 and m = c = −inf
                    ws = np.nan_to_num(ws * _scale(m, m_new) ** 2 + (0.0 if hot else t2 * _scale(c, m_new) ** 2))
                m, la = m_new, rec["la"].astype(np.float64)
            got = res.rows[(res.rows["hk"] == hk) & (res.rows["row"] // ROWS == w)]["ws1"]
            want = ws[:len(got)] * float(consts.Kf) ** 2
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-30)
    seen["cold_tiles"] += res.active_tiles - res.hot_tiles
    seen["hot_tiles"] += res.hot_tiles
    return res


def test_budget_test_follows_its_rule():
    """§7.7's budget test against a float64 oracle of its rule on random problems (sink, normal and
    diffuse keys, both tile orders, d = 64 and 128): every verdict off the boundary agrees, the cold
    Σ P̂² it spends is the exported ws1, and rows spend their budget: cold first, then over it and hot."""
    seen = Seen()

    @settings(deadline=None, max_examples=examples(8))
    @given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.integers(1, 3), st.sampled_from([64, 128]),
           st.integers(64, 800), st.sampled_from(["sink", "normal", "diffuse"]),
           st.sampled_from([0.003, 0.01, 0.03, 0.1]), st.sampled_from(["diagonal", "ascending"]))
    # the examples meet every required case whatever the draws: the sink problem hot and cold tiles,
    # the normal one, in ascending order, a row that fits its budget cold and then spends it
    @example(16, 40, 3, 64, 700, "sink", 0.02, "diagonal")
    @example(1, 16, 2, 64, 500, "normal", 0.01, "ascending")
    def prop(seed, n, G, d, S, structure, eps, order):
        q, k, v = make_inputs(seed, 1, n, 1, G, d, max(S, n), structure, batched=False)
        _check_budget_rule(q, k, v, max(S, n) - n, Config(eps=eps, hot_test="budget", tile_order=order), seen)

    prop()
    seen.require("over_budget_hot", "within_budget_cold", "spent_budget", "cold_tiles", "hot_tiles")


def test_budget_of_zero_variance_is_infinite():
    """βr = +inf where κ = +0 (§7.7: a budget nothing spends); else (ε ⊗ ε) ⊗ (X ⊘ κ), within a few
    binary32 roundings of the float64 formula."""
    kv = np.array([0, 0, 0, 0, 0, 3.5, 0.2, 1.5, 0.1], F32)
    cq, qstat = np.array([0.3, 0.2], F32), np.array([[4.0, 0.3, 4.0], [2.0, 0.0, 2.0]], F32)
    got = budget_beta(F32(0.01), cq, qstat[:, 0], qstat[:, 1], kv, F32(2.0**-7), 64)
    np.testing.assert_allclose(got, _beta64(0.01, cq, qstat, kv, 64), rtol=1e-5)
    kv[5:] = 0
    assert np.all(budget_beta(F32(0.01), cq, qstat[:, 0], qstat[:, 1], kv, F32(2.0**-7), 64) == np.inf)
