"""``apa check`` of an engine that implements a peer kernel's recipe (its ``recipe``, apa_emu.peers),
such as SageAttention's: the engine's output against the recipe's, bitwise (or in tolerance with
``--mode tolerance``), on dumps, on generated problems or on one replayed check.

A peer kernel here is causal with equal query and key lengths. A dump's queries are its last rows
(row i at position q_offset + i): the query is padded in front with q_offset rows of zeros, the keys
cut after the last query's position (later keys are never seen), and only the dump's own rows are
compared. Zero rows leave the real rows' quantization blocks unchanged (a block's scale is its largest
magnitude), and their own outputs are not compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import engines, peers
from ..compare import resolve_mode
from ..engines import Engine
from ..problems import Problem


@dataclass(frozen=True)
class PeerDivergence:
    """A failed peer check: where, the outcome, and the one command that replays it."""

    where: str
    outcome: peers.PeerOutcome
    command: str
    failed: int = 1

    def lines(self) -> list[str]:
        o = self.outcome
        rec = peers.recipe(o.recipe)
        how = "bitwise" if o.mode == "bitwise" else f"beyond relative L2 {o.bound:g}"
        return [f"apa check: engine {o.engine} differs from the {rec.title} recipe ({rec.module}) {how} in "
                f"{self.where}", *(f"  {line}" for line in o.lines()), f"  replay: {self.command}"]


def padded(dump) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(q, k, v, first_row): the dump as a causal problem of equal lengths, q padded in front with
    zero rows and the keys cut after the last query's position; its rows are first_row onward."""
    last = dump.q_offset + dump.n  # at most dump.kv (apa_emu.study.dump)
    q = np.zeros((last, dump.nh, dump.hd), np.float16)
    q[dump.q_offset:] = dump.q
    return q, np.ascontiguousarray(dump.k[:last]), np.ascontiguousarray(dump.v[:last]), dump.q_offset


def _command(spec: str, repro: dict) -> str:
    from .check import _command as command

    return command(spec, repro)


def check_dump(engine: Engine, spec: str, dump, path: Path, *, mode="auto", max_rel_l2=0.1):
    """``engine`` against its recipe on a dump (every head at once). Returns the PeerDivergence
    (None) and the (row, head) pairs compared."""
    mode = resolve_mode(engine, mode)
    q, k, v, first = padded(dump)
    outcome = peers.check(engine, q, k, v, first_row=first, mode=mode, max_rel_l2=max_rel_l2)
    if outcome.passed:
        return None, dump.n * dump.nh
    repro = dict(dump=str(path), mode=mode, **(dict(max_rel_l2=max_rel_l2) if mode == "tolerance" else {}))
    return PeerDivergence(path.name, outcome, _command(spec, repro)), dump.n * dump.nh


def check_problem(engine: Engine, problem: Problem, *, mode: str, max_rel_l2: float) -> peers.PeerOutcome:
    """``engine`` against its recipe on a generated problem; a problem outside the peer kernel's
    reach is a ValueError of one line naming the engine and what it lacks."""
    why = problem_lacks(engine, problem)
    if why:
        raise ValueError(why)
    (q, k, v, _), _ = problem.arguments()
    return peers.check(engine, q, k, v, mode=mode, max_rel_l2=max_rel_l2)


def problem_lacks(engine: Engine, problem: Problem) -> str | None:
    """Why ``engine`` (a peer kernel: one batch element, causal, equal lengths, its head dims) cannot
    run ``problem``, in one line naming it; None when it can."""
    rec = peers.recipe(engine.recipe)
    name = f"engine {engine.name} ({rec.title})"
    for what, present in (("a sliding window", problem.window is not None), ("paged keys", problem.page_size
                          is not None), ("varlen batches", problem.seqlens is not None),
                          ("batches (B > 1)", problem.B > 1 or problem.batched)):
        if present:
            return f"{name} does not run {what}"
    if problem.n != problem.S or problem.q_offset:
        return f"{name} runs causal attention with equal lengths only (n {problem.n}, S {problem.S}, q_offset " \
               f"{problem.q_offset})"
    if problem.d not in rec.head_dims:
        return f"{name} does not run head dim {problem.d} (only {', '.join(map(str, rec.head_dims))})"
    return None


def check_generated(engine: Engine, spec: str, n: int, seed: int, *, mode="auto", max_rel_l2=0.1, progress=None):
    """``engine`` against its recipe on ``n`` problems Hypothesis draws within the peer kernel's reach
    (apa_emu.strategies.peer_problems), a failure shrunk. Returns the PeerDivergence (None) and the
    problems checked up to it."""
    from ..strategies import peer_problems
    from .check import examples

    mode = resolve_mode(engine, mode)
    done = [0]

    def body(problem, failed):
        if not failed:
            done[0] += 1
        try:
            outcome = check_problem(engine, problem, mode=mode, max_rel_l2=max_rel_l2)
        except engines.EngineError as e:
            return problem, e
        if progress and not failed:
            progress(done[0], n)
        return None if outcome.passed else (problem, outcome)

    failure = examples(n, seed, peer_problems(peers.recipe(engine.recipe).head_dims), body)
    if failure is None:
        return None, done[0]
    problem, found = failure
    repro = dict(problem=json.loads(problem.to_json()), mode=mode,
                 **(dict(max_rel_l2=max_rel_l2) if mode == "tolerance" else {}))
    command = _command(spec, repro)
    if isinstance(found, engines.EngineError):
        raise engines.EngineError(f"{found} on generated problem {done[0]}; replay: {command}")
    return PeerDivergence(f"generated problem {done[0]} (shrunk: {problem.describe()})", found, command), done[0]


def replay(engine: Engine, spec: str, data: dict):
    """Rerun one peer check from ``--repro``'s fields (checked by apa_emu.study.check): a dump or a
    generated problem. Returns the PeerDivergence or None."""
    from .dump import read_dump

    mode, bound = data["mode"], data["max_rel_l2"]
    if "dump" in data:
        if data.get("kv_head") is not None or data.get("warps") is not None:
            raise ValueError(f"--repro: engine {engine.name} checks a whole dump: no kv_head or warps")
        path = Path(data["dump"])
        return check_dump(engine, spec, read_dump(path), path, mode=mode, max_rel_l2=bound)[0]
    problem = data["problem"]
    outcome = check_problem(engine, problem, mode=resolve_mode(engine, mode), max_rel_l2=bound)
    if outcome.passed:
        return None
    repro = dict(problem=json.loads(problem.to_json()), mode=mode)
    return PeerDivergence(f"the problem replayed ({problem.describe()})", outcome, _command(spec, repro))
