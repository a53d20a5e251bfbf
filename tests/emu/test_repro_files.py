"""`apa check --repro` validates its JSON field by field: a field of the wrong type, out of range,
unknown or out of place is one error line naming it (exit 2), never a traceback, and never ignored or
read as something else; sizes are checked before anything is allocated."""

from __future__ import annotations

import json

import pytest

from apa_emu.study.cli import main
from apa_emu.study.dump import write_dump
from apa_emu.study.synth import synthetic

P = dict(seed=1, B=1, n=8, Hkv=1, G=2, d=64, S=40, structure="normal", batched=False, q_offset=32)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """16 rows, 4/2 heads, 128 keys: one warp per KV head."""
    d = synthetic(16, 128, 4, 2, 64, seed=3)
    return str(write_dump(tmp_path_factory.mktemp("repro") / "tiny.apadump", d.q, d.k, d.v, d.q_offset))


def _error(capsys, repro) -> str:
    text = repro if isinstance(repro, str) else json.dumps(repro)
    assert main(["check", "--engine", "cpu", "--repro", text]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in out + err, err
    return err


@pytest.mark.parametrize("repro, words", [
    ("", "--repro: not JSON"),
    ({"problem": None}, "--repro: problem: expected an object"),
    ({"problem": 5}, "--repro: problem: expected an object"),
    ({"problem": [1, 2]}, "--repro: problem: expected an object"),
    ({"problem": "x"}, "--repro: problem: not JSON"),
    ({"problem": {**P, "page_size": 0}}, "--repro: problem: page_size=0: expected an integer >= 1"),
    ({"problem": {**P, "page_size": 2.5}}, "--repro: problem: page_size=2.5"),
    ({"problem": {**P, "seed": 1.5}}, "--repro: problem: seed=1.5"),
    ({"problem": {**P, "seed": -1}}, "--repro: problem: seed=-1: expected an integer >= 0"),
    ({"problem": {**P, "n": 2.5}}, "--repro: problem: n=2.5"),
    ({"problem": {**P, "n": -3}}, "--repro: problem: n=-3: expected an integer >= 1"),
    ({"problem": {**P, "d": "64"}}, "--repro: problem: d='64'"),
    ({"problem": {**P, "B": True}}, "--repro: problem: B=True"),
    ({"problem": {**P, "seqlens": [[1]]}}, "--repro: problem: seqlens=[[1]]"),
    ({"problem": {**P, "seqlens": [[1, 2, 3]]}}, "--repro: problem: seqlens=[[1, 2, 3]]"),
    ({"problem": {**P, "seqlens": 5}}, "--repro: problem: seqlens=5"),
    ({"problem": {**P, "structure": "bogus"}}, "--repro: problem: structure='bogus'"),
    ({"problem": {**P, "structure": 3}}, "--repro: problem: structure=3"),
    ({"problem": {**P, "batched": "yes"}}, "--repro: problem: batched='yes'"),
    ({"problem": {k: v for k, v in P.items() if k != "S"}}, "--repro: problem: missing field 'S'"),
    ({"problem": P, "config": []}, "--repro: config=[]"),
    ({"problem": P, "config": None}, "--repro: config=None"),
    ({"problem": P, "config": {"bogus": 1}}, "--repro: config: unknown field 'bogus'"),
    ({"problem": P, "config": {"q_terms": 2.0}}, "--repro: config.q_terms=2.0"),
    ({"problem": P, "max_rel_l2": None}, "--repro: max_rel_l2=None"),
    ({"problem": P, "max_rel_l2": "abc"}, "--repro: max_rel_l2='abc'"),
    ({"problem": P, "max_rel_l2": -1}, "--repro: max_rel_l2=-1"),
    ({"problem": P, "mode": "fast"}, "--repro: mode 'fast'"),
    ({"problem": P, "options": {"schedule": "fused"}}, "--repro: options: engine cpu takes no option 'schedule'"),
    ({"problem": P, "options": []}, "--repro: options=[]"),
    ({"problem": P, "warps": [0]}, "--repro: field 'warps' does not belong in a problem replay"),
    ({"problem": P, "colour": 1}, "--repro: field 'colour' does not belong"),
    ({"dump": 5}, "--repro: dump=5"),
    ({"dump": "x.apadump", "problem": P}, "--repro: expected the JSON a failure printed"),
])
def test_a_bad_field_is_one_line_naming_it(capsys, repro, words):
    assert _error(capsys, repro).startswith(f"apa: error: {words}")


@pytest.mark.parametrize("extra, words", [
    (dict(warps="abc"), "--repro: warps='abc'"), (dict(warps=0), "--repro: warps=0"),
    (dict(warps=[0.5]), "--repro: warps=[0.5]"), (dict(warps=[]), "--repro: warps=[]"),
    (dict(kv_head=7, warps=[0]), "--repro: kv_head=7: tiny.apadump has KV heads 0..1"),
    (dict(kv_head=-1), "--repro: kv_head=-1"), (dict(kv_head="0"), "--repro: kv_head='0'"),
])
def test_a_bad_dump_field_is_one_line_naming_it(capsys, dump, extra, words):
    assert _error(capsys, {"dump": dump, **extra}).startswith(f"apa: error: {words}")


def test_kv_head_replays_that_head_alone(capsys, dump, monkeypatch):
    from apa_emu.study import check

    heads = []

    def spy(engine, args, *rest, **kw):
        heads.append(args[0].shape[1])  # the KV head's query heads, of G = 2
        return checked(engine, args, *rest, **kw)

    checked = check.check
    monkeypatch.setattr(check, "check", spy)
    assert main(["check", "--engine", "cpu", "--repro", json.dumps({"dump": dump, "kv_head": 1, "warps": [0]})]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("apa check: PASS")
    assert heads == [2], "a replay naming one KV head must check that head alone"


def test_a_huge_page_size_is_refused_before_any_allocation(capsys, monkeypatch):
    import apa_emu.problems

    def allocates(*a, **kw):
        raise AssertionError("paginate ran before the size check")

    monkeypatch.setattr(apa_emu.problems, "paginate", allocates)
    err = _error(capsys, {"problem": {**P, "page_size": 10**9}})
    assert err.startswith("apa: error: out of memory: problem: ") and "page_size 1000000000 needs about" in err
