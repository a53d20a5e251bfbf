"""apa compare runs SageAttention3's emulated recipe (numerics.md §15) as engine specs: as published and
with the causal path corrected; each row is checked against the recipe called here on the query padded
in front, and float64 attention in NumPy; a bad toggle is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import one_error_line, standin_sfu_tables

from apa_emu import sfu
from apa_emu.peers import sage3
from apa_emu.study.cli import main
from apa_emu.study.dump import write_dump
from apa_emu.study.synth import synthetic

pytest.importorskip("rich")
SPECS = ["sageattention3-emu", "sageattention3-emu:causal_dropped_tile=0"]


@pytest.fixture(autouse=True)
def standin_tables(monkeypatch):
    monkeypatch.setattr(sfu, "tables", lambda path=None: standin_sfu_tables())


def _worst_cos(out, ref) -> float:
    x, y = out.reshape(-1, out.shape[-1]).astype(np.float64), ref.reshape(-1, ref.shape[-1])
    return float(((x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))).min())


def test_both_variants_run_and_match_the_recipe(tmp_path):
    """Rows 224..255 of 256 keys lie in query block 1, where the published path drops key tile 0."""
    d = synthetic(32, 256, 2, 1, 64, seed=4)
    path = write_dump(tmp_path / "s.apadump", d.q, d.k, d.v, d.q_offset)
    out = tmp_path / "c.json"
    assert main(["compare", str(path), "--engines", *SPECS, "--json", str(out)]) == 0
    rows = {r["engine"]: r for r in json.loads(out.read_text())["dumps"][0]["engines"]}
    kk, vv = (np.repeat(x.astype(np.float64), 2, axis=1) for x in (d.k, d.v))
    s = np.einsum("nhd,khd->hnk", d.q.astype(np.float64), kk) / 8.0
    s[:, np.arange(256)[None, :] > d.q_offset + np.arange(32)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    ref = np.einsum("hnk,khd->nhd", p / p.sum(axis=2, keepdims=True), vv)
    q = np.zeros((256, 2, 64), np.float16)
    q[d.q_offset:] = d.q
    for spec, dropped in zip(SPECS, (True, False)):
        want = sage3.attention(q, d.k, d.v, causal_dropped_tile=dropped, tables=standin_sfu_tables())[d.q_offset:]
        assert rows[spec]["worst_cos"] == pytest.approx(_worst_cos(want, ref), rel=1e-9)
    assert rows[SPECS[0]]["worst_cos"] < rows[SPECS[1]]["worst_cos"]


def test_bad_toggle_is_refused_in_one_line(capsys, tmp_path):
    missing = str(tmp_path / "absent.apadump")
    one_error_line(capsys, ["compare", missing, "--engines", "sageattention3-emu:quant_x=0"],
                   "engine 'sageattention3-emu:quant_x=0': sageattention3: no toggle 'quant_x'")
    one_error_line(capsys, ["compare", missing, "--engines", "sageattention3-emu:quant_p=2"],
                   "engine 'sageattention3-emu:quant_p=2': sageattention3: quant_p takes 0/1/true/false")
