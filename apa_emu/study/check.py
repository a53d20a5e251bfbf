"""``apa check``: an engine against the emulator (apa_emu.compare.check), by default the GPU kernel,
bitwise, for anyone who edits ``cuda/``; any engine with ``--engine`` (a registered name or
``module:callable``, docs/engines.md), bitwise when it claims bit-exactness, else in tolerance. An
engine of a peer kernel (its ``recipe``, such as SageAttention's) is held against that recipe instead
(apa_emu.study.peer_check).

An engine with launch schedules (the kernel's "schedule" option: ``separate``, ``fused``,
``bounded``) runs under every chosen one, since each is its own code path. The kernel runs on the
device, or on the kernel simulator under ``APA_GPU_BACKEND=sim`` (cuda/sim).

On a dump, one KV head at a time (a head is a whole problem of its own, numerics.md §5): the chosen
warps. Or on problems and configs that Hypothesis generates (``apa_emu.strategies``), shrunk to a
minimal failing one. A bitwise divergence is named by stage, warp, tile and field with both values,
and by the first differing (row, head); a tolerance check reports where the engine departs from APA.
Every failure prints one command that replays it (``apa check --engine NAME --repro JSON``; for the
kernel also ``python -m apa_gpu.replay FILE``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import tempfile
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import engines
from .. import trace as tr
from ..compare import (MAX_REL_L2, Outcome, ToleranceReport, check, config_to_json, describe, rel_l2_bound,
                       resolve_mode, save_reproducer)
from ..config import Config
from ..engines import Engine
from ..geometry import ROWS
from ..peers import APA
from ..problems import Problem
from . import peer_check
from .engine import BackendError, ready

KERNEL = "gpu"  # the engine apa check compares with the emulator unless --engine names another


def engine_class(name: str) -> type[Engine]:
    """The engine called ``name`` or given as ``module:callable``; one line when there is none."""
    try:
        return engines.load(name)
    except KeyError as e:
        raise BackendError(f"--engine {name}: {e.args[0]}") from None


def kernel_class() -> type[Engine] | None:
    """The kernel's engine class; None when none is registered (apa check says so when it runs)."""
    try:
        return engines.load(KERNEL)
    except KeyError:
        return None


def kernel_schedules() -> tuple[str, ...]:
    """The kernel's launch schedules, each of which apa check runs (none known under a bad
    $APA_ENGINES, which apa check reports as it loads its engine)."""
    try:
        cls = kernel_class()
    except ValueError:
        return ()
    return tuple(cls.options.get("schedule", ())) if cls else ()


def require(name: str, dims, overrides=()) -> tuple[Engine, Config]:
    """The engine ``name`` and the config to check it under (``claimed``), when it can run that config
    at head dims ``dims`` here (else BackendError)."""
    if name == KERNEL:
        cls = kernel_class()
        if cls is None:
            raise BackendError(f"apa check runs the kernel: no engine {KERNEL!r} is registered (pip install -e '.[gpu]')")
    else:
        cls = engine_class(name)
    cfg = claimed(cls, overrides)
    engine, why = ready(cls, [cfg], dims)
    if why:
        raise BackendError(f"apa check runs the kernel: {why}" if name == KERNEL else f"--engine {name}: {why}")
    return engine, cfg


def claimed(engine, overrides) -> Config:
    """The config to check: the one the engine claims (its ``config``, e.g. preset=seed), with the
    user's --config toggles on top."""
    return Config.from_overrides(list(overrides or []), base=Config.from_overrides(list(engine.config)))


def launches(engine: Engine, schedules) -> list[tuple[str, dict]]:
    """(words, run options) of each launch schedule to run: the chosen ones when the engine has any."""
    if "schedule" not in engine.options:
        return [("", {})]
    return [(f", {s} schedule", dict(schedule=s)) for s in (schedules or engine.options["schedule"])]


_RECORD_STAGES = {
    "visits": "pass 1 (visit records: frames, tile sums, hot votes)",
    "hot": "pass 1 (hot-tile masks)",
    "out": "the merge (FP16 output)",
    "err_bound": "the certificate (err_bound)",
    "err_est": "the error estimate (err_est)",
}


def stage_of(div: dict) -> str:
    """The stage of the kernel that wrote the first divergent value (§7–§10)."""
    if div["where"] == "rows":
        return next((stage for stage, fields in tr.STAGES if div.get("field") in fields), "row records")
    return _RECORD_STAGES.get(div["where"], div["where"])


def _subject(engine: str) -> str:
    return "the kernel" if engine == KERNEL else f"engine {engine}"


