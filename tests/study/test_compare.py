"""apa compare: every engine's row against the same numbers computed here, from each engine's output
obtained independently (the emulator's attention call, the recipe on a query padded here, a float32
and a float64 attention written here) and float64 attention in NumPy; the baseline's gap is 0; bad
specs and engines that cannot run are one line each; the JSON, Markdown and plot outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import one_error_line, standin_sfu_tables, tiny_dump

import apa_emu
from apa_emu import Config, sfu
from apa_emu.peers import sageattn
from apa_emu.study.cli import main
from apa_emu.study.dump import read_dump, write_dump
from apa_emu.study.synth import synthetic

pytest.importorskip("rich")
ENGINES = ["apa:eps=0.005", "apa:hot_test=budget,eps=0.01", "sdpa-fp16", "fp16-exact", "sageattention-emu"]


def _cuda_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    return tiny_dump(tmp_path_factory.mktemp("compare"))


@pytest.fixture(autouse=True)
def standin_tables(monkeypatch):
    """The recipe's special functions from correctly rounded tables, whatever tables the checkout holds."""
    monkeypatch.setattr(sfu, "tables", lambda path=None: standin_sfu_tables())


def _attention(q, k, v, q_offset, dtype):
    """Causal attention of every (row, head) in ``dtype`` (float32: an FP16 kernel's stand-in; float64:
    the reference), scale 1/sqrt(d)."""
    n, nh, d = q.shape
    g = nh // k.shape[1]
    kk, vv = (np.repeat(x.astype(dtype), g, axis=1) for x in (k, v))
    s = np.einsum("nhd,khd->hnk", q.astype(dtype), kk) * dtype(1 / np.sqrt(d))  # ok: test oracle
    s[:, np.arange(k.shape[0])[None, :] > q_offset + np.arange(n)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    return np.einsum("hnk,khd->nhd", p / p.sum(axis=2, keepdims=True), vv)  # ok: test oracle


def _outputs(d) -> dict:
    """Each engine's FP16 output, computed without apa compare."""
    q = np.zeros((d.q_offset + d.n, d.nh, d.hd), np.float16)
    q[d.q_offset:] = d.q
    last = d.q_offset + d.n
    sage = sageattn.attention(q, d.k[:last], d.v[:last], tables=standin_sfu_tables())[d.q_offset:]
    apa = {spec: apa_emu.attention(d.q, d.k, d.v, d.q_offset, Config.from_overrides(spec[4:].split(","))).out
           for spec in ("apa:eps=0.005", "apa:hot_test=budget,eps=0.01", "apa:eps=1e9")}
    return {**apa, "sdpa-fp16": _attention(d.q, d.k, d.v, d.q_offset, np.float32).astype(np.float16),
            "fp16-exact": _attention(d.q, d.k, d.v, d.q_offset, np.float64).astype(np.float16),
            "sageattention-emu": sage}


def _cos_rel(out, ref):
    x, y = out.reshape(-1, out.shape[-1]).astype(np.float64), ref.reshape(-1, ref.shape[-1])
    rel = np.linalg.norm(x - y, axis=1) / np.linalg.norm(y, axis=1)
    return (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)), rel


