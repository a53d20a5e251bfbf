"""Check your own kernel with pytest and Hypothesis (docs/engines.md): a pytest plugin
(``pytest -p apa_emu.testing``, or automatic once installed: the ``pytest11`` entry point).

- ``assert_matches_emulator(engine, problem, config=None, mode="auto")``: the engine against the
  emulator, bitwise when it claims bit-exactness, else in tolerance (apa_emu.compare.check); a failure
  is an AssertionError whose message ends in the one command that replays it.
- The Hypothesis strategies, the ones our own tests and ``apa check --hypothesis`` draw from:
  ``problems(features, dims, seen)`` (``Problem``: sinks, outliers, subnormals, GQA, batches, windows,
  pages, varlen, as far as the engine declares them), ``configs()`` and ``large_logits()``. Imported
  from here on first use, so that the plugin loads where Hypothesis is not installed.
- ``Seen``: what a property met. The strategies and ``assert_matches_emulator`` count their cases
  into it, so that a property can ``require`` that its interesting case happened.
- ``--apa-engine NAME|module:callable`` and the ``apa_engine`` fixture: the engine a suite checks.
"""

from __future__ import annotations

import inspect
import json
import shlex
from collections import Counter

import pytest

from . import engines
from .call import resolve_call, resolve_config
from .compare import MAX_REL_L2, check, config_to_json
from .config import Config
from .problems import Problem

__all__ = ["Seen", "assert_matches_emulator", "as_engine", "repro_command", "problems", "configs", "large_logits",
           "Problem"]

_STRATEGIES = {"problems": "engine_problems", "configs": "configs", "large_logits": "large_logits"}


def __getattr__(name: str):
    """The Hypothesis strategies, imported on first use (Hypothesis is the test extra)."""
    if name in _STRATEGIES:
        from . import strategies

        return getattr(strategies, _STRATEGIES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Seen(Counter):
    """Counts events across a property's examples; ``require`` fails for any that never happened."""

    def require(self, *events: str) -> None:
        bad = [e for e in events if not isinstance(e, str)]
        if bad:
            raise ValueError(f"Seen.require: {bad[0]!r} is not an event name (a string)")
        missing = [e for e in events if not self[e]]
        assert not missing, f"the property never met: {', '.join(missing)} (seen: {dict(self)})"


def as_engine(engine) -> engines.Engine:
    """An Engine from what a test holds: an Engine, an Engine class, a function (``engines.wrap``), or
    a name or ``module:callable`` (``engines.load``)."""
    if isinstance(engine, engines.Engine):
        return engine
    if isinstance(engine, str):
        return engines.load(engine)()
    if isinstance(engine, type) and issubclass(engine, engines.Engine):
        return engine()
    if callable(engine):
        return engines.wrap(engine)()
    raise engines.EngineError(f"engine {engine!r}: expected an Engine, a function, a name or module:callable")


def _spec(engine) -> str | None:
    """How ``apa check --engine`` names ``engine``, where it can: its name as given or registered,
    else its function's or class's ``module:qualname``."""
    if isinstance(engine, str):
        return engine
    if isinstance(engine, engines.Engine) and engine.name in ("cpu", *engines.registered()):
        return engine.name
    cls = type(engine) if isinstance(engine, engines.Engine) else engine
    target = getattr(cls, "function", None) or cls
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}:{name}" if module and name and "<" not in name else None


def repro_command(engine, problem: Problem, config: Config, mode: str, options=None,
                  max_rel_l2: float = MAX_REL_L2) -> str | None:
    """The one command that replays a check of a generated problem (None for arrays: no command
    carries them)."""
    if not isinstance(problem, Problem):
        raise ValueError(f"repro_command: problem={problem!r}: expected a Problem (arrays have no command)")
    spec = _spec(engine)
    if spec is None:
        return None
    text = json.dumps(dict(problem=json.loads(problem.to_json()), config=json.loads(config_to_json(config)),
                           mode=mode, options=options or {}, max_rel_l2=max_rel_l2), separators=(",", ":"))
    return f"apa check --engine {shlex.quote(spec)} --repro {shlex.quote(text)}"