@dataclass(frozen=True)
class Divergence:
    """A failed check: where (the dump and KV head, or the generated problem), and the Outcome
    (bitwise: the first divergence, named by its stage; tolerance: the report); ``command`` replays
    it, and for the kernel ``reproducer`` is also a file for ``python -m apa_gpu.replay``."""

    where: str
    outcome: Outcome
    command: str
    reproducer: Path | None = None
    failed: int = 1  # the checks it fails: a dump's KV head fails all its chosen warps

    @property
    def stage(self) -> str | None:
        return stage_of(self.outcome.divergence) if self.outcome.divergence else None

    def lines(self) -> list[str]:
        o = self.outcome
        if o.mode == "bitwise":
            lines = [f"apa check: {_subject(o.engine)} differs from the emulator in {self.where}, stage {self.stage}",
                     f"  {describe(o.divergence)}"]
            if self.reproducer:
                lines.append(f"  reproducer: python -m apa_gpu.replay {self.reproducer}")
            if o.pair is not None:
                *lead, row, head = o.pair
                lines.append(f"  first differing (row, head): ({row}, {head})" + (f" of batch {lead[0]}" if lead else ""))
        else:
            lines = [f"apa check: {_subject(o.engine)} departs from the emulator beyond relative L2 "
                     f"{o.report.bound:g} in {self.where}", *(f"  {line}" for line in o.report.lines())]
        return [*lines, f"  replay: {self.command}"]


def _command(spec: str, repro: dict) -> str:
    return f"apa check --engine {shlex.quote(spec)} --repro {shlex.quote(json.dumps(repro, separators=(',', ':')))}"


def _in_dump(div: dict | None, hk: int, G: int) -> dict | None:
    """A divergence of a KV head's problem, located in the whole dump."""
    if div is None:
        return None
    div = dict(div)
    if "hk" in div:
        div["hk"] = hk
    if div["where"] == "hot" and "index (b, hk, warp, word)" in div:
        b, _, w, word = div["index (b, hk, warp, word)"]
        div["index (b, hk, warp, word)"] = (b, hk, w, word)
    if div["where"] not in ("visits", "hot", "rows") and "index" in div:
        row, head, *ch = div["index"]
        div["index"] = (row, hk * G + head, *ch)
    return div


def _head_problem(dump, hk: int):
    G = dump.group
    return tuple(np.ascontiguousarray(x) for x in (dump.q[:, hk * G:(hk + 1) * G], dump.k[:, hk:hk + 1],
                                                   dump.v[:, hk:hk + 1]))


def check_dump(engine: Engine, spec: str, dump, path: Path, cfg: Config, warps=None, *, mode="auto",
               schedules=None, max_rel_l2=MAX_REL_L2, workers=1, progress=None, heads=None):
    """``engine`` (named ``spec`` on the command line) against the emulator on ``warps`` (indices
    within each KV head; None: all) of the KV heads ``heads`` of ``dump`` (None: every one). Returns the first Divergence (None),
    the number of warps that passed, and in tolerance mode the report of every pair compared."""
    mode = resolve_mode(engine, mode)
    G = dump.group
    nw = -(-dump.n * G // ROWS)
    chosen = np.arange(nw) if warps is None else np.asarray(warps)
    if chosen.size == 0 or chosen.min() < 0 or chosen.max() >= nw:
        raise ValueError(f"--warps: {path.name} has warps 0..{nw - 1} per KV head")
    triples = [(0, 0, int(w)) for w in chosen]
    parts, done = [], 0
    heads = range(dump.nkv) if heads is None else heads
    for hk in heads:
        q, k, v = _head_problem(dump, hk)
        for words, options in launches(engine, schedules):
            outcome = check(engine, (q, k, v, dump.q_offset), {}, cfg, mode, warps=triples, options=options,
                            max_rel_l2=max_rel_l2, workers=workers)
            if mode == "tolerance":
                m = outcome.measures
                m.index[:, -1] += hk * G
                parts.append(m)
            if not outcome.passed and mode == "bitwise":
                outcome.divergence = _in_dump(outcome.divergence, hk, G)
                if outcome.pair is not None:
                    outcome.pair = (outcome.pair[0], hk * G + outcome.pair[1])
                repro = dict(dump=str(path), kv_head=hk, warps=[int(w) for w in chosen],
                             config=json.loads(config_to_json(cfg)), mode=mode, options=options)
                file = (save_reproducer(q, k, v, dump.q_offset, cfg, triples, note=path.name,
                                        schedule=options.get("schedule", "separate"))
                        if engine.name == KERNEL else None)
                return Divergence(f"{path.name} (KV head {hk}{words})", outcome, _command(spec, repro), file,
                                  chosen.size), done, None
        done += chosen.size
        if progress:
            progress(done, len(heads) * chosen.size)
    if mode == "bitwise":
        return None, done, None
    report = ToleranceReport.of(parts, max_rel_l2)
    if report.passed:
        return None, done, report
    repro = dict(dump=str(path), warps=[int(w) for w in chosen], config=json.loads(config_to_json(cfg)), mode=mode,
                 max_rel_l2=max_rel_l2)
    return Divergence(path.name, Outcome(engine.name, mode, False, report=report), _command(spec, repro)), done, report


class _Failed(Exception):
    pass


@contextmanager
def _hypothesis_home():
    """Hypothesis keeps caches in its home folder, ./.hypothesis unless $HYPOTHESIS_STORAGE_DIRECTORY
    names one; a command writes no file its options do not name, so without that variable the home
    is a temporary folder, removed after the run (the example database is off: database=None)."""
    from hypothesis.configuration import set_hypothesis_home_dir

    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="apa-hypothesis-") as home:
        set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)  # back to $HYPOTHESIS_STORAGE_DIRECTORY or ./.hypothesis


