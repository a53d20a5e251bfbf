"""``apa check`` of a peer kernel's engine against its recipe (apa_emu.peers, apa_emu.study.peer_check), on
the CPU with stand-in engines (tests/emu/user_engines/peer.py): the recipe's own output passes bitwise,
one flipped bit fails and is named by its (row, head), tile and both values; a dump is padded in front
to causal equal lengths; what a peer kernel cannot run is refused in one line; an engine that changes
its inputs is reported, the APA path's engines included; the generated problems stay within the
kernel's reach. The real kernel is tests/kernel/test_gpu_sageattention.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from user_engines import peer

import apa_emu
from apa_emu import Config, sfu
from apa_emu.compare import check
from apa_emu.engines import EngineError, check_untouched, wrap
from apa_emu.peers import sageattn as sa
from apa_emu.problems import Problem
from apa_emu.strategies import peer_problems
from apa_emu.study import peer_check
from apa_emu.study.cli import main
from apa_emu.study.dump import Dump, write_dump
from helpers import standin_sfu_tables
from hyp import examples

from apa_gpu.sageattention import SageEngine

SPEC = "user_engines.peer:"


@pytest.fixture(autouse=True)
def tables(monkeypatch):
    """The recipe reads the stand-in SFU tables on both sides (its structure, not the hardware's)."""
    monkeypatch.setattr(sfu, "tables", lambda *_: standin_sfu_tables())


def _inputs(n=200, h_q=4, h_k=2, d=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, h_q, d)).astype(np.float16)
    k = (rng.standard_normal((n, h_k, d)) + 0.5).astype(np.float16)
    return q, k, rng.standard_normal((n, h_k, d)).astype(np.float16)


def test_the_recipes_own_output_passes_bitwise():
    from apa_emu import peers

    outcome = peers.check(peer.Faithful(), *_inputs())
    assert outcome.passed and outcome.first is None


def test_one_flipped_bit_is_named_by_pair_tile_and_values():
    from apa_emu import peers

    q, k, v = _inputs()
    outcome = peers.check(peer.OneBitOff(), q, k, v)
    row, head, ch = peer.FLIP
    want = sa.run(q, k, v).out[row, head, ch]
    assert not outcome.passed and outcome.first == peer.FLIP and outcome.pair == (row, head)
    assert outcome.values[0] == want and outcome.values[1].view(np.uint16) == want.view(np.uint16) ^ 1
    assert f"query block {row // 128} (rows 128..199, row {row - 128} of it)" in outcome.tile
    assert "key blocks 0..1 off the diagonal, then 2 and 3 on the diagonal" in outcome.tile
    assert "1 elements differ in 1 (row, head) pairs" in outcome.spread


def _dump(tmp_path, n=70, kv=200):
    q, k, v = _inputs(n=kv)
    return write_dump(tmp_path / "peer.apadump", q[kv - n:], k, v, kv - n)


def test_a_dump_is_padded_in_front_with_zero_rows(tmp_path):
    q0, k0, v0 = _inputs(n=90)
    dump = Dump(q0[:30], k0, v0, 40)  # queries at positions 40..69; keys 70..89 never seen
    q, k, v, first = peer_check.padded(dump)
    assert first == 40 and q.shape == (70, 4, 64) and not q[:40].any() and np.array_equal(q[40:], q0[:30])
    assert np.array_equal(k, k0[:70]) and np.array_equal(v, v0[:70])