@pytest.mark.skipif(_cuda_torch(), reason="sdpa-fp16 is torch's kernel where torch has a CUDA device")
def test_each_engine_row_matches_an_independent_computation(dump, tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["compare", dump, "--engines", *ENGINES, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["dumps"][0]["engines"]
    assert [r["engine"] for r in rows] == [*ENGINES, "apa:eps=1e9"] and report["baseline"] == "apa:eps=1e9"
    d = read_dump(Path(dump))
    ref = _attention(d.q, d.k, d.v, d.q_offset, np.float64)
    outputs = _outputs(d)
    fp4 = _cos_rel(outputs["apa:eps=1e9"], ref)[1]
    for row in rows:
        cos, rel = _cos_rel(outputs[row["engine"]], ref)
        want = dict(pairs=d.n * d.nh, worst_cos=cos.min(), below_0_999=int((cos < 0.999).sum()),
                    below_0_99=int((cos < 0.99).sum()), mean_cos=cos.mean(), rel_l2_median=np.median(rel),
                    rel_l2_p99=np.quantile(rel, 0.99), rel_l2_max=rel.max(), gap_recovered=1 - rel.mean() / fp4.mean(),
                    nonfinite=0)
        # the float32 stand-in here sums in another order than apa compare's: a few FP16 outputs differ by an ulp
        tol = 1e-3 if row["engine"] == "sdpa-fp16" else 1e-9
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=tol, abs=1e-12), (row["engine"], key)
        assert (row["hot_share"] is None) == (not row["engine"].startswith("apa:"))
        assert (row["seconds"] is None) == (row["engine"] == "fp16-exact")
    by = {r["engine"]: r for r in rows}
    assert by["apa:eps=1e9"]["gap_recovered"] == 0 and by["apa:eps=1e9"]["hot_share"] == 0
    assert by["fp16-exact"]["gap_recovered"] > 0.99 and by["sdpa-fp16"]["gap_recovered"] > 0.99
    assert f"wrote {out}" in capsys.readouterr().out


def test_tables_have_one_row_per_engine_and_a_pooled_table(dump, capsys):
    assert main(["compare", dump, dump, "--engines", "apa:eps=1e9", "fp16-exact"]) == 0
    text = capsys.readouterr().out
    assert text.count("apa compare tiny.apadump") == 2 and "2 dumps pooled" in text
    names = re.findall(r"^│\s+(\S+) │", text, re.M)
    assert names == ["apa:eps=1e9", "fp16-exact"] * 3  # listed, pure FP4 is the baseline: no extra row


def test_markdown_tables(dump, capsys):
    assert main(["compare", dump, "--engines", "fp16-exact", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0].startswith("| engine | device | pairs | worst_cos") and set(table[1]) <= set("|-:")
    assert [line.split(" | ")[0] for line in table[2:]] == ["| fp16-exact", "| apa:eps=1e9"]
    assert "- apa:eps=1e9: pure FP4, the baseline of the gap recovered" in lines


def test_bad_specs_are_refused_before_any_dump_is_read(capsys, tmp_path):
    missing = str(tmp_path / "absent.apadump")
    one_error_line(capsys, ["compare", missing, "--engines", "apa:eps=0.005", "flash"],
                   "engine 'flash': expected one of apa:KEY=VAL,..., sageattention, sageattention-emu, sdpa-fp16")
    one_error_line(capsys, ["compare", missing, "--engines", "apa:epsilon=1"], "engine 'apa:epsilon=1': ")
    one_error_line(capsys, ["compare", missing, "--engines", "sdpa:fast"], "engine 'sdpa:fast': expected one of")


def test_json_over_an_input_is_refused(dump, capsys):
    one_error_line(capsys, ["compare", dump, "--engines", "fp16-exact", "--json", dump], f"--json {dump}: is also an input")


@pytest.mark.skipif(_cuda_torch(), reason="the peers run where torch has a CUDA device")
def test_engines_that_cannot_run_are_named_in_one_line_and_left_out(tmp_path, capsys):
    d = synthetic(8, 96, 2, 1, 256, seed=5)
    path = str(write_dump(tmp_path / "d256.apadump", d.q, d.k, d.v, d.q_offset))
    assert main(["compare", path, "--engines", "sdpa:flash", "sageattention-emu", "fp16-exact", "--markdown"]) == 0
    out, err = capsys.readouterr()
    notes = err.splitlines()
    assert notes[0].startswith("apa: note: sdpa:flash left out: sdpa:flash needs a CUDA device")
    assert notes[1] == "apa: note: sageattention-emu left out of d256.apadump: it does not run head dim 256 " \
                       "(SageAttention runs 64, 128)"
    assert len(notes) == 2 or "sageattention left out" not in err
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ")][1:] == \
        ["| fp16-exact", "| apa:eps=1e9"]


def test_plot_is_written(dump, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "frontier.png"
    assert main(["compare", dump, "--engines", "apa:eps=0.005", "fp16-exact", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in capsys.readouterr().out


def test_record_appends_a_dated_section_and_keeps_the_page(dump, tmp_path, capsys, monkeypatch):
    page = tmp_path / "peers.md"
    before = "# Peers\n\nwritten by hand, kept\n"
    page.write_text(before, encoding="utf-8")
    argv = ["compare", dump, "--engines", "fp16-exact", "--record", str(page)]
    monkeypatch.setattr("sys.argv", ["apa", *argv])
    for run in range(2):
        assert main(argv) == 0
        text = page.read_text(encoding="utf-8")
        assert text.startswith(before.rstrip("\n")) and text.count("\n## ") == run + 1  # appended, nothing lost
        before = text
    body = text.split("\n## ")[2]
    assert f"- Command: `apa compare {dump} --engines fp16-exact --record {page}`" in body
    assert re.search(r"^- Machine: .+ \(\d+ cores\)$", body, re.M)
    assert re.search(r"^- Commit: (`[0-9a-f]{7}`( \+ uncommitted changes)?|apa-emu .+|unknown .+)$", body, re.M)
    assert "| engine | device | pairs | worst_cos" in body and "| fp16-exact |" in body
    one_error_line(capsys, ["compare", dump, "--engines", "fp16-exact", "--record", str(tmp_path / "p.txt")],
                   f"--record {tmp_path / 'p.txt'}: the file is written as MD")
