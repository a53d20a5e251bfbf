"""The public engine interface (docs/engines.md) on two engines a user would write (tests/emu/user_engines):
the emulator with one rounding changed, which ``apa check`` must catch bitwise and localise where the
changed rounding bites (found here independently, from two emulator runs), and a PyTorch fake-quant
attention, reported in tolerance with where it departs from APA (in a problem that has cold tiles).
Then the one-line messages of engines that break the interface, and the plugin's assertion."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

import apa_emu
from apa_emu import Config
from apa_emu.engines import EngineError
from apa_emu.problems import Problem
from apa_emu.study.cli import main
from apa_emu.study.dump import write_dump
from apa_emu.study.synth import synthetic
from apa_emu.testing import Seen, assert_matches_emulator

pytest.importorskip("rich")
pytest.importorskip("hypothesis")

WRONG = "user_engines.wrong_rounding:attention"
FAKEQUANT = "user_engines.fakequant_torch:attention"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """small: 48 rows, 6/2 heads, 320 keys; sink: 32 rows, 4/2 heads, 2500 keys under a strong sink
    (many cold tiles)."""
    root = tmp_path_factory.mktemp("engines")
    small = synthetic(48, 320, 6, 2, 64, seed=4)
    sink = synthetic(32, 2500, 4, 2, 64, seed=5, sink=16.0)
    return {name: write_dump(root / f"{name}.apadump", d.q, d.k, d.v, d.q_offset)
            for name, d in (("small", small), ("sink", sink))}


@pytest.fixture
def no_files(tmp_path, monkeypatch):
    """Checks run in an empty folder, with the kernel's reproducer folder inside it: nothing may appear."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("APA_GPU_REPRO_DIR", str(tmp_path / "repro"))
    yield
    assert list(tmp_path.iterdir()) == []


def _bits(x):
    return np.asarray(x).view(np.uint16)


def _replay_json(line: str) -> dict:
    """The --repro JSON of a failure's replay line (the line before the verdict)."""
    words = shlex.split(line.strip().removeprefix("replay: "))
    assert words[:3] == ["apa", "check", "--engine"] and words[4] == "--repro"
    return json.loads(words[5])


