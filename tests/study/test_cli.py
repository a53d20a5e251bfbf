"""The apa command end to end: the built-in dump, synthetic dumps, JSON output and errors."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from apa_emu import Config
from apa_emu.config import CHOICES
from apa_emu.study.cli import main
from apa_emu.study.dump import write_dump
from apa_emu.study.commands.attribute import ATTRIBUTE_VARIANTS, attribute
from apa_emu.study.scan import Pairs, run_pairs
from apa_emu.study.synth import synthetic

pytest.importorskip("rich")
ROOT = Path(__file__).resolve().parents[2]


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory):
    d = synthetic(48, 320, 6, 2, 64, seed=4)
    return d, str(write_dump(tmp_path_factory.mktemp("d") / "s.apadump", d.q, d.k, d.v, d.q_offset))


def test_scan_builtin_subset(capsys):
    out = run_json(capsys, "scan", "--rows", "500:512", "--heads", "0:3")
    s = out["summary"]
    assert s["pairs"] == 36 and 0.99 < s["pooled_cos"] <= 1.0 and 0 < s["hot_share"] <= 1
    c = out["certificate"]
    assert (c["coverage"], c["violations"], c["first_violations"]) == (1.0, 0, [])
    assert 1 <= c["bound_over_err_min"] <= c["bound_over_err_median"] and 0 < c["bound_over_ref_median"] < np.inf


def test_scan_table_and_exact_config(capsys, small_dump):
    dump, path = small_dump
    assert main(["scan", path, "--config", "mma=exact", "quant_p=off"]) == 0
    text = capsys.readouterr().out
    table = dict(re.findall(r"^│ (\S+)\s+│\s+(\S+) │$", text, re.M))
    scan = run_pairs(dump, Config(mma="exact", quant_p=False), Pairs.select(dump.n, dump.nh))
    for name, value in scan.summary.as_dict().items():
        assert float(table[name]) == pytest.approx(value, rel=1e-5), name
    assert scan.summary.pooled_cos != run_pairs(dump, Config(), Pairs.select(dump.n, dump.nh)).summary.pooled_cos
    assert (table["coverage"], table["violations"]) == ("1", "0")
    for name in ("bound_over_err_min", "bound_over_err_median", "bound_over_ref_median"):
        assert float(table[name]) == pytest.approx(scan.certificate[name], rel=1e-5), name
    bins = dict(re.findall(r"^│ (\[[^│]*?\))\s+│\s+(\d+) │$", text, re.M))
    assert {k: int(v) for k, v in bins.items()} == dict(scan.histogram[:-1])


def test_worst_pair_sweep(capsys, small_dump, tmp_path):
    _, path = small_dump
    worst = run_json(capsys, "worst", path, "-n", "3")["worst"]
    assert len(worst) == 3 and worst[0]["cos"] <= worst[1]["cos"] <= worst[2]["cos"]
    assert all(0 <= w["cold_mass_f64"] <= 1 and 1 <= w["hot_tiles"] <= w["tiles"] for w in worst)
    png = tmp_path / "p.png"
    pair = run_json(capsys, "pair", path, "--row", str(worst[0]["row"]), "--head", str(worst[0]["head"]),
                    "--plot", str(png))
    assert pair["diag"]["cos"] == pytest.approx(worst[0]["cos"])
    assert png.stat().st_size > 1000 and pair["visits"][0]["tile"] == 0
    mass = np.array(pair["tile_mass"])
    assert mass.sum() == pytest.approx(1.0)
    budget, est = pair["budget"], pair["estimate"]
    assert [b["visit"] for b in budget] == [v["visit"] for v in pair["visits"]]
    assert budget[-1]["cumulative"] == pytest.approx(1.0 if pair["ws1"] > 0 else 0.0, abs=2.0**-16)
    parts = est["cold_var"] + est["hot_var"] + est["rounding_var"]
    assert parts == pytest.approx((est["err_est"] / est["z"]) ** 2, rel=1e-5)  # F2 is the rest, up to binary32
    sweep = run_json(capsys, "sweep", path, "--eps", "-1", "0.01", "1e9", "--plot", str(tmp_path / "s.png"))["sweep"]
    assert sweep[0]["hot_share"] == 1.0 and sweep[-1]["hot_share"] == 0.0


def test_sweep_several_hot_tests(capsys, small_dump, tmp_path):
    """--hot-tests runs the ε grid under each hot test Config allows, tests outer, each run the same as a
    sweep under --config hot_test=that test, and draws them in one figure."""
    _, path = small_dump
    tests = CHOICES["hot_test"]
    argv = ["sweep", path, "--eps", "0.05", "0.5", "--rows", "24:32", "--backend", "cpu"]
    png = tmp_path / "s.png"
    both = run_json(capsys, *argv, "--hot-tests", *tests, "--plot", str(png))["sweep"]
    assert [r["hot_test"] for r in both] == [t for t in tests for _ in range(2)]
    for t in tests:
        assert run_json(capsys, *argv, "--config", f"hot_test={t}")["sweep"] == [r for r in both if r["hot_test"] == t]
    assert png.stat().st_size > 1000
    assert main([*argv, "--hot-tests", *tests]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "hot_share" in line)
    assert re.search(r"eps\s+┃\s+hot_test\s+┃\s+hot_share", header)


def test_no_plot_unless_asked(capsys, small_dump, tmp_path, monkeypatch):
    """pair, sweep and attribute wrote apa_*.png into the working folder unasked, even with --json; a
    plot the user names is written, replacing a file of that name."""
    _, path = small_dump
    monkeypatch.chdir(tmp_path)
    for argv in (["pair", path, "--row", "40", "--head", "0"], ["sweep", path, "--eps", "0.01", "--rows", "0:8"],
                 ["attribute", path, "--worst", "1", "--no-seed"]):
        assert run_json(capsys, *argv, "--backend", "cpu")["plot"] is None
        assert main([*argv, "--backend", "cpu"]) == 0
        assert "plot:" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "p.png").write_bytes(b"an older plot")
    assert run_json(capsys, "pair", path, "--row", "40", "--head", "0", "--plot", "p.png")["plot"] == "p.png"
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG\r\n") and len(list(tmp_path.iterdir())) == 1


def test_attribute_none_equals_unquantized_scan(small_dump):
    dump, _ = small_dump
    result = attribute(dump, Config(), 5, variants={"none": ATTRIBUTE_VARIANTS["none"]})
    unq = run_pairs(dump, Config(quant_q=False, quant_k=False, quant_p=False, quant_v=False), result.pairs)
    assert result.variants["none"].cos == pytest.approx(unq.cos.tolist(), rel=1e-12, abs=0)


def test_attribute_cli(capsys, small_dump):
    dump, path = small_dump
    out = run_json(capsys, "attribute", path, "--worst", "4", "--plot", "", "--eps", "1e9")  # pure FP4: no
    scan = run_pairs(dump, Config(eps=1e9), Pairs.select(dump.n, dump.nh))  # hot tile hides the seed's FP4 steps
    worst = scan.order()[:4]
    assert out["pairs"] == [[int(scan.pairs.rows[i]), int(scan.pairs.heads[i])] for i in worst]
    assert set(out["variants"]) == set(ATTRIBUTE_VARIANTS)
    assert out["variants"]["all (default)"]["cos"] == pytest.approx(scan.cos[worst].tolist(), rel=1e-12)
    for v in out["variants"].values():
        assert v["mean_cos"] == pytest.approx(np.mean(v["cos"])) and v["min_cos"] == min(v["cos"])
    # the seed column: each variant on the seed's arithmetic, over the same pairs; a variant that turns a
    # quantization off cannot run on the seed's FP4 MMA and says so
    assert set(out["seed"]) == set(ATTRIBUTE_VARIANTS)
    seed = run_pairs(dump, Config.seed(eps=1e9), scan.pairs.take(worst))
    assert out["seed"]["all (default)"]["cos"] == pytest.approx(seed.cos.tolist(), rel=1e-12)
    assert out["seed"]["all (default)"]["cos"] != out["variants"]["all (default)"]["cos"]
    assert set(out["seed_on_sm90"]) == {n for n, c in ATTRIBUTE_VARIANTS.items() if not all(
        c.get(q, True) for q in ("quant_q", "quant_k", "quant_p", "quant_v"))}
    on_sm90 = run_pairs(dump, Config.seed(eps=1e9, mma="sm90", quant_k=False, quant_p=False, quant_v=False),
                        scan.pairs.take(worst))
    assert out["seed"]["Q only (2 terms)"]["cos"] == pytest.approx(on_sm90.cos.tolist(), rel=1e-12)


@pytest.mark.parametrize("argv, message", [
    (["scan", "/nonexistent.apadump"], "No such file"),
    (["scan", "--rows", "9999:10000"], "--rows"),
    (["scan", "--config", "mma=sm100"], "config.mma"),
    (["scan", "--config", "bogus=1"], "--config"),
])
def test_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_chunked_against_whole_prompt(capsys, small_dump):
    """`apa chunked`: one chunk of every row is the whole-prompt run (one restat per KV head), whose
    numbers are `apa scan`'s; chunks of 16 rows run frozen after the first and keep the certificate."""
    _, path = small_dump
    scan = run_json(capsys, "scan", path, "--backend", "cpu")["summary"]
    one = run_json(capsys, "chunked", path, "--chunk", "48", "--backend", "cpu")["per_dump"][0]
    assert one["chunked"] == one["whole"] and one["reasons"] == [["first"]] * 2 and one["restats"] == 2
    w = one["whole"]
    assert w["hot_share"] == scan["hot_share"] and w["min_cos"] == pytest.approx(scan["min_cos"], abs=1e-12)
    three = run_json(capsys, "chunked", path, "--chunk", "16", "--backend", "cpu")["per_dump"][0]
    assert three["chunks"] == 3 and three["reasons"] == [["first", "", ""]] * 2  # 320 keys < 1.125 × 288
    assert three["whole"] == w and three["chunked"]["violations"] == 0 and three["chunked"]["min_cos"] > 0.99


