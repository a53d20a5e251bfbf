"""Options and inputs the commands must refuse in one line or honour exactly: a local cluster larger
than the CPUs is clamped as --workers is; --max-rel-l2 takes only a finite number >= 0; worst --by est
refuses a run with no estimate; sweep's JSON config says what ran; option values that begin with '-'
(--heads -1:2, --eps -inf) reach their option; a binary --text file is named."""

from __future__ import annotations

import json
import os

import pytest
from helpers import one_error_line, tiny_dump

import apa_emu
from apa_emu import Config
from apa_emu.engines import wrap
from apa_emu.study import cluster
from apa_emu.study.cli import main
from apa_emu.study.commands.worst import worst_jobs
from apa_emu.study.dump import read_dump
from apa_emu.study.scan import Job


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    return tiny_dump(tmp_path_factory.mktemp("options"))


def test_a_local_cluster_is_clamped_to_the_cpus_like_workers(capsys):
    cpus = len(os.sched_getaffinity(0))
    assert cluster.parse("local:99999").workers == cpus
    assert capsys.readouterr().err == f"apa: note: --cluster local:99999 is more than the {cpus} CPUs available: " \
                                      f"using {cpus}\n"
    assert cluster.parse(f"local:{cpus}").workers == cpus


@pytest.mark.parametrize("bound", ["-1", "nan", "inf", "abc"])
def test_max_rel_l2_must_be_a_finite_number_at_least_zero(capsys, dump, bound):
    one_error_line(capsys, ["check", "--engine", "cpu", "--max-rel-l2", bound, dump],
              f"check: argument --max-rel-l2: expected a finite number >= 0, got '{bound}'")


def test_worst_by_est_refuses_an_engine_with_no_estimate(dump):
    def out_only(q, k, v, q_offset=0, config=None):
        return apa_emu.attention(q, k, v, q_offset, config).out

    with pytest.raises(ValueError, match=r"^--by est: engine out_only gives no pair a finite err_est / \|out\|"):
        worst_jobs([Job.of(read_dump(dump))], Config(), 3, wrap(out_only)(), by="est")


def test_sweep_json_config_says_what_ran(capsys, dump):
    assert main(["sweep", dump, "--hot-tests", "mass", "--config", "hot_test=output", "eps=0.3", "--eps", "0.01",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["hot_test"] for r in report["sweep"]] == ["mass"] and [r["eps"] for r in report["sweep"]] == [0.01]
    assert report["swept"] == ["eps", "hot_test"]
    assert report["config"]["hot_test"] is None and report["config"]["eps"] is None
    assert report["config"]["mma"] == Config().mma  # the fields no row overrides stay as they ran


@pytest.mark.parametrize("argv, words", [
    (["scan", "{dump}", "--heads", "-1:2"], "--heads"),
    (["sweep", "{dump}", "--eps", "-inf"], "config.eps=-inf"),
    (["sweep", "{dump}", "--eps", "-1", "nan"], "config.eps=nan"),
])
def test_a_value_that_begins_with_a_minus_reaches_its_option(capsys, dump, argv, words):
    one_error_line(capsys, [a.format(dump=dump) for a in argv], words)


def test_a_binary_text_file_is_named(capsys, dump, tmp_path):
    pytest.importorskip("tokenizers")
    argv = ["smollm2", str(tmp_path / "sm"), "--text", dump]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"apa: error: {dump}: not UTF-8 text ("), err
