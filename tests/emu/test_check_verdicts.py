"""`apa check` never passes silently: an engine that exits or raises KeyboardInterrupt (in its call
or as it is imported) is an engine error of one line, in check and in the studies; a user's Ctrl-C
stays an interrupt; every check ends with a verdict line counting what passed and failed; outputs
non-finite on the emulator's side are compared as such; and --hypothesis leaves the working folder
as it found it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import apa_emu
from apa_emu import Config, attention
from apa_emu.compare import ToleranceReport, check
from apa_emu.engines import wrap
from apa_emu.problems import Problem, make_inputs
from apa_emu.study import cli
from apa_emu.study.cli import main
from apa_emu.study.dump import write_dump
from apa_emu.study.synth import synthetic

pytest.importorskip("hypothesis")

ROOT = Path(apa_emu.__file__).resolve().parent.parent  # the checkout under test, for a fresh interpreter
STOPS = "user_engines.stops"
# C1 of fuzz-2026-12b: every output of the emulator NaN (structure "extreme")
EXTREME = Problem.from_json({"seed": 1, "B": 1, "n": 8, "Hkv": 1, "G": 2, "d": 64, "S": 40, "structure": "extreme",
                             "batched": False, "q_offset": 32})


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """48 rows, 6/2 heads, 320 keys: 9 warps per KV head."""
    d = synthetic(48, 320, 6, 2, 64, seed=4)
    return str(write_dump(tmp_path_factory.mktemp("verdicts") / "small.apadump", d.q, d.k, d.v, d.q_offset))


def _one_error_line(capsys, words: str) -> None:
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"apa: error: {words}"), err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("spec, words", [
    (f"{STOPS}:exits0", f"engine {STOPS}:exits0 raised SystemExit: 0"),
    (f"{STOPS}:exits3", f"engine {STOPS}:exits3 raised SystemExit: 3"),
    (f"{STOPS}:interrupts", f"engine {STOPS}:interrupts raised KeyboardInterrupt"),
    ("user_engines.exits_on_import:attention",
     "engine user_engines.exits_on_import:attention: cannot import user_engines.exits_on_import: SystemExit: 0"),
])
@pytest.mark.parametrize("argv", [["check", "--warps", "0"], ["check", "--hypothesis", "1", "--seed", "1"],
                                  ["scan", "--rows", "0"]], ids=["check", "hypothesis", "scan"])
def test_an_engine_that_exits_is_an_engine_error(capsys, dump, spec, words, argv):
    command, *options = argv
    engine = ["--backend" if command == "scan" else "--engine", spec]
    dumps = [] if "--hypothesis" in options else [dump]
    assert main([command, *dumps, *options, *engine]) == cli.EXIT_ERROR
    _one_error_line(capsys, words)


def test_a_ctrl_c_while_an_engine_runs_is_an_interrupt(capsys, dump):
    assert main(["check", dump, "--warps", "0", "--engine", f"{STOPS}:ctrl_c"]) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err == "apa: interrupted\n"


def test_an_exit_outside_an_engine_is_one_line(capsys, monkeypatch):
    def stop(args):
        sys.exit(0)

    monkeypatch.setattr(cli.synth, "run", stop)
    assert main(["synth", "never-written.apadump"]) == cli.EXIT_ERROR
    _one_error_line(capsys, "stopped before a verdict: SystemExit(0)")


def _last_line(capsys) -> str:
    return capsys.readouterr().out.splitlines()[-1]


def test_every_check_ends_with_its_verdict(capsys, dump):
    # warp 0 of each of the 2 KV heads: bitwise, each head's 1 warp passes
    assert main(["check", dump, "--warps", "0", "--engine", "cpu"]) == 0
    assert _last_line(capsys) == "apa check: PASS: 2 warps passed, 0 failed"
    # in tolerance, warp 0 holds packed rows 0..15 of each KV head: 16 pairs each, all far from zeros
    assert main(["check", dump, "--warps", "0", "--engine", f"{STOPS}:zeros"]) == 1
    assert _last_line(capsys) == "apa check: FAIL: 0 pairs passed, 32 failed"
    assert main(["check", "--hypothesis", "2", "--seed", "1", "--engine", "cpu"]) == 0
    assert _last_line(capsys) == "apa check: PASS: 2 generated problems passed, 0 failed"
    assert main(["check", "--hypothesis", "3", "--seed", "1", "--engine", f"{STOPS}:zeros"]) == 1
    assert re.fullmatch(r"apa check: FAIL: \d generated problems passed, 1 failed", _last_line(capsys))


def _inf_problem():
    """Values at ±65504 in some channels: every pair of the output is +Inf in 16 channels, −Inf in 8
    and finite in the rest (§8.7's range lets the FP16 output overflow)."""
    q, k, v = make_inputs(0, 1, 16, 1, 2, 64, 128, "normal", batched=False)
    v = v.copy()
    v[..., :16], v[..., 16:24] = 65504, -65504
    return (q, k, v, 112)


def _engine(change):
    """An engine returning the emulator's output changed by ``change(out)``, in place."""
    def attention_changed(q, k, v, q_offset=0, config=None):
        out = attention(q, k, v, q_offset, config).out
        change(out)
        return out

    return wrap(attention_changed)()


@pytest.mark.filterwarnings("ignore::apa_emu.NonFiniteOutput")
@pytest.mark.parametrize("args", [EXTREME.arguments()[0], _inf_problem()], ids=["nan", "inf"])
def test_outputs_non_finite_alike_on_both_sides_agree(args):
    emu = np.asarray(attention(*args).out, np.float64)
    assert not np.isfinite(emu).all()
    outcome = check(_engine(lambda out: None), args, {}, Config(), "tolerance")
    report = outcome.report
    assert outcome.passed and report.pairs == np.prod(emu.shape[:-1])
    assert report.nonfinite == (int((~np.isfinite(emu)).any(axis=-1).sum()), 0)
    assert np.all(report.rel_l2 == 0) and report.worst()[1] == 0 and report.lines()


def _set(where, value):
    def change(out):
        out[where] = value
    return change


@pytest.mark.filterwarnings("ignore::apa_emu.NonFiniteOutput")
@pytest.mark.parametrize("change", [_set((3, 1, 0), 0.0), _set((3, 1, 0), np.nan), _set((3, 1, 0), -np.inf),
                                    _set((3, 1, 20), np.inf), _set((3, 1, slice(0, 24)), np.nan)],
                         ids=["inf-to-finite", "inf-to-nan", "inf-to-minus-inf", "minus-inf-to-inf", "infs-to-nans"])
def test_non_finite_outputs_elsewhere_or_of_another_kind_diverge(change):
    outcome = check(_engine(change), _inf_problem(), {}, Config(), "tolerance")
    report = outcome.report
    assert not outcome.passed and report.nonfinite[1] == 1
    pair, rel, _ = report.worst()
    assert pair == (3, 1) and rel == np.inf


def test_a_report_of_no_pairs_has_no_worst_pair():
    empty = np.zeros(0)
    report = ToleranceReport(0.1, 0, {}, 0, empty, empty, np.zeros((0, 2), np.int64), {})
    assert report.passed and report.worst() is None and report.worst_rel == -np.inf
    assert report.lines() == ["0 pairs: the emulator computed none of the chosen pairs"]


def test_hypothesis_writes_nothing_in_the_working_folder(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    run = subprocess.run([sys.executable, "-m", "apa_emu.study.cli", "check", "--engine", "cpu", "--hypothesis", "2",
                          "--seed", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert list(tmp_path.iterdir()) == []
    assert run.stdout.splitlines()[-1] == "apa check: PASS: 2 generated problems passed, 0 failed"