def test_chunked_counts_nonfinite_pairs_apart(capsys, small_dump, tmp_path):
    """A pair whose output is not finite has no cosine: `apa chunked` counts such pairs apart, as
    `apa scan` does, instead of as cosine 0 (fuzz-2026-12 S2). q and k ×40 overflow pass 2's FP16 scores."""
    dump, _ = small_dump
    big = [(x.astype(np.float32) * 40).astype(np.float16) for x in (dump.q, dump.k)]
    path = str(write_dump(tmp_path / "ovf.apadump", big[0], big[1], dump.v, dump.q_offset))
    bad = run_json(capsys, "scan", path, "--backend", "cpu")["nonfinite"]["count"]
    whole = run_json(capsys, "chunked", path, "--chunk", "48", "--backend", "cpu")["per_dump"][0]["whole"]
    assert 0 < whole["nonfinite"] == bad < 48 * 6
    assert 0 < whole["min_cos"] <= whole["mean_cos"]


def test_readme_python_example_runs_and_shows_cold_tiles():
    """The README's Python API example runs as written (its certificate assert included), and its
    inputs leave tiles cold: with 1024 random keys every tile was hot, so it never showed what APA does.
    The hot share its comment quotes is the one it prints."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"^## Python API\n\n```python\n(.*?)^```$", readme, re.M | re.S).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    shown = re.search(r"^hot share ([0-9.]+)$", printed.getvalue(), re.M).group(1)
    quoted = re.search(r"^print\(f\"hot share .*# ([0-9.]+):", code, re.M).group(1)
    assert 0 < float(shown) < 0.5 and shown == quoted
