"""A study on a Dask cluster against the same study in one process, and what more GPUs would give.

On ``--dumps`` synthetic dumps (``apa synth``'s generator, 24/8 heads, d = 128 by default, written to
a temporary folder) it runs ``apa COMMAND`` in this process, end to end, twice: in one process and
with ``--cluster SPEC`` (default ``local``: one worker per GPU, or 2 CPU workers on the CPU engine).
It checks that the two JSON reports are equal field by field (exit 1 if not) and gives:

* the overhead of the cluster path: its wall time (its cluster started in a thread and its workers
  warmed up while this process runs the first units, then the rest on the workers) against the
  single process's, and how many units this process ran meanwhile;
* the same study on a cluster already running, by its address (``tcp://``), after one run that warms
  its workers: what a cluster kept across studies costs, without its start;
* the per-unit times measured by the workers (a unit: one KV head of one dump, computed on the
  worker; a task is a run of one dump's units, the dump read once), from the cluster run's ``--json``;
* the scheduler's per-task cost, measured on a cluster of the same spec: the wall time of
  ``--tasks`` no-op tasks submitted and gathered one by one, as the runner does (per task, with every
  worker busy), and the round trip of one task at a time (median of 30);
* the study time on 8 GPUs and on 4 hosts × 8 GPUs, projected from those measurements: the cluster
  start and the workers' warm-up (once, in parallel), then rounds of as many units as there are
  workers at the slowest worker's time per later unit, a round trip per round of tasks (cut as the
  runner cuts them, ever shorter off the back of the queue), and the scheduler's per-task cost for
  every task on top (it serialises). Nothing is taken off for this process's units: on many GPUs it hides the start only.

    python tools/bench_cluster.py                                   # the default study: 10 dumps, 2048 x 32768
    python tools/bench_cluster.py --out bench.md                    # and the table written to a file
    python tools/bench_cluster.py --dumps 3 --rows 64 --keys 2048 --heads 4 --kv-heads 2 --d 64 \\
        --backend cpu --cluster local:2                             # a quick run on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

from apa_emu.engines import CpuEngine
from apa_emu.study import cli, cluster, engine
from apa_emu.study.cluster import scheduling
from apa_emu.study.dump import write_dump
from apa_emu.study.synth import synthetic

PROJECTED = {"8 GPUs (1 host)": 8, "4 hosts x 8 GPUs": 32}


class _Written(io.StringIO):
    """Standard output that notes when it was last written: a study's report is out before a local
    cluster's workers are gone (cli.main closes it after)."""

    at = 0.0

    def write(self, text):
        self.at = time.perf_counter()
        return super().write(text)


def _apa(argv: list[str]) -> tuple[float, float, dict]:
    """Seconds of one ``apa ... --json`` in this process until its report was written and until it
    returned, and its report."""
    with contextlib.redirect_stdout(_Written()) as out:
        t0 = time.perf_counter()
        rc = cli.main([*argv, "--json"])
        seconds = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"bench_cluster: apa {' '.join(argv)} exited {rc}")
    return out.at - t0, seconds, json.loads(out.getvalue())


def _noop(i):
    return i


def _measure(spec: cluster.Spec, chosen, tasks: int, study: list[str], cluster_arg: str, reps: int) -> dict:
    """The scheduler's cost per task on a cluster of ``spec``, and its start; and, while that cluster
    runs (its workers warmed by one study), ``reps`` rounds of ``study`` in one process, with
    ``--cluster cluster_arg`` and on the running cluster by its address (tcp://), in turn: a GPU's
    time for one study moves by 20 % from run to run."""
    import distributed

    t0 = time.perf_counter()
    with cluster.local(spec, chosen) if not spec.address else contextlib.nullcontext(spec.address) as where, \
            distributed.Client(where) as client:
        workers = len(client.scheduler_info()["workers"])
        start = time.perf_counter() - t0
        address = client.scheduler.address
        _apa([*study, "--cluster", address])
        runs = {"single": [], "cluster": [], "cluster_end": [], "running": []}
        for _ in range(reps):
            seconds, _, single = _apa(study)
            runs["single"].append(seconds)
            seconds, end, clustered = _apa([*study, "--cluster", cluster_arg])
            runs["cluster"].append(seconds)
            runs["cluster_end"].append(end)
            seconds, _, running = _apa([*study, "--cluster", address])
            runs["running"].append(seconds)
        client.submit(_noop, -1, pure=False).result()  # the first task pays for the function's import
        t0 = time.perf_counter()
        futures = [client.submit(_noop, i, pure=False) for i in range(tasks)]
        for future in distributed.as_completed(futures):
            future.result()
        per_task = (time.perf_counter() - t0) / tasks
        trips = []
        for i in range(30):
            t0 = time.perf_counter()
            client.submit(_noop, i, pure=False).result()
            trips.append(time.perf_counter() - t0)
    running.pop("cluster")
    return dict(workers=workers, start_s=start, per_task_s=per_task, round_trip_s=statistics.median(trips),
                runs=runs, single=single, clustered=clustered, running=running)


