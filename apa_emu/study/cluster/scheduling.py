"""The units of a study on a Dask client (``Runner``), put back in their order.

A unit of ``engine.run_units`` is one KV head of one dump, under every config of that call (the
float64 reference is shared between configs as in one process). A task is a run of units of one dump,
keyed ``apa-unit-...``, cut off the back of the queue ever shorter as it empties (``next_task``),
since a unit of the seed's sizes is tens of milliseconds on a GPU and a task's round trip about ten.
A worker opens the dump itself from its path, once per task, and sends back only the units'
per-pair arrays (``engine.UnitRun``), never Q, K or V. The runs are put back in the units' order
whatever order they finish in, so the tables are bitwise those of one process (on the CPU engine,
where the workers' BLAS runs as many threads as this process's: see startup.WORKER_ENVIRON).

Faults. A task whose worker dies is run again elsewhere by the scheduler, and a task that raises is
run once more. A unit that raises inside a task is run again alone; a unit that fails twice is None
among the runs, so that its pairs leave the study and every other unit's stay, and ``Runner.failed``
names it by dump, KV head and configs.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from contextlib import ExitStack

from ..dump import read_dump
from ..engine import run_unit
from ..report import cfg_name
from .options import Spec, import_distributed

KEY = "apa-unit"
TASKS_PER_WORKER = 2  # a task holds at most 1/(this x peers) of the units left: few round trips, a short tail
IN_FLIGHT = 2  # tasks given each worker thread at a time: the next is there when one ends, without a round trip
HERE = "this process"  # the timing's name for the units this process ran
SHOWN_CONFIGS = 3  # configs named in a failed unit's line (attribute runs some thirty per unit)


class Runner:
    """Where a study's units run: every ``run_units`` it is given goes to one Dask client and, on a
    local cluster that ``start`` brings up, to this process too; ``timing`` is each worker's count of
    units, their seconds and its first unit's, for --json; ``failed`` a line for each unit that failed
    twice.

    On a local cluster this process is a peer of its workers from the first unit to the last: it takes
    units off the front of the queue, one at a time, while the cluster starts and after; the workers,
    once warm, take tasks off the back (``next_task``), IN_FLIGHT per thread. The two meet in the
    middle, so the cluster's start costs only what it takes from this process (the GIL, a GPU shared),
    and the study ends with at most one short task still running on a worker."""

    def __init__(self, spec: Spec, client=None, start=None):
        self.spec, self.client, self.start, self.timing, self.failed = spec, client, start, {}, []

    def _up(self) -> bool:
        """Whether the cluster takes units: its workers warm (and SIGINT answered again)."""
        if self.client is None and self.start is not None and self.start.done.is_set():
            self.client = self.start.up()
        return self.client is not None

    def _count(self, where: str, seconds: float) -> None:
        mine = self.timing.setdefault(where, dict(units=0, seconds=0.0, first_unit_s=seconds))
        mine["units"] += 1
        mine["seconds"] += seconds

    def run_units(self, engine, dumps, units, configs, split, trace, progress):
        """``engine.run_units``'s units, run here and on the cluster: their runs in their order."""
        for i in sorted({u.dump for u in units}):
            if dumps[i].path is None:
                raise ValueError("--cluster needs dumps on disk: its workers open them by path")
        study = _Units(self, engine, dumps, units, configs, split, trace, progress)
        peer = self.start is not None  # a cluster of this study's own: this process takes units too
        try:
            with engine.context() if peer else ExitStack():
                while study.queue or study.futures or study.raised_here:
                    if study.pending is None and self._up():
                        study.open()
                    if study.pending is not None:
                        study.gather(block=not (peer and study.queue))
                    if peer and study.queue:
                        study.run_here()
                    elif study.pending is None:  # units that raised here wait for the cluster
                        self.start.done.wait()
            if peer:
                engine.release()
        finally:
            if study.futures:
                self.client.cancel(list(study.futures), force=True)
        self.failed += [line for _, line in sorted(study.failed)]
        return study.runs

    def report(self) -> dict:
        here = self.timing.get(HERE)
        return dict(cluster=str(self.spec), workers={w: {k: round(v, 6) for k, v in t.items()}
                                                      for w, t in sorted(self.timing.items()) if w != HERE},
                    **(dict(this_process={k: round(v, 6) for k, v in here.items()}) if here else {}),
                    **(self.start.report() if self.start else {}),
                    **(dict(failed=self.failed) if self.failed else {}))


