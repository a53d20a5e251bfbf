"""A study's units on a Dask cluster (``--cluster``): many dumps, many GPUs, many hosts.

``--cluster local[:N]`` starts a cluster on this machine: one worker per GPU when the engine runs on
GPUs (``dask_cuda.LocalCUDACluster`` when it is installed, else a Nanny per GPU with its
``CUDA_VISIBLE_DEVICES``), N workers otherwise (default: one per CPU). ``--cluster tcp://HOST:PORT``
uses a running scheduler. ``--devices I,J`` is ``--cluster local`` with one worker on each listed GPU.

A unit of ``engine.run_units`` is one KV head of one dump, under every config of that call (the
float64 reference is shared between configs as in one process). A task is a run of units of one dump,
keyed ``apa-unit-...``, cut off the back of the queue ever shorter as it empties (``_next_task``),
since a unit of the seed's sizes is tens of milliseconds on a GPU and a task's round trip about ten.
A worker opens the dump itself from its path, once per task, and sends back only the units'
per-pair arrays (``engine.UnitRun``), never Q, K or V. The runs are put back in the units' order
whatever order they finish in, so the tables are bitwise those of one process (on the CPU engine,
where the workers' BLAS runs as many threads as this process's: see WORKER_ENVIRON).

Faults. A task whose worker dies is run again elsewhere by the scheduler, and a task that raises is
run once more. A unit that raises inside a task is run again alone; a unit that fails twice is None
among the runs, so that its pairs leave the study and every other unit's stay, and ``Runner.failed``
names it by dump, KV head and configs.

A local cluster starts in a thread, and its workers then warm up (a tiny unit each: imports, the CUDA
context, the kernel's modules, Numba's cache), while this process runs units itself, off the front
of the queue, as without a cluster; once the workers are warm they take tasks off the back, and this
process goes on to the last unit (``Runner``). Starting takes a second or more per study, longer than
a study of a few dumps spends on its units; a running scheduler (``tcp://``) has none of it, and
this process then runs no unit.

Dask is imported only here and only when a cluster is asked for: it is the ``cluster`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import threading
import time
import uuid
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from .dump import read_dump
from .engine import run_unit, units_on
from .report import cfg_name

INSTALL = "pip install -e '.[cluster]'"
CONNECT_TIMEOUT_S = 10  # an address where no scheduler answers is an error, not a wait
KEY = "apa-unit"


@dataclass(frozen=True)
class Spec:
    """Where the units run: a running scheduler's ``address``, or a local cluster of ``workers``
    (None: one per GPU, else one per CPU) on ``gpus`` (None: the GPUs there are; --devices)."""

    address: str | None = None
    workers: int | None = None
    gpus: tuple[int, ...] | None = None

    def __str__(self) -> str:
        if self.address:
            return self.address
        if self.gpus is not None:
            return f"local on GPUs {','.join(map(str, self.gpus))}"
        return "local" + (f":{self.workers}" if self.workers else "")


def parse(text: str) -> Spec:
    """``--cluster``'s spellings: local, local:N, tcp://HOST:PORT."""
    if text == "local":
        return Spec()
    if text.startswith("local:"):
        n = text.removeprefix("local:")
        if not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"local:N needs N, the workers, an integer >= 1, got {text!r}")
        return Spec(workers=int(n))
    if text.startswith("tcp://"):
        host, _, port = text.removeprefix("tcp://").rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return Spec(address=text)
    raise argparse.ArgumentTypeError(f"expected local, local:N or tcp://HOST:PORT, got {text!r}")


def on_devices(devices) -> Spec:
    """``--devices I,J``: a local cluster of one worker per listed GPU."""
    return Spec(workers=len(devices), gpus=tuple(devices))


def _dask():
    try:
        import distributed
    except ImportError:
        raise ImportError(_MISSING) from None
    return distributed


_MISSING = f"--cluster runs the study on Dask, which is not installed: {INSTALL}"


def _visible_gpus(engine) -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them for a child (empty: the engine
    runs on the host)."""
    if engine.xp.__name__ != "cupy":
        return []
    count = engine.xp.cuda.runtime.getDeviceCount()
    listed = [s.strip() for s in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if s.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def _gpu_names(spec: Spec, engine) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each local worker (empty: CPU workers)."""
    visible = _visible_gpus(engine)
    if spec.gpus is None:
        return visible[:spec.workers] if spec.workers else visible
    if not visible:
        return [str(g) for g in spec.gpus]  # the CPU engine ran anyway (select_engine said why): harmless
    for g in spec.gpus:
        if g >= len(visible):
            raise ValueError(f"--devices: GPU {g} is not there ({len(visible)} visible)")
    return [visible[g] for g in spec.gpus]