def _project(dumps: int, per_dump: int, unit_max: float, warm_up: float, cost: dict, workers: int) -> float:
    units = [SimpleNamespace(dump=i // per_dump) for i in range(dumps * per_dump)]
    queue, tasks = deque(range(len(units))), 0
    while queue:  # as the runner cuts them, on a running cluster (no peer here)
        scheduling.next_task(units, queue, workers)
        tasks += 1
    return (cost["start_s"] + max(warm_up, 0.0) + math.ceil(len(units) / workers) * unit_max
            + math.ceil(tasks / workers) * cost["round_trip_s"] + tasks * cost["per_task_s"])


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dumps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=2048, help="query rows per dump")
    ap.add_argument("--keys", type=int, default=32768, help="keys per dump")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--command", default="scan", choices=["scan", "sweep", "attribute", "headroom", "worst"],
                    help="the study (attribute with --cpu-worst 0, sweep over 3 ε)")
    ap.add_argument("--backend", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--cluster", default="local", help="--cluster of the cluster run (default local)")
    ap.add_argument("--tasks", type=int, default=1000, help="no-op tasks that measure the scheduler's cost")
    ap.add_argument("--reps", type=int, default=3, help="rounds of the three runs, in turn (wall times: medians)")
    ap.add_argument("--out", help="also write the markdown there")
    return ap.parse_args()


def _study_cost(args, spec: cluster.Spec) -> dict:
    """_measure on ``--dumps`` synthetic dumps in a temporary folder, after one tiny study that loads
    the engine in this process."""
    extra = {"attribute": ["--cpu-worst", "0"], "sweep": ["--eps", "0.001", "0.005", "0.02"]}.get(args.command, [])
    with tempfile.TemporaryDirectory(prefix="bench_cluster_") as tmp:
        for i in range(args.dumps):
            d = synthetic(args.rows, args.keys, args.heads, args.kv_heads, args.d, seed=i)
            write_dump(Path(tmp) / f"d{i:02d}.apadump", d.q, d.k, d.v, d.q_offset)
        study = [args.command, tmp, *extra, "--backend", args.backend]
        _apa([args.command, str(Path(tmp) / "d00.apadump"), *(["--rows", "0:16"] if args.command != "attribute" else []),
              *extra[:2], "--backend", args.backend])
        chosen = CpuEngine() if args.backend == "cpu" else engine.select_engine("gpu", [], [args.d])
        return _measure(spec, chosen, args.tasks, study, args.cluster, args.reps)


def _measures(args, cost: dict) -> tuple[dict, dict]:
    """The table's rows from _measure's results (exit 1 where a cluster's report differs from the single
    process's), and the per-worker times of the last cluster run."""
    single, clustered, runs = cost["single"], cost["clustered"], cost["runs"]
    single_s, cluster_s, cluster_end_s, running_s = (statistics.median(runs[k])
                                                     for k in ("single", "cluster", "cluster_end", "running"))
    timing = clustered.pop("cluster")  # the last run's
    if clustered != single or cost["running"] != single:
        sys.exit("bench_cluster: a cluster's report differs from the single process's")
    per_worker = timing["workers"]
    here = timing.get("this_process", dict(units=0, seconds=0.0))
    units = sum(w["units"] for w in per_worker.values())
    # per-unit times from the workers; from this process if it ran every unit before they were warm
    timed = [w for w in per_worker.values() if w["units"]] or [dict(here, first_unit_s=0.0)]
    unit_mean = sum(w["seconds"] for w in timed) / sum(w["units"] for w in timed)
    later = [(w["seconds"] - w["first_unit_s"]) / (w["units"] - 1) for w in timed if w["units"] > 1]
    unit_max = max(later) if later else unit_mean  # the slowest worker's mean after its first unit
    rows = {
        "single process, wall s to the report written (median)": single_s,
        f"--cluster {args.cluster}, wall s to the report written (median)": cluster_s,
        "overhead": (cluster_s - single_s) / single_s,
        f"--cluster {args.cluster}, wall s to its end (its cluster closed)": cluster_end_s,
        "--cluster tcp:// of a running cluster, warm, wall s to the report written (median)": running_s,
        "overhead on a running cluster": (running_s - single_s) / single_s,
        # absent where this process ran every unit before the cluster was up
        "the study's cluster: started, s (in a thread, this process running units meanwhile)":
            timing.get("start_s", math.nan),
        "the study's cluster: its workers' warm-up (a tiny unit each), s": timing.get("warm_s", math.nan),
        "units (dump, KV head) run in this process, a peer of the workers": here["units"],
        "their seconds": here["seconds"],
        "units (dump, KV head) on the workers": units,
        "workers": cost["workers"],
        "cluster start (scheduler and workers up, a cluster of its own), s": cost["start_s"],
        "per unit on a worker, mean s": unit_mean,
        "per unit after a worker's first, slowest worker's mean s": unit_max,
        f"scheduler cost per task ({args.tasks} no-op tasks, workers busy), s": cost["per_task_s"],
        "one task's round trip (median of 30), s": cost["round_trip_s"],
        **{f"projected, {name}, s": _project(args.dumps, args.kv_heads, unit_max, timing.get("warm_s", 0.0), cost, n)
           for name, n in PROJECTED.items()},
    }
    return rows, per_worker


def main() -> None:
    args = _arguments()
    spec = cluster.parse(args.cluster)
    cost = _study_cost(args, spec)
    rows, per_worker = _measures(args, cost)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"`{' '.join(['python tools/bench_cluster.py', *sys.argv[1:]])}`, {when}, {platform.node()} "
            f"({os.cpu_count()} CPUs, Python {platform.python_version()}); `apa {args.command}` over {args.dumps} "
            f"dumps of {args.rows} x {args.keys} keys, {args.heads}/{args.kv_heads} heads, d = {args.d}, "
            f"--backend {args.backend}; the reports are equal field by field")
    table = "\n".join([head, "", "| measure | value |", "|---|---:|",
                       *(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in rows.items())])
    print(table)
    print(json.dumps(dict(rows, per_worker=per_worker, runs=cost["runs"]), indent=1))
    if args.out:
        Path(args.out).write_text(table + "\n")

if __name__ == "__main__":
    main()
