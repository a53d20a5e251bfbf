"""tools/est_fit.py: its per-pair terms are §9.8's, each one needed (they give the engine's err_est back,
and with any group left out they do not, on a problem where both passes carry error), its coverage and
median at the present constants are ``apa scan``'s, and a multiplier moves them the way it must."""

from __future__ import annotations

import numpy as np
import pytest

from apa_emu import Config
from apa_emu.study.scan import Pairs, run_pairs
from apa_emu.study.synth import synthetic
from helpers import load_tool

est_fit = load_tool("est_fit")

DUMP = synthetic(32, 2048, 2, 1, 64, seed=3)  # at ε = 0.05 about 0.7 of its tiles hot
CFG = Config(eps=0.05)


@pytest.fixture(scope="module")
def fitted():
    scan = run_pairs(DUMP, CFG, Pairs.select(DUMP.n, DUMP.nh), backend="cpu", trace=True)
    return scan, est_fit.pair_terms(DUMP, scan, CFG)


def test_the_terms_give_err_est_back_and_each_group_counts(fitted):
    scan, data = fitted
    assert 0 < scan.hot_share < 1  # cold and hot keys both weigh
    got = est_fit.estimate(data["terms"], data["z"], {})
    np.testing.assert_allclose(got, data["est"], rtol=1e-5)
    for g in est_fit.GROUPS:
        assert data["terms"][g].max() > 0, g
        without = est_fit.estimate(data["terms"], data["z"], {g: 0.0})
        assert np.max(np.abs(without / data["est"] - 1)) > 1e-3, g  # a group the sum can do without is no term


def test_judge_at_the_present_constants_is_the_scans(fitted):
    scan, data = fitted
    now = est_fit.judge(data, data["z"], {})
    assert data["error"].size == scan.error.size  # every pair of the problem, none dropped
    assert now["coverage"] == pytest.approx(scan.estimate["coverage"])
    assert now["median"] == pytest.approx(scan.estimate["est_over_err_median"])
    assert now["over30"] == scan.estimate["over_30"]


def test_a_larger_multiplier_covers_more_and_is_looser(fitted):
    _, data = fitted
    lo, hi = (est_fit.judge(data, data["z"], {g: m for g in est_fit.GROUPS}) for m in (0.25, 4.0))
    assert lo["coverage"] < hi["coverage"] and lo["median"] < hi["median"]


@pytest.mark.parametrize("argv, message", [
    (["--try", "0,0,0"], "--try takes 4 exponents"),
    (["--try", "a,b,c,d"], "--try takes integers"),
    (["--coverage", "1.5"], "--coverage must lie in (0, 1]"),
])
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        est_fit.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_existing_json_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "fit.json"
    out.write_text("keep")
    with pytest.raises(SystemExit):
        est_fit.main(["--json", str(out)])
    assert out.read_text() == "keep" and "not overwritten" in capsys.readouterr().err
