"""The output hot test (numerics.md §5.8, §7.6–7.8): ν against a float64 norm, its scale invariance
against the mass test, and the tiles it moves out of pass 2."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hyp import Seen, examples

import apa_emu.prep
from apa_emu import Config, attention
from apa_emu.prep import prep_stats, slot_keys, value_weights

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
    nu = value_weights(v, vg, groups, first, T)
    assert nu.shape == (2, T, 64) and nu.dtype == F32
    by_key = np.empty_like(nu)
    by_key[..., slot_keys(groups)] = nu
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
