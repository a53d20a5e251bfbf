"""A cluster for a study: a running scheduler's client, or a local cluster brought up in a thread
(``Start``) with its workers warmed, Ctrl-C held off while they spawn, and closed off the main thread
while the tables are written (``closed``).

A local cluster starts in a thread, and its workers then warm up (a tiny unit each: imports, the CUDA
context, the kernel's modules, Numba's cache), while this process runs units itself, off the front
of the queue, as without a cluster; once the workers are warm they take tasks off the back, and this
process goes on to the last unit (scheduling.Runner). Starting takes a second or more per study, longer
than a study of a few dumps spends on its units; a running scheduler (``tcp://``) has none of it, and
this process then runs no unit.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from contextlib import ExitStack, contextmanager

from ..engine import run_unit
from .options import MISSING, Spec, gpu_names, import_distributed
from .scheduling import Runner

CONNECT_TIMEOUT_S = 10  # an address where no scheduler answers is an error, not a wait

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
    distributed = import_distributed()
    gpus = gpu_names(spec, engine)
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


def _warm(engine, hd: int, config) -> None:
    """A tiny unit on a worker, so that its first real one pays for no import, context or module. (The
    first query row of a real dump, its keys whole, left less to the first unit but took 4.2 s, not
    0.8, on the H200: docs/results/performance-log.md, the study on a Dask cluster, run 2.)"""
    from ..scan import Job
    from ..synth import synthetic

    dump = synthetic(16, 256, 1, 1, hd, seed=0)
    with engine.context():
        run_unit(engine, dump, Job.of(dump).units(0)[0], [config], split=False, trace=False)
    engine.release()


class Start(threading.Thread):
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
            distributed = import_distributed()
            # closed by the main thread: by callbacks, not the client's own `with`, whose state Dask
            # keeps per thread and which another thread could not leave
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
    """A Runner on the cluster ``spec`` names, for the study inside the block to run its units on
    (its ``where``); the client, and a local cluster with its workers, are closed on the way out,
    Ctrl-C too: with ``close_later``, off the main thread and joined by ``closed()``, so that a
    command's tables are made and written meanwhile (and a cluster still starting, if this process ran
    every unit, is not waited for until then). ``warm``: (head dim, config) of a tiny unit each local
    worker runs before it takes units."""
    if spec.address:
        with _connected(spec) as client:
            yield Runner(spec, client=client)
        return
    if importlib.util.find_spec("distributed") is None:  # said now; imported by the thread that starts it
        raise ImportError(MISSING)
    gpus = gpu_names(spec, engine)
    with _ctrl_c_ignored() as restore:
        start = Start(spec, engine, gpus, warm, restore)
        start.start()
        later = False
        try:
            yield Runner(spec, start=start)
            later = close_later
        finally:
            if later:
                closer = threading.Thread(target=_close, args=(start,), name="apa-cluster-close")
                closer.start()
                _CLOSING.append(closer)
            else:
                _close(start)


def _connected(spec: Spec):
    """A client of the running scheduler at ``spec.address``, or a ValueError that says none answered."""
    distributed = import_distributed()
    try:
        return distributed.Client(spec.address, timeout=CONNECT_TIMEOUT_S)
    except OSError:  # distributed's connect timeout is an OSError too
        raise ValueError(f"--cluster {spec.address}: no scheduler answered within {CONNECT_TIMEOUT_S} s") from None


def _close(start: Start) -> None:
    """The cluster ``start`` brings up, closed once it is up (a start that failed, for a study whose
    units all ran in this process, closes what it started and is not an error)."""
    start.join()
    start.stack.close()


_CLOSING: list[threading.Thread] = []  # clusters closing off the main thread (cluster's close_later)


def closed() -> None:
    """Wait until every cluster closing off the main thread is closed, its workers gone."""
    while _CLOSING:
        _CLOSING.pop().join()
