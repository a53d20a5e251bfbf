"""Every way to name or declare an engine wrongly, and every ill-typed field of a Result it returns,
is one error line naming the engine and what is wrong: a class that is not an Engine, the Engine
interface itself, a constructor that raises, a malformed or unloadable $APA_ENGINES entry (which
stops only the commands that choose an engine), a bad declaration, a head dim the engine does not
declare, and a Result field of the wrong type or shape, in apa check and in the studies."""

from __future__ import annotations

import pytest
from helpers import one_error_line, tiny_dump

from apa_emu.engines import EngineError, engine
from apa_emu.study.cli import main

H = "user_engines.hostile"


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    return tiny_dump(tmp_path_factory.mktemp("refusals"))


@pytest.mark.parametrize("spec, words", [
    ("builtins:dict", "engine builtins:dict: class dict is not an apa_emu Engine"),
    (f"{H}:NotEngine", f"engine {H}:NotEngine: class NotEngine is not an apa_emu Engine"),
    ("apa_emu.engines:Engine", "engine apa_emu.engines:Engine: class Engine is the Engine interface"),
    ("apa_emu.engines:FunctionEngine", "engine apa_emu.engines:FunctionEngine: class FunctionEngine is the Engine"),
    (f"{H}:BadInit", "engine bad-init raised RuntimeError: cannot build"),
])
@pytest.mark.parametrize("command", ["check", "scan"])
def test_a_class_that_cannot_be_an_engine_is_one_line(capsys, dump, spec, words, command):
    argv = ["check", "--engine", spec, dump] if command == "check" else ["scan", dump, "--backend", spec]
    one_error_line(capsys, argv, words)


@pytest.mark.parametrize("value, words", [
    ("mine==user_engines.hostile:only_128", "APA_ENGINES: 'mine==user_engines.hostile:only_128' is not name"),
    ("=user_engines.hostile:only_128", "APA_ENGINES: '=user_engines.hostile:only_128' is not name"),
    ("mine=nosuch_module_xyz:f", "engine mine (registered by $APA_ENGINES): cannot load nosuch_module_xyz:f: "
                                 "ModuleNotFoundError"),
    ("mine=user_engines.hostile:nosuch", "engine mine (registered by $APA_ENGINES): cannot load "),
])
def test_a_bad_registration_is_one_line_naming_it(capsys, dump, monkeypatch, value, words):
    monkeypatch.setenv("APA_ENGINES", value)
    one_error_line(capsys, ["check", "--engine", "mine", dump], words)


def test_a_bad_registration_stops_only_the_commands_that_choose_an_engine(capsys, dump, monkeypatch, tmp_path):
    monkeypatch.setenv("APA_ENGINES", "foo")
    assert main(["--help"]) == 0
    assert main(["synth", str(tmp_path / "t.apadump"), "--n", "16", "--kv", "64", "--heads", "2", "--kv-heads", "1",
                 "--d", "64"]) == 0
    capsys.readouterr()
    one_error_line(capsys, ["scan", dump], "scan: argument --backend: APA_ENGINES: 'foo' is not name=module:Class")


@pytest.mark.parametrize("kw, words", [
    (dict(head_dims=()), r"head_dims=\(\): expected some of \(64, 128, 256\)"),
    (dict(head_dims="64"), r"head_dims='64'"), (dict(head_dims=(96,)), r"head_dims=\(96,\)"),
    (dict(head_dims=5), r"head_dims=5"), (dict(config=42), r"config=42: expected Config overrides"),
])
def test_a_bad_declaration_is_refused_as_declared(kw, words):
    with pytest.raises(EngineError, match=rf"^engine f: {words}"):
        @engine(**kw)
        def f(q, k, v, q_offset=0, config=None):
            return None


@pytest.mark.parametrize("argv", [["check", "--engine", f"{H}:only_128"], ["scan", "--backend", f"{H}:only_128"]],
                         ids=["check", "scan"])
def test_a_head_dim_the_engine_does_not_declare_is_refused_on_dumps(capsys, dump, argv):
    argv = [*argv[:1], dump, *argv[1:]] if argv[0] == "scan" else [*argv, dump]
    one_error_line(capsys, argv, f"{'--engine' if argv[0] == 'check' else '--backend'} {H}:only_128: engine only_128 "
                            f"does not run head dim 64 (it declares head dims 128)")


@pytest.mark.parametrize("fn, words", [
    ("str_hot", "engine str_hot returned hot of type str, expected an integer array"),
    ("flat_bound", f"engine {H}:flat_bound returned err_bound of shape (3,), expected (16, 2)"),
    ("list_est", f"engine {H}:list_est returned err_est of type list, expected a float array"),
    ("float_tiles", f"engine {H}:float_tiles returned hot_tiles=1.5, expected an integer (or None)"),
    ("plain_visits", "engine plain_visits returned visits of type ndarray and dtype int8, expected §10's"),
])
@pytest.mark.parametrize("command", [["check", "--warps", "0"], ["scan", "--rows", "0"], ["worst", "--by", "est"],
                                     ["pair", "--row", "0", "--head", "0", "--plot", ""]],
                         ids=["check", "scan", "worst", "pair"])
def test_an_ill_typed_result_field_is_one_line_naming_it(capsys, dump, fn, words, command):
    name, *options = command
    spec = f"{H}:{fn}"
    argv = [name, "--engine", spec, dump, *options] if name == "check" else [name, dump, "--backend", spec, *options]
    one_error_line(capsys, argv, words)