def test_wrong_rounding_is_caught_bitwise_and_localised(capsys, no_files):
    assert main(["check", "--engine", WRONG, "--hypothesis", "4", "--seed", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("apa check: engine wrong-rounding differs from the emulator in generated problem ")
    repro = _replay_json(lines[-2])
    problem, cfg = Problem.from_json(repro["problem"]), Config(**repro["config"])
    # where the changed rounding bites, independently: the emulator with and without it, pair by pair
    args, kwargs = problem.arguments()
    right = apa_emu.attention(*args, cfg, trace="all", **kwargs)
    wrong = apa_emu.attention(*args, cfg.replace(fma=not cfg.fma), trace="all", **kwargs)
    differs = (_bits(right.out) != _bits(wrong.out)).any(axis=-1)
    visits = [r for r, w in zip(right.visits, wrong.visits) if r.tobytes() != w.tobytes()]
    rows = [r for r, w in zip(right.rows, wrong.rows) if r.tobytes() != w.tobytes()]
    if visits:  # pass 1 comes first: the first divergent visit record, its warp, visit and tile
        r = visits[0]
        assert "where='visits'" in lines[1] and f"warp={r['warp']}, visit={r['visit']}, tile={r['tile']}," in lines[1]
    elif (right.hot != wrong.hot).any():
        assert "where='hot'" in lines[1]
    elif rows:
        r = rows[0]
        assert f"where='rows', record=0, b={r['b']}, hk={r['hk']}, row={r['row']}," in lines[1] or \
            f"b={r['b']}, hk={r['hk']}, row={r['row']}," in lines[1]
    else:
        assert "where='out'" in lines[1]
    if differs.any():
        *lead, row, head = (int(i) for i in np.argwhere(differs)[0])
        assert any(line.startswith(f"  first differing (row, head): ({row}, {head})") for line in lines)
    else:
        assert not any("first differing (row, head)" in line for line in lines)
    # the printed command replays it
    assert main(["check", "--engine", WRONG, "--repro", json.dumps(repro)]) == 1
    again = capsys.readouterr().out.splitlines()
    assert again[1:-1] == lines[1:-1]


def test_wrong_rounding_on_a_dump_names_the_pair(capsys, dumps, no_files):
    small = str(dumps["small"])
    assert main(["check", small, "--engine", WRONG, "--warps", "0:3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("apa check: engine wrong-rounding differs from the emulator in small.apadump (KV head ")
    hk = int(lines[0].split("KV head ")[1].split(")")[0])
    d = synthetic(48, 320, 6, 2, 64, seed=4)
    G = 3
    q, k, v = d.q[:, hk * G:(hk + 1) * G], d.k[:, hk:hk + 1], d.v[:, hk:hk + 1]
    warps = [(0, 0, w) for w in range(3)]
    right, wrong = (apa_emu.attention(q, k, v, d.q_offset, Config(fma=f), warps=warps).out for f in (False, True))
    differs = (_bits(right) != _bits(wrong)).any(axis=-1) & np.isfinite(right.astype(np.float32)).all(axis=-1)
    row, head = (int(i) for i in np.argwhere(differs)[0])
    assert f"  first differing (row, head): ({row}, {hk * G + head})" in lines
    assert main(["check", "--engine", WRONG, "--repro", json.dumps(_replay_json(lines[-2]))]) == 1
    assert capsys.readouterr().out.splitlines()[:-2] == lines[:-2]


def test_emulator_as_a_function_passes_bitwise(capsys, dumps, no_files):
    """A control: the emulator itself, wrapped as a user's function, claims bit-exactness and passes."""
    assert main(["check", str(dumps["small"]), "--engine", "apa_emu:attention", "--mode", "bitwise",
                 "--warps", "0:3"]) == 0
    assert "apa check: engine apa_emu:attention equals the emulator bitwise" in capsys.readouterr().out


def test_fakequant_is_reported_in_tolerance(capsys, dumps, no_files):
    sink = str(dumps["sink"])
    assert main(["check", sink, "--engine", FAKEQUANT, "--max-rel-l2", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"apa check: engine {FAKEQUANT} is within relative L2 5 of the emulator on 8 warps")
    d = synthetic(32, 2500, 4, 2, 64, seed=5, sink=16.0)
    emu = apa_emu.attention(d.q, d.k, d.v, d.q_offset)
    assert 0 < emu.hot_tiles < emu.active_tiles  # the problem has hot and cold tiles
    # per pair, independently of the report and KV head by KV head as apa check runs a dump: the
    # relative L2 distance, and whether the pair's warp left a tile cold (the emulator's hot masks)
    from user_engines.fakequant_torch import attention as fakequant

    G, rel, cold = 2, [], []
    for hk in range(2):
        q, k, v = d.q[:, G * hk:G * hk + G], d.k[:, hk:hk + 1], d.v[:, hk:hk + 1]
        res = apa_emu.attention(q, k, v, d.q_offset)
        e, o = res.out.astype(np.float64), fakequant(q, k, v, d.q_offset).astype(np.float64)
        rel.append(np.linalg.norm(o - e, axis=-1) / np.linalg.norm(e, axis=-1))
        warp_cold = []
        for w in range(res.hot.shape[2]):
            last_row = min(16 * w + 15, d.n * G - 1) // G
            last_tile = min(d.q_offset + last_row, d.k.shape[0] - 1) // 64
            warp_cold.append(any((int(res.hot[0, 0, w, t // 32]) >> (t % 32)) & 1 == 0 for t in range(last_tile + 1)))
        packed = np.arange(d.n)[:, None] * G + np.arange(G)  # (row, head in the KV head) -> packed row
        cold.append(np.array(warp_cold)[packed // 16])
    rel, cold = np.concatenate(rel, axis=1), np.concatenate(cold, axis=1)
    assert cold.any() and not cold.all()
    tiles = next(line for line in out.splitlines() if line.startswith("  by tiles: "))
    assert f"warps with cold tiles: {cold.sum()} pairs, mean {rel[cold].mean():.3g}, max {rel[cold].max():.3g}" \
        in tiles
    assert f"every tile hot (exact): {(~cold).sum()} pairs, mean {rel[~cold].mean():.3g}" in tiles
    assert f"max {rel.max():.3g} at (row, head)" in out
    assert "  by frame: " in out and "ULP distance of the output elements" in out
    # under the default bound it fails, with the report and a replay
    assert main(["check", sink, "--engine", FAKEQUANT]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"apa check: engine {FAKEQUANT} departs from the emulator beyond relative L2 0.1")
    assert main(["check", "--engine", FAKEQUANT, "--repro", json.dumps(_replay_json(lines[-2]))]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == lines[1:]


@pytest.mark.parametrize("fn, words", [
    ("raises", "engine user_engines.bad:raises raised RuntimeError: CUDA error: an illegal memory access"),
    ("wrong_shape", "engine user_engines.bad:wrong_shape returned an output of shape (48, 3), expected q's (48, 3, 64)"),
    ("wrong_dtype", "engine user_engines.bad:wrong_dtype returned an output of dtype float32, expected float16"),
    ("nan", "engine user_engines.bad:nan returned nan at out index (3, 1, 5), where the emulator's output is finite"),
    ("not_an_array", "engine user_engines.bad:not_an_array returned a list, expected a Result or the output array"),
    ("claims_trace", "engine claims-trace claims 'trace' but returned no trace records"),
    ("claims_window", "engine claims-window claims 'window' but its function takes no window= argument"),
    ("missing", "engine user_engines.bad:missing: module user_engines.bad has no 'missing'"),
])
def test_a_bad_engine_is_one_line(capsys, dumps, no_files, fn, words):
    assert main(["check", str(dumps["small"]), "--engine", f"user_engines.bad:{fn}", "--warps", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"apa: error: {words}"), err


def test_an_engine_that_does_not_import_is_one_line(capsys, no_files):
    assert main(["check", "--engine", "no_such_module_xyz:attention", "--hypothesis", "1"]) == 2
    assert capsys.readouterr().err == ("apa: error: engine no_such_module_xyz:attention: cannot import "
                                       "no_such_module_xyz: ModuleNotFoundError: No module named 'no_such_module_xyz'\n")
    assert main(["check", "--engine", "nameless", "--hypothesis", "1"]) == 2
    assert capsys.readouterr().err.startswith("apa: error: --engine nameless: no engine 'nameless' (engines: cpu")


def test_plugin_assertion_and_seen():
    """assert_matches_emulator: the wrong engine fails with its replay command; the fake-quant engine
    passes within a loose bound; Seen records the hot and cold tiles it met."""
    from user_engines import fakequant_torch, wrong_rounding

    problem = Problem(seed=3, B=1, n=48, Hkv=1, G=2, d=64, S=600, structure="sink", batched=False, q_offset=552)
    with pytest.raises(AssertionError, match=r"differs from the emulator bitwise\n  first differing \(row, head\)"
                                             r"[^$]*replay: apa check --engine user_engines.wrong_rounding:attention "):
        assert_matches_emulator(wrong_rounding.attention, problem)
    seen = Seen()
    outcome = assert_matches_emulator(fakequant_torch.attention, problem, Config(eps=0.3), max_rel_l2=5, seen=seen)
    assert outcome.mode == "tolerance" and seen["hot tiles"] and seen["cold tiles"] and seen["passed"]
    with pytest.raises(ValueError, match="^engine wrong-rounding does not implement kv_state"):
        assert_matches_emulator(wrong_rounding.attention, ((np.zeros((1, 1, 64), np.float16),) * 3 + (0,),
                                                           dict(kv_state=apa_emu.KVState())))


def test_bad_declarations_are_refused():
    from apa_emu.engines import engine

    with pytest.raises(EngineError, match=r"^engine x: unknown features fused \(known: "):
        engine("x", features={"fused"})


def test_every_study_runs_on_a_user_engine(capsys, dumps):
    """scan, worst, pair, attribute and sweep with --backend module:callable; the scan's mean cosine
    is the fake-quant output's against float64 attention, computed here from the function itself."""
    from user_engines.fakequant_torch import attention as fakequant

    small = str(dumps["small"])
    backend = ["--backend", FAKEQUANT, "--json"]
    scan = json.loads(_run(capsys, "scan", small, "--rows", "0:8", *backend))
    assert scan["backend"] == FAKEQUANT and scan["summary"]["pairs"] == 48
    d = synthetic(48, 320, 6, 2, 64, seed=4)
    rows, heads = np.repeat(np.arange(8), 6), np.tile(np.arange(6), 8)
    ref = apa_emu.reference_rows(d.q, d.k, d.v, d.q_offset, rows, heads, float(Config().softmax_scale(64)))
    out = np.concatenate([fakequant(d.q[:, 3 * hk:3 * hk + 3], d.k[:, hk:hk + 1], d.v[:, hk:hk + 1], d.q_offset)
                          for hk in range(2)], axis=1)[rows, heads].astype(np.float64)
    cos = (out * ref).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
    assert scan["summary"]["mean_cos"] == pytest.approx(cos.mean(), rel=1e-9)
    assert cos.mean() < 0.9999  # the approximation shows
    _run(capsys, "worst", small, "--rows", "0:8", "-n", "3", *backend)
    _run(capsys, "pair", small, "--row", "3", "--head", "1", *backend)
    _run(capsys, "attribute", small, *backend)
    _run(capsys, "sweep", small, "--rows", "0:8", "--eps", "0.005", "0.05", *backend)


def _run(capsys, *argv) -> str:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_a_registered_function_is_named_as_registered(capsys, dumps, monkeypatch, no_files):
    monkeypatch.setenv("APA_ENGINES", f"fq={FAKEQUANT}")
    assert main(["check", str(dumps["small"]), "--engine", "fq", "--warps", "0", "--max-rel-l2", "5"]) == 0
    assert capsys.readouterr().out.startswith("apa check: engine fq is within relative L2 5 of the emulator on 2 warps")


def test_the_apa_engine_option_and_fixture(tmp_path):
    """``pytest -p apa_emu.testing --apa-engine SPEC``: a suite written against the fixture fails on the
    wrong engine with its replay command, passes on the emulator, and skips without the option."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "test_fixture.py").write_text(
        "from apa_emu.problems import Problem\n"
        "from apa_emu.testing import assert_matches_emulator\n\n\n"
        "def test_engine(apa_engine):\n"
        "    problem = Problem(seed=3, B=1, n=48, Hkv=1, G=2, d=64, S=600, structure='sink', batched=False,\n"
        "                      q_offset=552)\n"
        "    assert_matches_emulator(apa_engine, problem, mode='bitwise')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "tests" / "emu")]))

    def pytest_run(*extra):
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "apa_emu.testing", "-q", "-p", "no:cacheprovider",
                               *extra, "test_fixture.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)

    wrong = pytest_run("--apa-engine", WRONG)
    assert wrong.returncode == 1 and "wrong-rounding differs from the emulator bitwise" in wrong.stdout
    assert f"replay: apa check --engine {WRONG} --repro " in wrong.stdout
    assert pytest_run("--apa-engine", "apa_emu:attention").returncode == 0
    skipped = pytest_run()
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout


def test_the_claimed_config_is_checked_and_named(capsys, dumps, no_files):
    """A seed-like engine runs whatever config it is given: checked under the one it claims it passes,
    and the summary names that claim; under the default config (--config over the claim) it would not
    be the seed's arithmetic, which the emulator's two outputs show differ here."""
    small = str(dumps["small"])
    assert main(["check", small, "--engine", "user_engines.bad:seed_like", "--warps", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("apa check: engine seed-like equals the emulator bitwise (output, hot masks, every trace "
                          "field) on 2 warps of 1 dump under the config it claims, preset=seed, and ")
    d = synthetic(48, 320, 6, 2, 64, seed=4)
    seed, plain = (apa_emu.attention(d.q, d.k, d.v, d.q_offset, c, warps=[(0, 0, 0)]).out
                   for c in (Config.seed(), Config()))
    assert not np.array_equal(_bits(seed), _bits(plain))


def test_fakequant_on_generated_problems(capsys, no_files):
    """--hypothesis in tolerance: passing, the worst problem is named; failing, the failure is shrunk
    and its replay command reproduces the same report."""
    assert main(["check", "--engine", FAKEQUANT, "--hypothesis", "2", "--seed", "2", "--max-rel-l2", "1e6"]) == 0
    out = capsys.readouterr().out.splitlines()
    head, drawn = out[0].rstrip(")").split("; ")
    assert head.endswith("within relative L2 1e+06 of the emulator on 2 generated problems and configs (--seed 2")
    for field in drawn.split(", "):  # each tallied field's values count the 2 configs drawn
        name, *counts = field.replace(" / ", " ").split(" ")
        assert name in ("exp2", "hot_test", "p2_accum", "p2_scores") and sum(map(int, counts[1::2])) == 2
    assert out[1].startswith("  the worst problem: ") and "Config(" in out[1]
    assert main(["check", "--engine", FAKEQUANT, "--hypothesis", "2", "--seed", "2", "--max-rel-l2", "1e-3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "departs from the emulator beyond relative L2 0.001 in generated problem 1 (shrunk: " in lines[0]
    repro = _replay_json(lines[-2])
    assert repro["max_rel_l2"] == 1e-3 and repro["mode"] == "tolerance"
    assert main(["check", "--engine", FAKEQUANT, "--repro", json.dumps(repro)]) == 1
    assert capsys.readouterr().out.splitlines()[1:-1] == lines[1:-1]
