"""tools/bench_floors.py, the floors of the two passes: its variants are literal edits of cuda/, so they
must still apply to this checkout's kernel, change only the pass they name (on the CPU simulator: the
pass-2 skeleton leaves pass 1's hot masks equal and the output not, the pass-1 variants change the hot
masks), and an edit that no longer applies is named in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_tool

ROOT = Path(__file__).resolve().parents[2]
bench_floors = load_tool("bench_floors", "bench_ab")


def test_every_variant_applies_and_edits_only_its_pass(tmp_path):
    made = bench_floors.make_variants(ROOT / "cuda", tmp_path)
    assert set(made) == set(bench_floors.VARIANTS)
    for name, d in made.items():
        changed = {p.name for p in (ROOT / "cuda").rglob("*") if p.is_file()
                   and (d / p.relative_to(ROOT / "cuda")).read_bytes() != p.read_bytes()}
        assert changed and all(n.startswith(name[:5]) for n in changed), (name, changed)  # pass1*.cuh or pass2.cuh


def test_an_edit_that_no_longer_applies_is_named(tmp_path):
    src = tmp_path / "cuda"
    shutil.copytree(ROOT / "cuda", src)
    p2 = src / "pass2.cuh"
    p2.write_text(p2.read_text().replace("    float ms_lo, ms_hi;\n", "    float ms_lo, ms_hi;  // the row maxima\n"))
    with pytest.raises(SystemExit, match=r"cuda/pass2.cuh has changed: the pass2-skeleton edit no longer applies"):
        bench_floors.make_variants(src, tmp_path / "out")


def test_on_the_simulator_each_variant_changes_its_own_pass(tmp_path):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("g++ not found (.ci/run installs it)")
    env = dict(os.environ, APA_GPU_BACKEND="sim", APA_GPU_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "tools/bench_floors.py", "--rows", "16", "--keys", "320", "--family",
                        "real-like", "--modes", "exact", "--rounds", "1", "--eps", "0.05"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    verdicts = {line.split("`")[1].split("/")[0]: line for line in r.stdout.splitlines() if line.startswith("* `")}
    assert set(verdicts) == set(bench_floors.VARIANTS), r.stdout
    for name in ("pass1-skeleton", "pass1-no-rounding"):
        assert "hot DIFF" in verdicts[name], verdicts[name]
    assert "out DIFF" in verdicts["pass2-skeleton"] and "hot EQUAL" in verdicts["pass2-skeleton"]
    assert "kvstat EQUAL" in verdicts["pass2-skeleton"]
    assert "Floors:" not in r.stdout  # no times on the simulator, so no floors table


def test_existing_out_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "floors.md"
    out.write_text("kept\n")
    with pytest.raises(SystemExit):
        bench_floors.main(["--out", str(out)])
    assert "exists; not overwritten" in capsys.readouterr().err and out.read_text() == "kept\n"


def test_the_floors_table_sums_each_pass_and_its_skeleton():
    args = type("A", (), {"family": ["real-like"], "modes": ["fast"]})()
    names = ["kernel", *bench_floors.VARIANTS]
    run = {"prep": 1.0, "apa_pass1": 8.0, "apa_pass2": 2.0}
    times = {(0, "real-like", "fast"): [run, run],
             (1, "real-like", "fast"): [run | {"apa_pass1": 3.0}, run | {"apa_pass1": 4.0}],  # pass1-skeleton
             (2, "real-like", "fast"): [run | {"apa_pass1": 7.0}],                           # pass1-no-rounding
             (3, "real-like", "fast"): [run | {"apa_pass2": 1.5}]}                           # pass2-skeleton
    row = bench_floors.floors(args, names, times, {"real-like": 5.0})[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # prep, pass 1, its skeleton (mean of 3 and 4), without rounding, pass 2, its skeleton, 1 + 8 + 2, 1 + 3.5 + 1.5
    assert cells[2:] == ["1.000", "8.000", "3.500", "7.000", "2.000", "1.500", "11.000", "6.000", "5.000",
                         "2.20×", "1.20×"], cells
    no_cudnn = bench_floors.floors(args, names, times, {})[-1]
    assert no_cudnn.rstrip(" |").endswith("— | — | —"), no_cudnn
