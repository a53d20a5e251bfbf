"""tools/target_knob.py: its refinement, run for real, is what it counts. A flagged warp run again with
every tile hot gives the all-hot run's errors on every pair of that warp and its active tiles; the
others keep the base run's. So the tool's hot share and coverage must equal those of the base run's
outputs merged per warp with the all-hot run's, recounted here from the two runs' hot masks and
outputs against float64 attention."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from apa_emu import Config, attention
from apa_emu.geometry import ROWS
from apa_emu.reference import reference
from apa_emu.study.dump import write_dump
from apa_emu.study.synth import synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import target_knob  # noqa: E402

DUMP = synthetic(64, 2048, 2, 1, 64, seed=5)
BASE = "mass:0.05"


@pytest.fixture(scope="module")
def measured():
    return target_knob.measure(DUMP, [BASE], "cpu", 1)


def test_refinement_counts_what_the_two_runs_give(measured):
    q, k, v = (np.asarray(x) for x in (DUMP.q, DUMP.k, DUMP.v))
    off = DUMP.q_offset
    base, every = attention(q, k, v, off, Config(eps=0.05)), attention(q, k, v, off, Config(eps=-1.0))
    ref = reference(q, k, v, off, Config())
    rel = {name: np.linalg.norm(r.out.astype(np.float64) - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
           for name, r in (("base", base), ("all", every))}
    hot = {name: np.unpackbits(r.hot[0].view(np.uint8), axis=-1).sum(axis=-1) for name, r in (("base", base), ("all", every))}
    ratio = base.err_est / np.linalg.norm(base.out.astype(np.float64), axis=-1)  # [n, H]
    G = DUMP.group
    i, h = np.meshgrid(np.arange(DUMP.n), np.arange(DUMP.nh), indexing="ij")
    warp = (i * G + h % G) // ROWS
    seen = 0
    for T in (0.002, 0.01, 0.05):
        got = target_knob.refine(measured, BASE, T, 1.0)
        flagged_warps = {(hh // G, w) for hh, w, fl in zip(h.ravel(), warp.ravel(), (ratio > T).ravel()) if fl}
        keep = np.array([[(hh // G, w) not in flagged_warps for hh, w in zip(hr, wr)] for hr, wr in zip(h, warp)])
        want_rel = np.where(keep, rel["base"], rel["all"])
        want_hot = sum(hot["all" if (hk, w) in flagged_warps else "base"][hk, w]
                       for hk in range(hot["all"].shape[0]) for w in range(hot["all"].shape[1]))
        assert got["hot_share"] == pytest.approx(want_hot / hot["all"].sum(), abs=1e-12)
        assert got["coverage"] == pytest.approx(np.mean(want_rel <= T), abs=1e-12)
        assert got["flagged"] == pytest.approx(np.mean(ratio > T), abs=1e-12)
        seen += 0 < len(flagged_warps) < hot["all"].size  # some warps refined and some not
    assert seen >= 1
    assert target_knob.refine(measured, BASE, np.inf, 1.0)["hot_share"] == pytest.approx(base.hot_share)


def test_lower_targets_refine_more_up_to_every_tile(measured):
    """A lower T flags a superset of pairs, so the hot share only grows, from the base's, up to every
    active tile when every pair is flagged."""
    shares = [target_knob.refine(measured, BASE, T, 1.0)["hot_share"] for T in (1.0, 0.05, 0.01, 1e-9)]
    assert shares == sorted(shares)
    assert shares[-1] == pytest.approx(1.0)


def test_cli_table_and_refusals(tmp_path, capsys):
    path = tmp_path / "d.apadump"
    write_dump(path, DUMP.q, DUMP.k, DUMP.v, DUMP.q_offset)
    out = tmp_path / "k.json"
    assert target_knob.main([str(path), "--bases", BASE, "--targets", "0.01", "--factors", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["base"], r["target"], r["factor"]) for r in rows} == {("mass:0.005", 0.01, 1.0), (BASE, 0.01, 1.0)}
    assert "every tile hot" in capsys.readouterr().out
    for argv, msg in (([str(path), "--json", str(out)], "not overwritten"),
                      ([str(path), "--bases", "mass:x"], "--bases mass:x"),
                      ([str(path), "--bases", "loud:0.1"], "--bases loud:0.1"),
                      ([str(path), "--targets", "0"], "positive"),
                      ([str(path), "--rows", "3-9"], "--rows 3-9: give a:b"),
                      ([str(tmp_path / "none.apadump")], "none.apadump")):
        with pytest.raises(SystemExit):
            target_knob.main(argv)
        assert msg in capsys.readouterr().err
