"""apa attribute --peer: each variant's row is SageAttention3's recipe (numerics.md §15) run here with the
toggles its name spells, on the query padded in front, against float64 attention in NumPy; with no
operand quantized the error is tiny; a bad recipe, a recipe without toggles, a bad toggle or an APA
option is one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from helpers import one_error_line, standin_sfu_tables, tiny_dump

from apa_emu import sfu
from apa_emu.peers import sage3
from apa_emu.study.cli import main
from apa_emu.study.dump import read_dump

pytest.importorskip("rich")
WORST = 8


@pytest.fixture(autouse=True)
def standin_tables(monkeypatch):
    monkeypatch.setattr(sfu, "tables", lambda path=None: standin_sfu_tables())


def _toggles(name: str) -> dict:
    """The toggles a variant's name spells: "X only" quantizes X alone, "none" nothing, "all, KEY=V"
    flips KEY from the published default."""
    quant = [f.name for f in dataclasses.fields(sage3.Toggles) if f.name.startswith("quant_")]
    if name.endswith(" only"):
        return {k: k == "quant_" + name.split()[0].lower() for k in quant}
    if name == "none":
        return dict.fromkeys(quant, False)
    if name.startswith("all, "):
        key, val = name[len("all, "):].split("=")
        return {key: val == "1"}
    assert name == "all (default)"
    return {}


def _cosines(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    x = out.reshape(-1, out.shape[-1]).astype(np.float64)
    y = ref.reshape(-1, ref.shape[-1])
    return (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))


def _float64_attention(d) -> np.ndarray:
    kk, vv = (np.repeat(x.astype(np.float64), d.nh // d.nkv, axis=1) for x in (d.k, d.v))
    s = np.einsum("nhd,khd->hnk", d.q.astype(np.float64), kk) / np.sqrt(d.hd)
    s[:, np.arange(d.kv)[None, :] > d.q_offset + np.arange(d.n)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    return np.einsum("hnk,khd->nhd", p / p.sum(axis=2, keepdims=True), vv)


def _recipe_cosines(d, ref, toggles: dict) -> np.ndarray:
    """Cosine of every (row, head), row-major, of the recipe under ``toggles`` on the query padded in front."""
    last = d.q_offset + d.n
    q = np.zeros((last, d.nh, d.hd), np.float16)
    q[d.q_offset:] = d.q
    out = sage3.attention(q, d.k[:last], d.v[:last], tables=standin_sfu_tables(), **toggles)[d.q_offset:]
    return _cosines(out, ref)


def test_each_variant_is_the_recipe_with_its_toggles(capsys, tmp_path):
    path = tiny_dump(tmp_path)
    assert main(["attribute", path, "--peer", "sageattention3", "--worst", str(WORST), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    d = read_dump(path)
    ref = _float64_attention(d)
    flags = [f.name for f in dataclasses.fields(sage3.Toggles) if isinstance(f.default, bool)]
    quant = [k for k in flags if k.startswith("quant_")]
    assert set(report["variants"]) == {"all (default)", "none", *(k[6:].upper() + " only" for k in quant),
                                       *(f"all, {k}=0" for k in flags)}
    published = _recipe_cosines(d, ref, {})
    worst = np.argsort(published, kind="stable")[:WORST]
    assert report["pairs"] == [[int(i) // d.nh, int(i) % d.nh] for i in worst]
    for name, row in report["variants"].items():
        cos = _recipe_cosines(d, ref, _toggles(name))[worst]
        assert row["cos"] == pytest.approx(cos.tolist(), rel=1e-12, abs=1e-15), name
        assert (row["mean_cos"], row["min_cos"]) == pytest.approx((cos.mean(), cos.min()), rel=1e-12), name
    assert report["variants"]["none"]["min_cos"] > 1 - 1e-5
    assert report["variants"]["all (default)"]["min_cos"] < 0.999  # the quantization's error is visible


def test_spec_toggles_are_the_base_of_every_variant(capsys, tmp_path):
    path = tiny_dump(tmp_path)
    png = tmp_path / "heat.png"
    assert main(["attribute", path, "--peer", "sageattention3:quant_v=0", "--worst", "1", "--plot", str(png),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plot"] == str(png) and png.read_bytes().startswith(b"\x89PNG")
    assert "all, quant_v=1" in report["variants"] and "all, quant_v=0" not in report["variants"]
    assert report["peer_toggles"]["K only"]["quant_k"] and not report["peer_toggles"]["all (default)"]["quant_v"]


@pytest.mark.parametrize("argv, words", [
    (["--peer", "flash"], "no peer recipe 'flash'"),
    (["--peer", "sageattention"], "--peer sageattention: sageattention has no toggles"),
    (["--peer", "sageattention3:quant_x=0"], "--peer sageattention3:quant_x=0: sageattention3: no toggle 'quant_x'"),
    (["--peer", "sageattention3", "--config", "quant_p=off"], "--peer runs the recipe in this process"),
])
def test_bad_peer_is_one_line(capsys, tmp_path, argv, words):
    one_error_line(capsys, ["attribute", str(tmp_path / "absent.apadump"), *argv], words)
