"""The apa command on bad input, broken output and overflow: one line and exit 2 for
every problem, strict JSON, non-finite pairs named, nothing written where it should not be."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from apa_emu import Config, attention
from apa_emu.engines import Engine
from apa_emu.study import report, scan
from apa_emu.study.cli import build_parser, main
from apa_emu.study.commands import worst
from apa_emu.study.dump import Dump, write_dump
from apa_emu.study.synth import synthetic
from apa_emu.trace import VISIT_FIELDS, row_dtype

pytest.importorskip("rich")
ROOT = Path(__file__).resolve().parents[2]


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return _strict(capsys.readouterr().out)


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("apa: error: ")
    return captured.err


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """A small synthetic dump, and a copy whose second KV head has V = 65504: pass 2's FP16 output
    overflows on query heads 3..5 and nowhere else."""
    root = tmp_path_factory.mktemp("dumps")
    d = synthetic(48, 320, 6, 2, 64, seed=4)
    v = d.v.copy()
    v[:, 1] = 65504
    return dict(good=str(write_dump(root / "good.apadump", d.q, d.k, d.v, d.q_offset)),
                hot_v=str(write_dump(root / "hot_v.apadump", d.q, d.k, v, d.q_offset)), root=root)


@pytest.mark.parametrize("argv, message", [
    (["scan", "--rows", ","], "--rows selects no query rows"),
    (["scan", "--rows", "5:2"], "--rows selects no query rows"),
    (["scan", "--heads", "3:1"], "--heads selects no heads"),
    (["scan", "--rows", "1,1,1"], "--rows '1,1,1': 1 is repeated (give each index once)"),
    (["scan", "--heads", "2,0,2"], "--heads '2,0,2': 2 is repeated (give each index once)"),
    (["worst", "--rows", "0,3,3"], "--rows '0,3,3': 3 is repeated"),
    (["worst", "-n", "-5"], "argument -n: must be at least 1, got -5"),
    (["attribute", "--worst", "-1"], "argument --worst: must be at least 1"),
    (["attribute", "--worst", "0"], "argument --worst: must be at least 1"),
    (["scan", "--workers", "0"], "argument --workers: must be at least 1"),
    (["scan", "--workers", "-1"], "argument --workers: must be at least 1"),
    (["scan", "--config", "tau=abc"], "--config 'tau=abc': tau expects an integer"),
    (["scan", "--config", "scale=abc"], "--config 'scale=abc': scale expects a number"),
    (["scan", "--config", "delta=1e39"], "config.delta=1e+39: expected a finite number within binary32 range"),
    (["scan", "--config", "eps=1e-50"], "config.eps=1e-50: expected a finite number within binary32 range"),
    (["scan", "--eps", "1e40"], "config.eps=1e+40: expected a finite number within binary32 range"),
    (["sweep", "--eps", "0.01", "1e40"], "config.eps=1e+40: expected a finite number within binary32 range"),
    (["pair", "--row", "9999", "--head", "0"], "--row: query rows must lie in 0..511"),
    (["pair", "--row", "0", "--head", "9"], "--head: heads must lie in 0..8"),
])
def test_bad_arguments_are_one_line(capsys, argv, message):
    assert message in one_line_error(capsys, argv)


@pytest.mark.parametrize("size", [["--kv", "2000000000"], ["--heads", "2000000000", "--kv-heads", "1"],
                                  ["--n", "16", "--kv", "2147483648"]])
def test_synth_refuses_absurd_sizes_before_allocating(capsys, tmp_path, monkeypatch, size):
    from apa_emu.study.commands import synth

    monkeypatch.setattr(synth, "synthetic", lambda *a, **k: pytest.fail("synthetic ran: it would allocate"))
    out = tmp_path / "abs.apadump"
    err = one_line_error(capsys, ["synth", str(out), "--n", "16", *size])
    assert re.match(r"apa: error: out of memory: apa synth: .* needs about [0-9.]+ GiB; [0-9.]+ GiB of memory "
                    r"is available$", err.strip()) and not out.exists()


def test_memory_error_is_one_line(capsys, dumps, monkeypatch):
    """The engine's up-front MemoryError (a prep that cannot fit) is one line and exit 2."""
    import apa_emu.api as api

    monkeypatch.setattr(api, "available_bytes", lambda: 2**10)
    err = one_line_error(capsys, ["scan", dumps["good"], "--backend", "cpu", "--rows", "0:1"])
    assert err.startswith("apa: error: out of memory: apa_emu: prep of one KV head of ")