# What a local cluster's nannies put in the environment of the workers they start. Not Dask's default,
# which pins BLAS to one thread: NumPy's float64 products round by a blocking that follows the thread
# count, so the reference would differ from this process's in its last bits. And the workers' own
# logs only when critical: their start and stop, and a unit's failure (which Runner.failed names in
# one line), are the runner's business.
WORKER_ENVIRON = {"DASK_LOGGING__DISTRIBUTED": "critical"}


@contextmanager
def local(spec: Spec, engine):
    """A local cluster for ``spec`` (no address) and ``engine``: one worker per GPU where it runs on
    GPUs, else CPU workers."""
    distributed = _dask()
    gpus = _gpu_names(spec, engine)
    with _ctrl_c_ignored() as restore, _spawning(), _start_local(distributed, spec, gpus) as local:
        restore()
        yield local


def _spawning():
    """The environment of the workers a local cluster's nannies start, while they start."""
    import dask

    return dask.config.set({"distributed.nanny.pre-spawn-environ": WORKER_ENVIRON})


@contextmanager
def _ctrl_c_ignored():
    """SIGINT ignored until ``restore()`` or the block's end, in the main thread (where handlers live).
    Ctrl-C at a terminal reaches the whole process group, and is this process's to answer, by closing
    the cluster: the workers spawned meanwhile inherit the ignored SIGINT and never see it (their own
    KeyboardInterrupt would print a traceback each). A Ctrl-C while the cluster starts (and, from
    ``cluster``, while its workers warm up and this process runs units) is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield lambda: signal.signal(signal.SIGINT, handler)
    finally:
        signal.signal(signal.SIGINT, handler)


def _start_local(distributed, spec: Spec, gpus: list[str]):
    quiet = dict(silence_logs=50)  # logging.CRITICAL, for the scheduler and nannies of this process
    if gpus and len(set(gpus)) == len(gpus):
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            pass
        else:
            return LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(gpus), threads_per_worker=1,
                                    dashboard_address=None, **quiet)
    if gpus:
        workers = {f"gpu{g}-{i}": {"cls": distributed.Nanny,
                                   "options": dict(nthreads=1, env={"CUDA_VISIBLE_DEVICES": g})}
                   for i, g in enumerate(gpus)}
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = {f"cpu{i}": {"cls": distributed.Nanny, "options": dict(nthreads=1)}
                   for i in range(spec.workers or cpus)}
    return distributed.SpecCluster(workers=workers, scheduler={"cls": distributed.Scheduler, "options": dict(
        dashboard=False, dashboard_address=":0")}, **quiet)


TASKS_PER_WORKER = 2  # a task holds at most 1/(this x peers) of the units left: few round trips, a short tail
IN_FLIGHT = 2  # tasks given each worker thread at a time: the next is there when one ends, without a round trip
HERE = "this process"  # the timing's name for the units this process ran


class Runner:
    """The units of every ``run_units`` of a study on one Dask client and, on a local cluster that
    ``start`` brings up, in this process too; ``timing`` is each worker's count of units, their
    seconds and its first unit's, for --json; ``failed`` a line for each unit that failed twice.

    On a local cluster this process is a peer of its workers from the first unit to the last: it takes
    units off the front of the queue, one at a time, while the cluster starts and after; the workers,
    once warm, take tasks off the back (``_next_task``), IN_FLIGHT per thread. The two meet in the
    middle, so the cluster's start costs only what it takes from this process (the GIL, a GPU shared),
    and the study ends with at most one short task still running on a worker."""

    def __init__(self, spec: Spec, client=None, start: "_Start | None" = None):
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
        self.pending = _dask().as_completed(loop=client.loop)
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
            self._submit(_next_task(self.units, self.queue, self.peers), retries=1)

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


def _next_task(units, queue: deque, peers: int) -> list[int]:
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


SHOWN_CONFIGS = 3  # configs named in a failed unit's line (attribute runs some thirty per unit)


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


def _warm(engine, hd: int, config) -> None:
    """A tiny unit on a worker, so that its first real one pays for no import, context or module. (The
    first query row of a real dump, its keys whole, left less to the first unit but took 4.2 s, not
    0.8, on the H200: docs/benchmarks.md, issue 34.)"""
    from .scan import Job
    from .synth import synthetic

    dump = synthetic(16, 256, 1, 1, hd, seed=0)
    with engine.context():
        run_unit(engine, dump, Job.of(dump).units(0)[0], [config], split=False, trace=False)
    engine.release()


class _Start(threading.Thread):
    """A local cluster brought up, a client on it and every worker warmed up (``_warm``), off the
    main thread, which meanwhile runs units; ``up()`` gives the client, or raises what went wrong."""

    def __init__(self, spec: Spec, engine, gpus: list[str], warm, restore):
        super().__init__(name="apa-cluster-start", daemon=True)
        self.spec, self.engine, self.gpus, self.warm, self.restore = spec, engine, gpus, warm, restore
        self.done, self.stack, self.client, self.error, self.seconds = threading.Event(), ExitStack(), None, None, {}

    def run(self):
        t0 = time.perf_counter()
        try:
            # Dask imported here, off the main thread (half a second), and before dask.config.set, whose
            # exit would otherwise take the "distributed" settings that the import adds
            distributed = _dask()
            # closed by the main thread: callbacks, as a client's context (a ContextVar's) is this thread's
            with _spawning():
                local = _start_local(distributed, self.spec, self.gpus)
            self.stack.callback(local.close)
            self.client = distributed.Client(local, set_as_default=False)
            self.stack.callback(self.client.close)
            self.seconds["start_s"] = time.perf_counter() - t0
            if self.warm is not None:
                self.client.run(_warm, self.engine, *self.warm)
            self.seconds["warm_s"] = time.perf_counter() - t0 - self.seconds["start_s"]
        except BaseException as e:  # noqa: BLE001 (raised in the main thread, by up())
            self.error = e
        finally:
            self.done.set()

    def up(self):
        """In the main thread, once ``done``: SIGINT answered again (the workers spawned ignoring it)."""
        self.restore()
        if self.error is not None:
            raise self.error
        return self.client

    def report(self) -> dict:
        return {k: round(v, 6) for k, v in self.seconds.items()}


@contextmanager
def cluster(spec: Spec, engine, warm=None, close_later: bool = False):
    """A Runner on the cluster ``spec`` names, through which every ``run_units`` inside the block
    runs; the client, and a local cluster with its workers, are closed on the way out, Ctrl-C too:
    with ``close_later``, off the main thread and joined by ``closed()``, so that a command's tables
    are made and written meanwhile (and a cluster still starting, if this process ran every unit,
    is not waited for until then). ``warm``: (head dim, config) of a tiny unit each local worker runs
    before it takes units."""
    if spec.address:
        distributed = _dask()
        try:
            client = distributed.Client(spec.address, timeout=CONNECT_TIMEOUT_S)
        except OSError:  # distributed's connect timeout is an OSError too
            raise ValueError(f"--cluster {spec.address}: no scheduler answered within {CONNECT_TIMEOUT_S} s") \
                from None
        with client, units_on(Runner(spec, client=client)) as runner:
            yield runner
        return
    if importlib.util.find_spec("distributed") is None:  # said now; imported by the thread that starts it
        raise ImportError(_MISSING)
    gpus = _gpu_names(spec, engine)
    with _ctrl_c_ignored() as restore:
        start = _Start(spec, engine, gpus, warm, restore)
        start.start()
        later = False
        try:
            with units_on(Runner(spec, start=start)) as runner:
                yield runner
            later = close_later
        finally:
            if later:
                closer = threading.Thread(target=_close, args=(start,), name="apa-cluster-close")
                closer.start()
                _CLOSING.append(closer)
            else:
                _close(start)


def _close(start: "_Start") -> None:
    """The cluster ``start`` brings up, closed once it is up (a start that failed, for a study whose
    units all ran in this process, closes what it started and is not an error)."""
    start.join()
    start.stack.close()


_CLOSING: list[threading.Thread] = []  # clusters closing off the main thread (cluster's close_later)


def closed() -> None:
    """Wait until every cluster closing off the main thread is closed, its workers gone."""
    while _CLOSING:
        _CLOSING.pop().join()

