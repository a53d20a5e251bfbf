"""A study's units on a Dask cluster (``--cluster``): many dumps, many GPUs, many hosts.

``--cluster local[:N]`` starts a cluster on this machine: one worker per GPU when the engine runs on
GPUs (``dask_cuda.LocalCUDACluster`` when it is installed, else a Nanny per GPU with its
``CUDA_VISIBLE_DEVICES``), N workers otherwise (default: one per CPU). ``--cluster tcp://HOST:PORT``
uses a running scheduler. ``--devices I,J`` is ``--cluster local`` with one worker on each listed GPU.

Each unit of ``engine.run_units`` (one KV head of one dump, under every config of that call, so that
the float64 reference is shared between configs as in one process) is one task, keyed
``apa-unit-...``. A worker opens the dump itself from its path and sends back only the unit's
per-pair arrays (``engine.UnitRun``), never Q, K or V. The runs are put back in the units' order
whatever order they finish in, so the tables are bitwise those of one process (on the CPU engine,
where the workers' BLAS runs as many threads as this process's: see WORKER_ENVIRON). A task whose worker
dies is run again elsewhere by the scheduler; a task that raises is run once more; a unit that fails
twice is None among the runs, so that its pairs leave the study and every other unit's stay, and
``Runner.failed`` names it by dump, KV head and configs.

Dask is imported only here and only when a cluster is asked for: it is the ``cluster`` extra.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import uuid
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
        raise ImportError(f"--cluster runs the study on Dask, which is not installed: {INSTALL}") from None
    return distributed


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
    import dask

    gpus = _gpu_names(spec, engine)
    with _ctrl_c_ignored() as restore, dask.config.set({"distributed.nanny.pre-spawn-environ": WORKER_ENVIRON}), \
            _start_local(distributed, spec, gpus) as local:
        restore()
        yield local


@contextmanager
def _ctrl_c_ignored():
    """SIGINT ignored until ``restore()`` or the block's end, in the main thread (where handlers live).
    Ctrl-C at a terminal reaches the whole process group, and is this process's to answer, by closing
    the cluster: the workers spawned meanwhile inherit the ignored SIGINT and never see it (their own
    KeyboardInterrupt would print a traceback each). A Ctrl-C while the cluster starts is lost."""
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


class Runner:
    """The units of every ``run_units`` of a study on one Dask client; ``timing`` is each worker's
    count of units, their seconds and its first unit's (which loads Numba's cache or the kernel), for
    --json; ``failed`` a line for each unit that failed twice."""

    def __init__(self, client, spec: Spec):
        self.client, self.spec, self.timing, self.failed = client, spec, {}, []

    def run_units(self, engine, dumps, units, configs, split, trace, progress):
        for i in sorted({u.dump for u in units}):
            if dumps[i].path is None:
                raise ValueError("--cluster needs dumps on disk: its workers open them by path")
        tag = uuid.uuid4().hex[:8]
        futures = [self.client.submit(_unit_task, engine, str(dumps[u.dump].path), u, configs, split, trace,
                                      key=f"{KEY}-{tag}-{i}", retries=1, pure=False) for i, u in enumerate(units)]
        runs, failed = [None] * len(units), []
        index = {f.key: i for i, f in enumerate(futures)}
        try:
            for done, future in enumerate(_dask().as_completed(futures), 1):
                i = index[future.key]
                if future.status != "finished":  # erred twice, or cancelled by a scheduler that lost its workers
                    why = future.exception() if future.status == "error" else "cancelled by the cluster"
                    failed.append((i, _failure(dumps[units[i].dump], units[i], configs, why)))
                else:
                    worker, seconds, runs[i] = future.result()
                    mine = self.timing.setdefault(worker, dict(units=0, seconds=0.0, first_unit_s=seconds))
                    mine["units"] += 1
                    mine["seconds"] += seconds
                future.release()
                if progress:
                    progress(done, len(units))
        finally:
            self.client.cancel([f for f in futures if not f.done()], force=True)
        self.failed += [line for _, line in sorted(failed)]
        return runs

    def report(self) -> dict:
        return dict(cluster=str(self.spec), workers={w: {k: round(v, 6) for k, v in t.items()}
                                                      for w, t in sorted(self.timing.items())},
                    **(dict(failed=self.failed) if self.failed else {}))


SHOWN_CONFIGS = 3  # configs named in a failed unit's line (attribute runs some thirty per unit)


def _failure(dump, unit, configs, why) -> str:
    names = "; ".join(cfg_name(c) for c in configs[:SHOWN_CONFIGS])
    more = f" and {len(configs) - SHOWN_CONFIGS} more" if len(configs) > SHOWN_CONFIGS else ""
    what = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
    return f"dump {dump.path.name}, KV head {unit.hk}, config{'s' * (len(configs) > 1)} {names}{more}: {what}"


def _unit_task(engine, path, unit, configs, split, trace):
    """One unit on a worker: its dump opened there (checked once already, by the command)."""
    from distributed import get_worker

    t0 = time.perf_counter()
    dump = read_dump(path, check_finite=False)
    with engine.context():
        runs = run_unit(engine, dump, unit, configs, split=split, trace=trace)
    engine.release()
    return get_worker().name, time.perf_counter() - t0, runs


@contextmanager
def cluster(spec: Spec, engine):
    """A Runner on the cluster ``spec`` names, through which every ``run_units`` inside the block
    runs; the client, and a local cluster with its workers, are closed on the way out, Ctrl-C too."""
    distributed = _dask()
    with ExitStack() as stack:
        if spec.address:
            try:
                client = distributed.Client(spec.address, timeout=CONNECT_TIMEOUT_S)
            except OSError:  # distributed's connect timeout is an OSError too
                raise ValueError(f"--cluster {spec.address}: no scheduler answered within {CONNECT_TIMEOUT_S} s") \
                    from None
        else:
            local_cluster = stack.enter_context(local(spec, engine))
            client = distributed.Client(local_cluster)
        stack.enter_context(client)
        runner = Runner(client, spec)
        with units_on(runner):
            yield runner