def test_dump_check_passes_and_names_the_dumps_own_row(tmp_path, capsys):
    path = _dump(tmp_path)
    assert main(["check", str(path), "--engine", SPEC + "Faithful"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "apa check: PASS: 1 dumps passed, 0 failed"
    assert main(["check", str(path), "--engine", SPEC + "OneBitOff"]) == 1
    out = capsys.readouterr().out
    row, head, ch = peer.FLIP
    assert f"first differing (row, head): ({row - 130}, {head}), channel {ch}" in out
    assert "query block 1 (rows 128..199, row 2 of it)" in out and "padded with 130 rows in front" in out
    replay = next(line for line in out.splitlines() if "replay:" in line).split("--repro ")[1].strip("'")
    assert json.loads(replay)["dump"] == str(path)
    assert main(["check", "--engine", SPEC + "OneBitOff", "--repro", replay]) == 1
    # the fallback: one ULP of one element is well within the default relative L2 bound
    assert main(["check", "--engine", SPEC + "OneBitOff", "--hypothesis", "2", "--seed", "1", "--mode", "tolerance"]) == 0


def test_generated_check_passes_and_a_flip_fails_with_a_replay(capsys):
    assert main(["check", "--engine", SPEC + "Faithful", "--hypothesis", "3", "--seed", "1"]) == 0
    assert main(["check", "--engine", SPEC + "OneBitOff", "--hypothesis", "3", "--seed", "1"]) == 1
    out = capsys.readouterr().out
    assert "first differing (row, head): (0, 0), channel 5" in out  # shrunk to one row and head
    replay = next(line for line in out.splitlines() if "replay:" in line).split("--repro ")[1].strip("'")
    problem = Problem.from_json(json.loads(replay)["problem"])
    assert peer_check.problem_lacks(peer.OneBitOff(), problem) is None and (problem.n, problem.G) == (1, 1)
    assert main(["check", "--engine", SPEC + "OneBitOff", "--repro", replay]) == 1
    # the fallback: one ULP of one element is well within the default relative L2 bound
    assert main(["check", "--engine", SPEC + "OneBitOff", "--hypothesis", "2", "--seed", "1", "--mode", "tolerance"]) == 0


@pytest.mark.parametrize("change, words", [
    (dict(window=5), "does not run a sliding window"), (dict(page_size=16), "does not run paged keys"),
    (dict(seqlens=((3, 3),)), "does not run varlen batches"), (dict(B=2, batched=True), "does not run batches"),
    (dict(S=90), "equal lengths only"), (dict(d=256), "does not run head dim 256"),
])
def test_what_a_peer_kernel_cannot_run_is_one_line(change, words):
    problem = Problem(**{**dict(seed=0, B=1, n=80, Hkv=1, G=2, d=64, S=80, structure="normal", batched=False,
                                q_offset=0), **change})
    why = peer_check.problem_lacks(peer.Faithful(), problem)
    assert words in why and why.startswith("engine faithful-sage (SageAttention") and "\n" not in why


def test_the_sage_engine_refusals_are_one_line():
    assert SageEngine.lacks(Config(), 128) is None
    for d in (96, 256):
        why = SageEngine.lacks(Config(), d)
        assert why.startswith("engine sageattention does not run head dim") and "\n" not in why
    missing = SageEngine.missing()
    assert missing is None or "\n" not in missing and missing
    with pytest.raises(EngineError, match="not numerics.md"):
        SageEngine().run(None, Config())


def test_an_engine_that_edits_its_input_is_reported():
    from apa_emu import peers

    q, k, v = _inputs(n=64)
    before = k.copy()
    with pytest.raises(EngineError, match=r"^engine edits-k modified its input k in place \(first at index"):
        peers.check(peer.EditsK(), q, k, v)
    assert np.array_equal(k, before)  # it edited the copy it was handed


def _edits_k(q, k, v, q_offset, config):
    k[..., 0] = 0
    return apa_emu.attention(q, k, v, q_offset, config)


def test_an_apa_engine_that_edits_its_input_is_reported():
    q, k, v = _inputs(n=20, h_q=2, h_k=1)
    with pytest.raises(EngineError, match="engine _edits_k modified its input k in place"):
        check(wrap(_edits_k)(), (q, k, v, 0), {}, Config())


def test_untouched_inputs_are_compared_where_they_live():
    torch = pytest.importorskip("torch")
    a = torch.ones(3, 4, dtype=torch.float16)
    given = a.clone()
    check_untouched("t", dict(q=a), dict(q=given))
    given[1, 2] = 2
    with pytest.raises(EngineError, match=r"modified its input q in place \(first at index \(1, 2\)\)"):
        check_untouched("t", dict(q=a), dict(q=given))


@settings(max_examples=examples(60), deadline=None)
@given(peer_problems((64, 128)))
def test_generated_problems_stay_within_the_kernels_reach(problem):
    assert peer_check.problem_lacks(peer.Faithful(), problem) is None
    (q, k, v, q_offset), kwargs = problem.arguments()
    assert not kwargs and q_offset == 0 and q.ndim == 3 and q.shape[0] == k.shape[0] and q.shape[2] in (64, 128)
    sa.check_inputs(q, k, v)
