"""apa compare runs SageAttention2's emulated sm_90 recipe (numerics.md §16) as an engine spec, with
toggles; its worst row is the one of the recipe called here on the query padded in front, measured
against float64 attention in NumPy; a bad toggle is refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import one_error_line, standin_sfu_tables

from apa_emu import sfu
from apa_emu.peers import sage2
from apa_emu.study.cli import main
from apa_emu.study.dump import write_dump
from apa_emu.study.synth import synthetic

pytest.importorskip("rich")
SPECS = ["sageattention2-emu", "sageattention2-emu:qk_quant_gran=per_warp,pv_accum=fp32"]


@pytest.fixture(autouse=True)
def tables_are_standins(monkeypatch):
    monkeypatch.setattr(sfu, "tables", lambda path=None: standin_sfu_tables())


def test_specs_run_and_match_the_recipe(tmp_path):
    """40 query rows at the end of 200 keys, two query heads on one kv head."""
    d = synthetic(40, 200, 2, 1, 64, seed=7)
    path = write_dump(tmp_path / "s.apadump", d.q, d.k, d.v, d.q_offset)
    report = tmp_path / "c.json"
    assert main(["compare", str(path), "--engines", *SPECS, "--json", str(report)]) == 0
    worst = {r["engine"]: r["worst_cos"] for r in json.loads(report.read_text())["dumps"][0]["engines"]}
    logits = np.einsum("qhc,khc->hqk", d.q.astype(np.float64), np.repeat(d.k, 2, 1).astype(np.float64)) / 8.0
    logits = np.where(np.arange(200)[None, None] <= d.q_offset + np.arange(40)[None, :, None], logits, -np.inf)
    w = np.exp(logits - logits.max(2, keepdims=True))
    exact = np.einsum("hqk,khc->qhc", w / w.sum(2, keepdims=True), np.repeat(d.v, 2, 1).astype(np.float64))
    q = np.zeros((200, 2, 64), np.float16)
    q[d.q_offset:] = d.q
    for spec, toggles in zip(SPECS, ({}, dict(qk_quant_gran="per_warp", pv_accum="fp32"))):
        got = sage2.attention(q, d.k, d.v, tables=standin_sfu_tables(), **toggles)[d.q_offset:].astype(np.float64)
        cos = (got * exact).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(exact, axis=-1)
        assert worst[spec] == pytest.approx(cos.min(), rel=1e-9)
    assert worst[SPECS[0]] != worst[SPECS[1]]  # the toggles reached the recipe


@pytest.mark.parametrize("toggles,words", [
    ("quant_x=0", "sageattention2: no toggle 'quant_x'"),
    ("pv_accum=fp32+fp16", "sageattention2: pv_accum is one of fp32+fp32, fp32, got 'fp32+fp16'; 'fp32+fp16' is the sm_89"),
    ("smooth_k=2", "sageattention2: smooth_k takes 0/1/true/false")])
def test_bad_toggle_is_one_line(capsys, tmp_path, toggles, words):
    spec = f"sageattention2-emu:{toggles}"
    one_error_line(capsys, ["compare", str(tmp_path / "absent.apadump"), "--engines", spec],
                   f"engine {spec!r}: {words}")