@pytest.mark.parametrize("command", [["scan"], ["sweep", "--plot", ""]])
def test_dumps_of_different_head_dims_are_refused_before_any_work(capsys, dumps, tmp_path, monkeypatch, command):
    from apa_emu.study.commands import common

    d = synthetic(16, 64, 2, 1, 128, seed=1)
    wide = str(write_dump(tmp_path / "wide.apadump", d.q, d.k, d.v, d.q_offset))
    monkeypatch.setattr(common, "engine", lambda *a: pytest.fail("an engine was chosen: work began"))
    err = one_line_error(capsys, [*command, dumps["good"], wide, "--backend", "cpu"])
    assert err == (f"apa: error: {dumps['good']} has head dim 64 and {wide} has 128: apa {command[0]} pools "
                   f"their pairs, which needs dumps of one head dim (run them separately)\n")


@pytest.mark.parametrize("command", [["pair", "--row", "0", "--head", "0"], ["sweep", "--eps", "0.01"],
                                     ["attribute", "--worst", "1", "--no-seed"]])
@pytest.mark.parametrize("alias", ["same", "hardlink", "relative"])
def test_an_output_that_is_an_input_is_refused_before_any_work(capsys, dumps, tmp_path, monkeypatch, command,
                                                               alias):
    """``apa pair X --plot X`` replaced the dump with a PNG: refused in one line, the dump untouched,
    whatever name the output gives the input."""
    from apa_emu.study.commands import common

    victim = tmp_path / "victim.apadump"
    victim.write_bytes(Path(dumps["good"]).read_bytes())
    before = victim.read_bytes()
    plot = dict(same=str(victim), hardlink=str(tmp_path / "other.png"),
                relative=os.path.relpath(victim))[alias]
    if alias == "hardlink":
        os.link(victim, plot)
    monkeypatch.setattr(common, "engine", lambda *a: pytest.fail("an engine was chosen: work began"))
    err = one_line_error(capsys, [command[0], str(victim), *command[1:], "--backend", "cpu", "--plot", plot])
    assert err == f"apa: error: --plot {plot}: is also an input of this command ({victim}); refusing to overwrite it\n"
    assert victim.read_bytes() == before


def test_special_paths_are_refused(capsys, dumps, tmp_path):
    fifo = tmp_path / "fifo.apadump"
    os.mkfifo(fifo)
    assert "a FIFO, not a regular file" in one_line_error(capsys, ["scan", str(fifo)])
    synth = ["--n", "16", "--kv", "64", "--heads", "2", "--kv-heads", "1", "--d", "64"]
    assert "a directory, not a regular file" in one_line_error(capsys, ["synth", str(tmp_path), *synth])
    assert "a FIFO, not a regular file" in one_line_error(capsys, ["synth", str(fifo), *synth])
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert "a directory, not a regular file" in one_line_error(capsys, ["smollm2", str(tmp_path / "o"), "--text",
                                                                        str(tmp_path)])
    pair = ["pair", dumps["good"], "--backend", "cpu", "--row", "40", "--head", "0", "--plot"]
    assert "--plot /dev/full: a character device, not a regular file" in one_line_error(capsys, [*pair, "/dev/full"])
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def _read_only(folder: Path, monkeypatch) -> None:
    """``folder`` made read-only; root ignores the mode bits, so for root os.access reports what
    any other user would see."""
    folder.chmod(0o500)
    if os.geteuid() == 0:
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and Path(p) != folder)


@pytest.mark.parametrize("command", [["pair", "--row", "40", "--head", "0"], ["sweep", "--eps", "0.01"],
                                     ["attribute", "--worst", "1"]])
