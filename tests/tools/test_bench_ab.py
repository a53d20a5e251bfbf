"""tools/bench_ab.py, the kernel sources A/B: on the CPU simulator it compares the sources' results bit for
bit (on a GPU it also times them). A copy of a source must read EQUAL and a planted bug DIFF; bad
arguments get one line each."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_tool

ROOT = Path(__file__).resolve().parents[2]
bench_ab = load_tool("bench_ab")


def _export_head(dest: Path) -> Path:
    archive = subprocess.run(["git", "archive", "HEAD", "cuda"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "cuda"


def test_a_copy_reads_equal_and_a_planted_merge_bug_diff(tmp_path):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("g++ not found (.ci/run installs it)")
    copy = _export_head(tmp_path)
    planted = tmp_path / "planted" / "cuda"
    shutil.copytree(copy, planted)
    merge = planted / "merge.cuh"
    old = "const float den = fadd(fmul(w1, l1), fmul(w2, l2));"  # mutant K3: the denominator drops w2
    assert merge.read_text().count(old) == 1
    merge.write_text(merge.read_text().replace(old, "const float den = fmul(w1, l1);"))
    env = dict(os.environ, APA_GPU_BACKEND="sim", APA_GPU_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "tools/bench_ab.py", "HEAD", str(copy), str(planted), "--rows", "16",
                        "--keys", "320", "--family", "real-like", "--modes", "exact", "--rounds", "1", "--eps", "0.05"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    verdicts = [line for line in r.stdout.splitlines() if line.startswith("* `")]
    assert len(verdicts) == 2, r.stdout
    assert verdicts[0].endswith("out EQUAL, hot EQUAL, bound EQUAL, est EQUAL, kvstat EQUAL"), verdicts[0]
    assert "out DIFF" in verdicts[1] and "hot EQUAL" in verdicts[1], verdicts[1]  # the merge runs after pass 1
    assert "round 1/1: HEAD" in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["HEAD"], "give at least two sources"),
    (["HEAD", "HEAD", "--family", "nope"], "--family nope: expected one of"),
    (["HEAD", "HEAD", "--rounds", "0"], "must be positive"),
])
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_ab.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_existing_out_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "report.md"
    out.write_text("kept\n")
    with pytest.raises(SystemExit):
        bench_ab.main(["HEAD", "HEAD", "--out", str(out)])
    assert "exists; not overwritten" in capsys.readouterr().err and out.read_text() == "kept\n"


def test_a_source_that_is_neither_a_copy_nor_a_revision_is_named(tmp_path):
    with pytest.raises(SystemExit, match=r"'no-such-rev' is neither a directory holding apa.cu nor a git revision"):
        bench_ab.source_dir("no-such-rev", tmp_path)