class _Units:
    """One ``run_units`` call's units: the queue, what each finished unit gave (``runs``, in the units'
    order whatever order they finish in), the tasks on the cluster, the units that failed."""

    def __init__(self, runner: Runner, engine, dumps, units, configs, split, trace, progress):
        self.runner, self.engine, self.dumps, self.units = runner, engine, dumps, units
        self.configs, self.split, self.trace, self.progress = configs, split, trace, progress
        self.runs, self.queue, self.done = [None] * len(units), deque(range(len(units))), 0
        self.raised_here, self.failed, self.futures, self.pending = [], [], {}, None
        self.tag, self.submitted = uuid.uuid4().hex[:8], 0

    def _finished(self, i, seconds: float, where: str, run) -> None:
        self.runs[i] = run
        self.runner._count(where, seconds)
        self._tick()

    def _tick(self) -> None:
        self.done += 1
        if self.progress:
            self.progress(self.done, len(self.units))

    def run_here(self) -> None:
        i = self.queue.popleft()
        t0 = time.perf_counter()
        try:
            run = run_unit(self.engine, self.dumps[self.units[i].dump], self.units[i], self.configs,
                           split=self.split, trace=self.trace)
        except Exception:  # noqa: BLE001 (as a worker's: the unit is run again, alone, on the cluster)
            self.raised_here.append(i)
            return
        self._finished(i, time.perf_counter() - t0, HERE, run)

    def open(self) -> None:
        """The cluster is up: its first tasks."""
        client = self.runner.client
        self.threads = sum(client.nthreads().values())
        self.peers = len(client.nthreads()) + (self.runner.start is not None)
        self.pending = import_distributed().as_completed(loop=client.loop)
        self._top_up()

    def _submit(self, group: list[int], retries: int) -> None:
        u = self.units[group[0]]
        future = self.runner.client.submit(
            _task, self.engine, str(self.dumps[u.dump].path), [self.units[i] for i in group], self.configs,
            self.split, self.trace, key=f"{KEY}-{self.tag}-{self.submitted}",
            retries=retries, pure=False)
        self.futures[future] = group
        self.pending.add(future)
        self.submitted += 1

    def _top_up(self) -> None:
        """The units that raised here, each alone, then tasks for the free threads."""
        for i in self.raised_here:
            self._submit([i], retries=0)
        self.raised_here = []
        while self.queue and len(self.futures) < IN_FLIGHT * self.threads:
            self._submit(next_task(self.units, self.queue, self.peers), retries=1)

    def gather(self, block: bool) -> None:
        """The tasks that have ended (waiting for one if ``block`` and any is out), then tasks for the
        threads they freed."""
        if self.pending.has_ready() or (block and self.futures):
            for future in self.pending.next_batch(block=True):
                self._ended(future, self.futures.pop(future))
                future.release()
        self._top_up()

    def _ended(self, future, group: list[int]) -> None:
        if future.status != "finished":  # erred twice, or cancelled by a scheduler that lost its workers
            why = future.exception() if future.status == "error" else "cancelled by the cluster"
            for i in group:
                self._failed(i, why)
            return
        worker, results = future.result()
        for i, (seconds, run) in zip(group, results):
            if isinstance(run, list):
                self._finished(i, seconds, worker, run)
            elif len(group) > 1:  # raised once: run it again alone
                self._submit([i], retries=0)
            else:
                self._failed(i, run)

    def _failed(self, i, why) -> None:
        self.failed.append((i, _failure(self.dumps[self.units[i].dump], self.units[i], self.configs, why)))
        self._tick()


def next_task(units, queue: deque, peers: int) -> list[int]:
    """The cluster's next task, off the back of ``queue`` (indices of ``units``): the last queued units
    of one dump, in order, at most 1/(TASKS_PER_WORKER x peers) of those queued, at least one (and
    with TASKS_PER_WORKER 0, all of them). Tasks shrink as the queue does, so that the peers end
    together (guided self-scheduling)."""
    dump = units[queue[-1]].dump
    most = -(-len(queue) // (TASKS_PER_WORKER * peers)) if TASKS_PER_WORKER else len(queue)
    group = []
    while queue and len(group) < most and units[queue[-1]].dump == dump:
        group.append(queue.pop())
    return group[::-1]


def _failure(dump, unit, configs, why) -> str:
    names = "; ".join(cfg_name(c) for c in configs[:SHOWN_CONFIGS])
    more = f" and {len(configs) - SHOWN_CONFIGS} more" if len(configs) > SHOWN_CONFIGS else ""
    what = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
    return f"dump {dump.path.name}, KV head {unit.hk}, config{'s' * (len(configs) > 1)} {names}{more}: {what}"


def _task(engine, path, units, configs, split, trace):
    """Units of one dump on a worker, the dump opened there once (checked already, by the command):
    each unit's seconds and runs, or, for a unit that raised, the error as its line names it (an
    exception of a user's engine need not unpickle here)."""
    from distributed import get_worker

    dump = read_dump(path, check_finite=False)
    results = []
    with engine.context():
        for unit in units:
            t0 = time.perf_counter()
            try:
                run = run_unit(engine, dump, unit, configs, split=split, trace=trace)
            except Exception as e:  # noqa: BLE001 (named, or run again, by the runner)
                run = f"{type(e).__name__}: {e}"
            results.append((time.perf_counter() - t0, run))
    engine.release()
    return get_worker().name, results