@pytest.mark.parametrize("case", ["missing folder", "file as folder", "read-only folder", "a folder", "not .png"])
def test_an_unwritable_plot_is_refused_before_any_work(capsys, dumps, tmp_path, monkeypatch, command, case):
    """A plot that cannot be written was an error after the whole study, its tables lost: now one line
    naming --plot and the path, before any dump is read."""
    from apa_emu.study.commands import common

    (tmp_path / "plain").write_text("x")
    (tmp_path / "ro").mkdir()
    (tmp_path / "dir.png").mkdir()
    plot, why = {"missing folder": ("none/p.png", f"folder {tmp_path / 'none'} does not exist"),
                 "file as folder": ("plain/p.png", f"{tmp_path / 'plain'} is not a folder"),
                 "read-only folder": ("ro/p.png", f"folder {tmp_path / 'ro'} is not writable"),
                 "a folder": ("dir.png", "a directory, not a regular file: refusing to replace it"),
                 "not .png": ("p.pdf", "the file is written as PNG; give a name ending in .png")}[case]
    if case == "read-only folder":
        _read_only(tmp_path / "ro", monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "read_dump", lambda *a, **k: pytest.fail("a dump was read: work began"))
    err = one_line_error(capsys, [command[0], dumps["good"], *command[1:], "--backend", "cpu", "--plot", plot])
    assert err == f"apa: error: --plot {plot}: {why}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.png", "plain", "ro"]
    assert not any((tmp_path / "ro").iterdir()) and not any((tmp_path / "dir.png").iterdir())


def test_synth_refuses_a_missing_folder_before_allocating(capsys, tmp_path, monkeypatch):
    from apa_emu.study.commands import synth

    monkeypatch.setattr(synth, "synthetic", lambda *a, **k: pytest.fail("synthetic ran before the check"))
    err = one_line_error(capsys, ["synth", str(tmp_path / "none" / "s.apadump"), "--n", "16", "--kv", "64"])
    assert err == f"apa: error: {tmp_path / 'none' / 's.apadump'}: folder {tmp_path / 'none'} does not exist\n"


class _AbsentEngine(Engine):
    """A GPU engine on a machine without its GPU."""

    @classmethod
    def missing(cls):
        return "CuPy is not installed (pip install -e '.[gpu]')"


class _PartialEngine(Engine):
    """A GPU engine that is there but does not implement head dim 64."""

    @classmethod
    def lacks(cls, config, d):
        return f"head dim {d} is not implemented" if d == 64 else None


def test_auto_backend_notes_only_an_engine_that_is_there_but_cannot_run(capsys, dumps, monkeypatch):
    """On a machine without a GPU, --backend auto ran every command with a note that CuPy is not installed:
    now it falls back silently, and says why only when the GPU engine is there but lacks what was asked
    (or --devices asked for GPUs). --backend gpu still refuses with the reason."""
    argv = ["scan", dumps["good"], "--rows", "0:2", "--json"]
    monkeypatch.setenv("APA_ENGINES", f"gpu={__name__}:_AbsentEngine")
    assert main(argv) == 0
    assert capsys.readouterr().err == ""
    assert main([*argv, "--devices", "0"]) == 0
    assert capsys.readouterr().err == ("apa: note: running on the CPU emulator: CuPy is not installed "
                                       "(pip install -e '.[gpu]')\n")
    assert one_line_error(capsys, [*argv, "--backend", "gpu"]) == ("apa: error: --backend gpu: CuPy is not installed "
                                                                   "(pip install -e '.[gpu]')\n")
    monkeypatch.setenv("APA_ENGINES", f"gpu={__name__}:_PartialEngine")
    assert main(argv) == 0
    assert capsys.readouterr().err == "apa: note: running on the CPU emulator: head dim 64 is not implemented\n"
    assert one_line_error(capsys, [*argv, "--backend", "gpu"]) == ("apa: error: --backend gpu: head dim 64 is not "
                                                                   "implemented\n")