def claimed_config(engine: engines.Engine) -> Config:
    """The config an engine claims (its ``config`` overrides, e.g. preset=seed), else the default."""
    return Config.from_overrides(list(engine.config))


def assert_matches_emulator(engine, problem, config: Config | None = None, mode: str = "auto", *,
                            max_rel_l2: float = MAX_REL_L2, seen: Seen | None = None, options=None):
    """Check ``engine`` (see ``as_engine``) against the emulator on ``problem`` (a ``Problem``, or
    ``(args, kwargs)`` of ``attention``) under ``config`` (default: the one the engine claims), in
    ``mode`` ("auto": bitwise when the engine claims bit-exactness, "bitwise", "tolerance" with pairs
    within ``max_rel_l2``), the engine run with its ``options`` (the kernel's schedule). Returns the
    Outcome; raises AssertionError with the report and a replay command. ``seen`` counts the
    problem's hot and cold tiles and the outcome."""
    if seen is not None and not isinstance(seen, Counter):
        raise ValueError(f"seen={seen!r}: expected a Seen or None")
    chosen = as_engine(engine)
    cfg = claimed_config(chosen) if config is None else resolve_config(config)
    args, kwargs = problem.arguments() if isinstance(problem, Problem) else _call(problem)
    outcome = check(chosen, args, kwargs, cfg, mode, options=options, max_rel_l2=max_rel_l2)
    if seen is not None:
        emu = outcome.emulator
        seen.update(event for event, happened in (("hot tiles", emu.hot_tiles > 0),
                                                  ("cold tiles", emu.hot_tiles < emu.active_tiles),
                                                  ("passed", outcome.passed)) if happened)
    if not outcome.passed:
        if isinstance(problem, Problem):
            outcome.repro = repro_command(engine if isinstance(engine, str) else chosen, problem, cfg, outcome.mode,
                                          options, max_rel_l2)
        raise AssertionError("\n".join([*outcome.lines(), f"  problem: {_described(problem)}", f"  config: {cfg}"]))
    return outcome


def _call(problem) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``attention``, each checked: a ValueError naming what is wrong."""
    if not (isinstance(problem, (tuple, list)) and len(problem) == 2 and isinstance(problem[0], (tuple, list))
            and isinstance(problem[1], dict)):
        raise ValueError(f"problem: expected a Problem or (args, kwargs) of attention, a tuple and a dict, got "
                         f"{type(problem).__name__}" + (f" of {tuple(type(x).__name__ for x in problem)}"
                                                        if isinstance(problem, (tuple, list)) else ""))
    args, kwargs = problem
    known = set(inspect.signature(resolve_call).parameters)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"problem: attention takes no keyword {unknown[0]!r}")
    return tuple(args), kwargs


def _described(problem) -> str:
    if isinstance(problem, Problem):
        return problem.describe()
    (q, k, *_), kwargs = problem
    return f"q {q.shape}, k {k.shape}" + "".join(f", {key}" for key in sorted(kwargs))


# -- the pytest plugin ------------------------------------------------------------------------------


def pytest_addoption(parser):
    parser.getgroup("apa_emu").addoption(
        "--apa-engine", default=None, metavar="NAME",
        help="the engine the apa_engine fixture checks: a registered name or module:callable")


def pytest_configure(config):
    config.addinivalue_line("markers", "apa_engine: a test of an engine against the APA emulator")


@pytest.fixture
def apa_engine(request):
    """The Engine named by --apa-engine (the test is skipped when none is given)."""
    name = request.config.getoption("--apa-engine")
    if name is None:
        pytest.skip("no --apa-engine given")
    return as_engine(name)