def examples(n: int, seed: int, strategy, body):
    """Run ``body(example, failed)`` on ``n`` examples Hypothesis draws from ``strategy`` with ``seed``
    (``failed``: whether one has failed already, while Hypothesis shrinks it); ``body`` returns a
    failure or None, and the first failure is shrunk to a minimal one. Returns the last failure
    Hypothesis ran (the shrunk one), or None."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as seeded

    failures = []

    @seeded(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
              verbosity=Verbosity.quiet, report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def example(drawn):
        found = body(drawn, bool(failures))
        if found is not None:
            failures.append(found)
            raise _Failed

    with _hypothesis_home(), suppress(_Failed):
        example()
    return failures[-1] if failures else None


# Config fields whose drawn values apa check --hypothesis counts, so a run shows which modes it met
TALLIED = ("exp2", "hot_test", "p2_accum", "p2_scores")


def check_generated(engine: Engine, spec: str, n: int, seed: int, *, mode="auto", schedules=None,
                    max_rel_l2=MAX_REL_L2, progress=None, tally=None):
    """``engine`` against the emulator on ``n`` problems and configs drawn by Hypothesis from ``seed``:
    the problems the engine can run (its features and head dims), every config it does not lack, or
    the one it claims. A failure is shrunk to a minimal failing problem. Returns the Divergence (None),
    the problems checked up to it, and in tolerance mode the worst problem's report. ``tally`` (a
    Counter) counts the (field, value) pairs of ``TALLIED`` among the configs checked."""
    try:
        from hypothesis import assume
        from hypothesis import strategies as st

        from ..strategies import configs, engine_problems
    except ImportError as e:
        raise ImportError(f"apa check --hypothesis needs Hypothesis ({e}); pip install -e '.[test]'") from None
    mode = resolve_mode(engine, mode)
    drawn = st.just(claimed(engine, ())) if engine.config else configs()
    done, worst = [0], [None]

    def body(drawn_pair, failed):
        problem, cfg = drawn_pair
        assume(engine.lacks(cfg, problem.d) is None)
        if not failed:
            done[0] += 1
            if tally is not None:
                tally.update((k, getattr(cfg, k)) for k in TALLIED)
        args, kwargs = problem.arguments()
        for words, options in launches(engine, schedules):
            try:
                outcome = check(engine, args, kwargs, cfg, mode, options=options, max_rel_l2=max_rel_l2)
            except engines.EngineError as e:
                return problem, cfg, options, words, e
            if not outcome.passed:
                return problem, cfg, options, words, outcome
            if mode == "tolerance" and not failed and (worst[0] is None or outcome.report.worst_rel >
                                                       worst[0].worst_rel):
                worst[0] = outcome.report
                worst[0].problem = f"{problem.describe()}, {cfg}{words}"
        if progress and not failed:
            progress(done[0], n)
        return None

    failure = examples(n, seed, st.tuples(engine_problems(engine.features, engine.head_dims), drawn), body)
    if failure is None:
        return None, done[0], worst[0]
    return _generated_divergence(engine, spec, mode, max_rel_l2, failure, done[0]), done[0], None


def _generated_divergence(engine: Engine, spec: str, mode: str, max_rel_l2: float, failure, number: int):
    """The Divergence of a generated problem (its replay, the kernel's reproducer file); an engine
    error is raised, with the replay."""
    problem, cfg, options, words, found = failure
    repro = dict(problem=json.loads(problem.to_json()), config=json.loads(config_to_json(cfg)), mode=mode,
                 options=options, **(dict(max_rel_l2=max_rel_l2) if mode == "tolerance" else {}))
    command = _command(spec, repro)
    if isinstance(found, engines.EngineError):
        raise engines.EngineError(f"{found} on generated problem {number}; replay: {command}")
    file = None
    if engine.name == KERNEL and problem.seqlens is None:
        args, kwargs = problem.arguments()
        file = save_reproducer(*args, cfg, "all", note=problem.describe(), schedule=options.get("schedule", "separate"),
                               **kwargs)
    where = f"generated problem {number} (shrunk: {problem.describe()}, {cfg}{words})"
    return Divergence(where, found, command, file)


_REPRO_FIELDS = {"problem": "a generated problem's fields", "dump": "a dump file's path",
                 "kv_head": "the dump's KV head", "warps": "warps of each KV head", "config": "Config fields",
                 "mode": "the check's mode", "options": "the engine's run options",
                 "max_rel_l2": "tolerance mode's bound"}


def _repro_fields(text: str, engine: Engine) -> dict:
    """``--repro``'s JSON checked field by field (each wrong one a ValueError naming it), with the
    config, mode, options and bound resolved."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--repro: not JSON ({e})") from None
    if not isinstance(data, dict) or len({"problem", "dump"} & set(data)) != 1:
        raise ValueError("--repro: expected the JSON a failure printed, with a 'problem' or a 'dump' (one of them)")
    unknown = sorted(set(data) - set(_REPRO_FIELDS) | ({"kv_head", "warps"} & set(data) if "problem" in data else set()))
    if unknown:
        raise ValueError(f"--repro: field {unknown[0]!r} does not belong in a {'dump' if 'dump' in data else 'problem'}"
                         f" replay (fields: {', '.join(f'{k} ({v})' for k, v in _REPRO_FIELDS.items())})")
    if "dump" in data and not (isinstance(data["dump"], str) and data["dump"]):
        raise ValueError(f"--repro: dump={data['dump']!r}: expected a dump file's path")
    kv_head, warps = data.get("kv_head"), data.get("warps")
    if kv_head is not None and not (type(kv_head) is int and kv_head >= 0):
        raise ValueError(f"--repro: kv_head={kv_head!r}: expected an integer >= 0")
    if warps is not None and not (isinstance(warps, list) and warps and all(type(w) is int for w in warps)):
        raise ValueError(f"--repro: warps={warps!r}: expected a non-empty list of integers")
    config = data.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"--repro: config={config!r}: expected an object of Config fields")
    known = [f.name for f in dataclasses.fields(Config)]
    bad = sorted(set(config) - set(known))
    if bad:
        raise ValueError(f"--repro: config: unknown field {bad[0]!r} (fields: {', '.join(known)})")
    try:
        data["config"] = Config(**config)
        data["max_rel_l2"] = rel_l2_bound(data.get("max_rel_l2", MAX_REL_L2))
        resolve_mode(engine, data.setdefault("mode", "auto"))
        if "problem" in data:
            data["problem"] = Problem.from_json(data["problem"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"--repro: {e}") from None
    data["options"] = _repro_options(data.get("options", {}), engine)
    return data


def _repro_options(options, engine: Engine) -> dict:
    """The run options of a replay: those the engine takes (the kernel's schedule), with their values."""
    if not isinstance(options, dict):
        raise ValueError(f"--repro: options={options!r}: expected an object of the engine's run options")
    for key, value in options.items():
        if key not in engine.options:
            takes = ", ".join(engine.options) or "none"
            raise ValueError(f"--repro: options: engine {engine.name} takes no option {key!r} (it takes: {takes})")
        if value not in engine.options[key]:
            raise ValueError(f"--repro: options: {key}={value!r}: expected one of {', '.join(engine.options[key])}")
    return options


def replay(engine: Engine, spec: str, text: str, progress=None):
    """Rerun one check from ``--repro`` JSON (what a failure printed): a generated problem or a dump's
    warps (of one KV head, when it names one). Returns (Divergence or None, report or None)."""
    from .dump import read_dump

    data = _repro_fields(text, engine)
    if engine.recipe != APA:
        return peer_check.replay(engine, spec, data), None
    cfg, mode, options, bound = data["config"], data["mode"], data["options"], data["max_rel_l2"]
    if "dump" in data:
        path = Path(data["dump"])
        dump = read_dump(path)
        heads = None
        if data.get("kv_head") is not None:
            if data["kv_head"] >= dump.nkv:
                raise ValueError(f"--repro: kv_head={data['kv_head']}: {path.name} has KV heads 0..{dump.nkv - 1}")
            heads = [data["kv_head"]]
        schedules = [options["schedule"]] if "schedule" in options else None
        div, _, report = check_dump(engine, spec, dump, path, cfg, data.get("warps"), mode=mode, schedules=schedules,
                                    max_rel_l2=bound, progress=progress, heads=heads)
        return div, report
    problem = data["problem"]
    args, kwargs = problem.arguments()
    outcome = check(engine, args, kwargs, cfg, mode, options=options, max_rel_l2=bound)
    if outcome.passed:
        return None, outcome.report
    repro = dict(json.loads(text), config=json.loads(config_to_json(cfg)))
    return Divergence(f"the problem replayed ({problem.describe()}, {cfg})", outcome, _command(spec, repro)), None