def test_workers_beyond_the_cpus_are_clamped_with_a_notice(capsys, dumps, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    argv = ["scan", dumps["good"], "--backend", "cpu", "--rows", "0:16", "--json"]
    assert main([*argv, "--workers", "1000"]) == 0
    clamped = capsys.readouterr()
    assert clamped.err == "apa: note: --workers 1000 is more than the 2 CPUs available: using 2\n"
    assert main([*argv, "--workers", "1"]) == 0
    assert _strict(clamped.out) == _strict(capsys.readouterr().out)


def test_json_carries_the_config_everywhere(capsys, dumps):
    path = dumps["good"]
    cfg = dataclasses.asdict(Config(mma="exact", eps=0.01))
    common = ["--config", "mma=exact", "--eps", "0.01"]
    outputs = [run_json(capsys, "scan", path, "--rows", "0:4", *common),
               run_json(capsys, "worst", path, "-n", "2", *common),
               run_json(capsys, "pair", path, "--row", "3", "--head", "1", "--plot", "", *common),
               run_json(capsys, "attribute", path, "--worst", "2", "--plot", "", *common),
               run_json(capsys, "headroom", path, "--rows", "0:4", *common)]
    assert all(o["config"] == cfg for o in outputs)
    sweep = run_json(capsys, "sweep", path, "--rows", "0:4", "--eps", "0.01", "--plot", "", "--config", "mma=exact")
    # each row's eps is the one that ran: the config's eps is null, listed under swept
    assert sweep["config"] == {**dataclasses.asdict(Config(mma="exact")), "eps": None} and sweep["swept"] == ["eps"]


def test_scan_names_the_non_finite_pairs(capsys, dumps):
    d = synthetic(48, 320, 6, 2, 64, seed=4)
    v = d.v.copy()
    v[:, 1] = 65504
    finite = np.isfinite(attention(d.q, d.k, v, d.q_offset).out).all(axis=2)
    bad = [(int(r), int(h)) for r, h in np.argwhere(~finite)]
    assert 0 < len(bad) < finite.size
    out = run_json(capsys, "scan", dumps["hot_v"])
    assert out["pairs"] == finite.size and out["summary"]["pairs"] == finite.sum()
    assert out["nonfinite"] == dict(count=len(bad), first=[list(p) for p in bad[: scan.NONFINITE_SHOWN]])
    bins = dict(out["histogram"])
    assert bins.pop("non-finite") == len(bad) and sum(bins.values()) == finite.sum()
    assert "non_finite" not in out
    # the finite pairs measure the same as a scan that selects them alone
    alone = run_json(capsys, "scan", dumps["hot_v"], "--heads", "0:3")
    assert alone["summary"] == pytest.approx(out["summary"] | dict(hot_share=alone["summary"]["hot_share"]),
                                             rel=1e-12)
    assert main(["scan", dumps["hot_v"]]) == 0
    table = capsys.readouterr().out
    assert f"{len(bad)} of {finite.size}" in table and "(0, 3) (0, 4) (0, 5) (1, 3) (1, 4)" in table


def test_worst_puts_overflowed_pairs_first_and_json_stays_strict(capsys, dumps):
    out = run_json(capsys, "worst", dumps["hot_v"], "-n", "4")
    assert [w["head"] >= 3 for w in out["worst"]] == [True] * 4
    for i, w in enumerate(out["worst"]):
        assert w["cos"] is None and w["rel_l2"] is None and w["max_o16"] > scan.F16_MAX
        assert w["overflow"] == "pass 2 (FP16 output accumulation P·V) overflowed: o2 holds Inf"
        assert out["non_finite"][f"worst[{i}].cos"] == "NaN"
    pair = run_json(capsys, "pair", dumps["hot_v"], "--row", "0", "--head", "4", "--plot", "")
    assert pair["diag"]["overflow"].startswith("pass 2 (FP16 output accumulation") and pair["diag"]["cos"] is None
    assert pair["non_finite"]["out_norm"] == "Infinity"
    attribute = run_json(capsys, "attribute", dumps["hot_v"], "--worst", "3", "--plot", "")
    # every variant overflows but the exact MMA model, which accumulates pass 2 in binary32
    for name, v in attribute["variants"].items():
        assert (v["nonfinite"], v["mean_cos"] is None) == ((0, False) if "exact" in name else (3, True)), name


def _record(**bad):
    rec = np.zeros((), row_dtype(64))
    rec["m1"], rec["m2"], rec["l1"], rec["l2"] = 1.0, 2.0, 0.5, 0.5
    for name, value in bad.items():
        rec[name] = value
    return rec


@pytest.mark.parametrize("bad, stage", [
    ({}, None),
    (dict(m1=-np.inf, l1=0.0), None),  # no cold tile: not an overflow
    (dict(m2=-np.inf, l2=0.0), None),  # no hot tile
    (dict(part=np.inf), "pass 1 (FP4 estimate of the cold tiles) overflowed: part holds Inf"),
    (dict(m2=np.inf, l2=np.nan, o2=np.nan, out=np.nan), "pass 2 (FP16 scores q·k, row max and sum) overflowed: m2 holds Inf"),
    (dict(l2=np.nan, o2=np.nan, out=np.nan), "pass 2 (FP16 scores q·k, row max and sum) overflowed: l2 holds NaN"),
    (dict(o2=np.inf, out=np.inf), "pass 2 (FP16 output accumulation P·V) overflowed: o2 holds Inf"),
    (dict(out=np.inf), "the merge (FP16 output) overflowed: out holds Inf"),
])
def test_overflow_stage_is_the_first_non_finite_one(bad, stage):
    assert scan.overflow_stage(_record(**bad)) == stage


@pytest.mark.parametrize("v_mean, q_scale", [(16, 1.0), (128, 1.0), (0, 60.0), (0, 300.0)])
def test_headroom_estimates_predict_the_overflow(v_mean, q_scale):
    """Every tile hot (ε < 0), cases far from the boundary: |running O| past 65504 exactly where pass 2's
    FP16 output overflows, and an overflow of the scores only where |q·k| passes 65504 (a negative
    overflow only drops its key, silently)."""
    rng = np.random.default_rng(1)
    S = 2048
    q = (0.05 * q_scale * rng.standard_normal((16, 1, 64))).astype(np.float16)
    k = (q_scale * rng.standard_normal((S, 1, 64))).astype(np.float16)
    v = (v_mean + rng.standard_normal((S, 1, 64))).astype(np.float16)
    _, diags = worst.worst(Dump(q, k, v, S - 16), Config(eps=-1), 16)
    for diag in diags:
        assert (diag.max_o16 > scan.F16_MAX) == ("o2" in (diag.overflow or ""))
        if "scores" in (diag.overflow or ""):
            assert diag.max_qk > scan.F16_MAX
    kinds = {diag.overflow.split(":")[0] if diag.overflow else None for diag in diags}
    assert kinds == {(16, 1.0): {None}, (128, 1.0): {"pass 2 (FP16 output accumulation P·V) overflowed"},
                     (0, 60.0): {None}, (0, 300.0): {"pass 2 (FP16 scores q·k, row max and sum) overflowed"}}[v_mean, q_scale]


def test_ctrl_c_in_process(capsys, dumps, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(scan, "evaluate", interrupted)
    assert main(["scan", dumps["good"], "--backend", "cpu"]) == 130
    assert capsys.readouterr().err == "apa: interrupted\n"


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_ctrl_c_with_workers_is_one_line_and_leaves_no_worker():
    argv = [sys.executable, "-m", "apa_emu.study.cli", "scan", "--backend", "cpu", "--workers", "2"]
    p = subprocess.Popen(argv, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not _children(p.pid) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _children(p.pid)
    assert workers, "the scan ended before its workers could be interrupted"
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = p.communicate(timeout=120)
    assert (p.returncode, err) == (130, "apa: interrupted\n")
    time.sleep(0.5)
    assert not [w for w in workers if Path(f"/proc/{w}").exists() and "Z" not in _state(w)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, IndexError):
        return "Z"


@pytest.mark.parametrize("as_json", [True, False])
@pytest.mark.parametrize("sink", ["/dev/full", "closed pipe"])
def test_output_failures_are_one_line(dumps, sink, as_json):
    argv = [sys.executable, "-m", "apa_emu.study.cli", "scan", dumps["good"], "--backend", "cpu", "--rows", "0:2"] \
        + ["--json"] * as_json
    if sink == "/dev/full":
        with open("/dev/full", "w") as full:
            p = subprocess.run(argv, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        rc, err = p.returncode, p.stderr
        expected = "No space left on device"
    else:
        p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.stdout.close()
        err = p.stderr.read()
        rc = p.wait(timeout=300)
        expected = "Broken pipe"
    assert (rc, err) == (2, f"apa: error: cannot write the output: {expected}\n")


def _subparsers():
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_help_gives_every_option_a_meaning_and_its_default():
    for name, parser in _subparsers().items():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            assert action.help, f"apa {name} {action.dest} has no help"
            if action.default not in (None, False) and action.dest != "help":
                shown = str(action.default)
                assert f"(default: {shown})" in text, f"apa {name} {action.dest}: default {shown} not shown"


def test_help_lists_config_keys_and_columns():
    from apa_emu.study.commands.attribute import ATTRIBUTE_VARIANTS
    from apa_emu.study.scan import PairDiagnostics

    for name, parser in _subparsers().items():
        if name in ("synth", "smollm2", "gemma3"):
            continue
        text = parser.format_help()
        for field in dataclasses.fields(Config):
            default = getattr(Config(), field.name)
            shown = {True: "on", False: "off", None: "none"}.get(default, default) if not isinstance(default, float) \
                else default
            assert re.search(rf"^  {field.name} .* default {re.escape(str(shown))}$", text, re.M), (name, field.name)
    pair = _subparsers()["pair"].format_help()
    assert all(re.search(rf"^  {c}\s+\S", pair, re.M) for c in ("visit", *VISIT_FIELDS))
    explained = {name for names in re.findall(r"^  ([a-z0-9_, ]+?)\s{2,}", _subparsers()["worst"].format_help(), re.M)
                 for name in names.split(", ")}
    assert {f.name for f in dataclasses.fields(PairDiagnostics)} - {"row", "head"} <= explained
    attribute = _subparsers()["attribute"].format_help()
    assert all(re.search(rf"^  {re.escape(v)}\s+quantized in pass 1: ", attribute, re.M) for v in ATTRIBUTE_VARIANTS)


def test_help_explains_every_column_printed(capsys, dumps, monkeypatch):
    """Every column and metric row that scan, sweep and chunked print has a line of its own in their
    --help, its name and then its meaning. The names come from real runs, so a new column without a
    meaning fails here."""
    from apa_emu.study.commands import chunked, sweep
    from apa_emu.study.commands import scan as scan_command

    printed = {}
    for module in (scan_command, sweep, chunked):
        def record(title, columns, rows, real=module.table, command=module.__name__.rpartition(".")[2]):
            names = printed.setdefault(command, set())
            names.update(c for c in columns if c not in ("metric", "value"))
            if columns[0] == "metric":  # a table of named rows: the names are its first column
                names.update(r[0] for r in rows)
            return real(title, columns, rows)

        monkeypatch.setattr(module, "table", record)
    good, hot = dumps["good"], dumps["hot_v"]
    for argv in (["scan", good], ["scan", hot], ["scan", good, hot], ["sweep", good, "--eps", "0.01"],
                 ["sweep", good, hot, "--eps", "0.01"], ["chunked", good, hot, "--chunk", "16"]):
        assert main([*argv, "--backend", "cpu"]) == 0
    capsys.readouterr()
    assert {"bin", "cold_out_rel_max", "first non-finite (row, head)", "bound_over_ref_median"} <= printed["scan"]
    assert {"eps", "pass2_tiles"} <= printed["sweep"] and "frozen (chunk, KV head)" in printed["chunked"]
    for command, names in printed.items():
        text = _subparsers()[command].format_help()
        unexplained = sorted(c for c in names if not re.search(rf"^  {re.escape(c)}\s{{2,}}\S", text, re.M))
        assert not unexplained, f"apa {command} --help does not explain {unexplained}"


def test_progress_bar_says_why_it_waits(monkeypatch):
    rich_console = pytest.importorskip("rich.console")
    rich_progress = pytest.importorskip("rich.progress")
    seen = []

    class Recorder:
        def __init__(self, *columns, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, description, total):
            seen.append(description)
            return 0

        def update(self, task, completed, total, description):
            seen.append(description)

    monkeypatch.setattr(rich_console.Console, "is_terminal", property(lambda self: True))
    monkeypatch.setattr(rich_progress, "Progress", Recorder)
    with report.progress_bar(True, "scan x") as update:
        update(1, 4)
        update(2, 4)
    assert seen == [f"scan x ({report.NUMBA_WAIT})", "scan x", "scan x"] and "Numba" in report.NUMBA_WAIT


def test_json_safe_flags_every_replaced_value():
    flags = {}
    clean = report.json_safe(dict(a=[1.0, np.float32(np.inf)], b=dict(c=np.array([np.nan, -np.inf]))), flags=flags)
    assert clean == dict(a=[1.0, None], b=dict(c=[None, None]))
    assert flags == {"a[1]": "Infinity", "b.c[0]": "NaN", "b.c[1]": "-Infinity"}


def test_closed_stdout_is_one_line_before_any_work():
    """Started with standard output closed (``>&-``), Python has no sys.stdout: results could reach no
    one, so the command says so in one line and does no work (it was an AttributeError at the end)."""
    r = subprocess.run([sys.executable, "-m", "apa_emu.study.cli", "scan", "--rows", "0:8"],
                       stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1), cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr == "apa: error: standard output is closed; nothing could be written\n"
