"""The studies' units on a Dask cluster, against the same studies in one process: the
JSON of scan, attribute --worst 5 and sweep field by field (metrics bitwise), a worker killed after
its first unit with nothing lost or counted twice, a unit that fails twice named and its pairs alone
left out, Ctrl-C leaving no worker, and the one-line errors of --cluster."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import dask_distributed

from apa_emu import Config
from apa_emu.engines import CpuEngine
from apa_emu.study import cluster, scan
from apa_emu.study.cluster import options, scheduling, startup
from apa_emu.study.cli import main
from apa_emu.study.dump import read_dump, write_dump
from apa_emu.study.synth import synthetic

distributed = dask_distributed()
pytest.importorskip("rich")

STUDIES = {"scan": [], "attribute": ["--worst", "5"], "sweep": ["--eps", "-1", "0.01", "1e9"]}


# Two small dumps: a (48 rows, 320 keys, 6/2 heads) and b (32 rows, 2500 keys, 4/2 heads, a strong
# sink); four units (dump, KV head) in all. Made at import, so that a worker that imports this module
# for Broken knows b's KV head 1 by its keys.
DUMPS = {"a": synthetic(48, 320, 6, 2, 64, seed=4), "b": synthetic(32, 2500, 4, 2, 64, seed=5, sink=16.0)}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    return [str(write_dump(root / f"{name}.apadump", d.q, d.k, d.v, d.q_offset)) for name, d in DUMPS.items()]


def study(capsys, command, dumps, *extra) -> dict:
    assert main([command, *dumps, *STUDIES[command], "--backend", "cpu", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def single(dumps):
    """Each study's JSON in this process: the oracle."""
    out = {}
    for command in STUDIES:
        with contextlib.redirect_stdout(io.StringIO()) as f:
            assert main([command, *dumps, *STUDIES[command], "--backend", "cpu", "--json"]) == 0
        out[command] = json.loads(f.getvalue())
    return out


@pytest.fixture(scope="module")
def scheduler():
    """A local cluster of 2 CPU workers, as --cluster local:2 starts it, for the tcp:// spelling."""
    with cluster.local(cluster.Spec(workers=2), CpuEngine()) as local:
        yield local.scheduler_address


def without_timing(report: dict) -> tuple[dict, dict]:
    report = dict(report)
    return report, report.pop("cluster")


@pytest.mark.parametrize("command", list(STUDIES))
def test_a_study_on_the_cluster_is_the_single_process_one(capsys, dumps, single, scheduler, command):
    report, timing = without_timing(study(capsys, command, dumps, "--cluster", scheduler))
    assert report == single[command]
    assert timing["cluster"] == scheduler and len(timing["workers"]) == 2  # both workers took units
    assert all(t["units"] >= 1 and t["seconds"] > 0 for t in timing["workers"].values())


def test_cluster_local_starts_its_own_workers(capsys, dumps, single):
    report, timing = without_timing(study(capsys, "scan", dumps, "--cluster", "local:2"))
    assert report == single["scan"]
    assert timing["cluster"] == "local:2" and set(timing["workers"]) <= {"cpu0", "cpu1"}
    # (dump, KV head): 2 + 2, each once, here while the workers started and warmed up, or on them
    here = timing.get("this_process", {}).get("units", 0)
    on_workers = sum(t["units"] for t in timing["workers"].values())
    assert here + on_workers == 4
    if on_workers:  # the cluster was up, its workers warm, before the units ran out here
        assert timing["start_s"] > 0 and timing["warm_s"] > 0
    assert not startup._CLOSING  # closed off the main thread while the report was written, and joined


def test_this_process_runs_units_while_the_cluster_starts_and_the_workers_the_rest(capsys, dumps, single,
                                                                                   monkeypatch):
    up = scheduling.Runner._up

    def up_after_two_units_here(self):  # the cluster awaited after 2 units here: both parts surely run
        if self.start is not None and self.timing.get(scheduling.HERE, {}).get("units", 0) >= 2:
            self.start.done.wait(120)
        return up(self)

    monkeypatch.setattr(scheduling.Runner, "_up", up_after_two_units_here)
    # up after 2 units here, the workers' 4 threads take the other 2 at once: nothing is left here
    report, timing = without_timing(study(capsys, "scan", dumps, "--cluster", "local:2"))
    assert report == single["scan"]
    assert timing["this_process"]["units"] == 2 and sum(t["units"] for t in timing["workers"].values()) == 2
    assert timing["start_s"] > 0 and timing["warm_s"] > 0


@pytest.fixture
def up_first(monkeypatch):
    """A local cluster awaited before the study's first unit, and one task per worker thread: with 2
    workers they take units 3 and 2, and this process the first, after the cluster is up."""
    up = scheduling.Runner._up

    def awaited(self):
        if self.start is not None:
            self.start.done.wait(120)
        return up(self)

    monkeypatch.setattr(scheduling.Runner, "_up", awaited)
    monkeypatch.setattr(scheduling, "IN_FLIGHT", 1)


def test_this_process_stays_a_peer_of_the_warm_workers(capsys, dumps, single, up_first):
    report, timing = without_timing(study(capsys, "scan", dumps, "--cluster", "local:2"))
    assert report == single["scan"]
    on_workers = sum(t["units"] for t in timing["workers"].values())
    assert timing["this_process"]["units"] >= 1 and on_workers >= 2
    assert timing["this_process"]["units"] + on_workers == 4


def tasks_of(dumps: tuple, peers: int) -> list[list[int]]:
    units, queue, tasks = [SimpleNamespace(dump=d) for d in dumps], deque(range(len(dumps))), []
    while queue:
        tasks.append(scheduling.next_task(units, queue, peers))
    return tasks


def test_tasks_are_cut_off_the_back_one_dump_each_ever_shorter():
    two = (0,) * 8 + (1,) * 8
    # at most ceil(left / (2 x 2)), within one dump: 16 left give 4, 12 give 3 (dump 1's last 3), then
    # dump 1's last unit alone, and dump 0 from the back in 2, 2, 1, 1, 1, 1
    assert tasks_of(two, peers=2) == [[12, 13, 14, 15], [9, 10, 11], [8], [6, 7], [4, 5], [3], [2], [1], [0]]
    assert tasks_of(two, peers=9) == [[15], [14]] + [[i] for i in range(13, -1, -1)]
    # one peer: ceil(left / 2), 3 at most from 6 left but dump 2 holds one, then 3 of 5 but dump 1 two
    assert tasks_of((0, 0, 0, 1, 1, 2), peers=1) == [[5], [3, 4], [1, 2], [0]]


def test_no_cut_gives_a_dump_per_task(monkeypatch):
    monkeypatch.setattr(scheduling, "TASKS_PER_WORKER", 0)
    assert tasks_of((0, 0, 0, 1, 1, 2), peers=3) == [[5], [3, 4], [0, 1, 2]]


class DieAfterFirstUnit(distributed.WorkerPlugin):
    """Ends its worker's process once its first unit is done, before the scheduler hears of it: the
    first worker to get there claims ``marker`` and dies; the nanny starts a new one."""

    def __init__(self, marker: str):
        self.marker = marker

    def transition(self, key, start, finish, **kwargs):
        if finish != "memory" or not str(key).startswith(scheduling.KEY):
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(key).encode())
        os.close(fd)
        os._exit(1)


def test_a_worker_killed_mid_study_loses_nothing(capsys, dumps, single, tmp_path):
    marker = tmp_path / "died"
    with cluster.local(cluster.Spec(workers=2), CpuEngine()) as local, distributed.Client(local) as client:
        before = set(client.scheduler_info()["workers"])
        client.register_plugin(DieAfterFirstUnit(str(marker)))
        report, timing = without_timing(study(capsys, "attribute", dumps, "--cluster", local.scheduler_address))
        client.wait_for_workers(2, timeout=30)
        after = set(client.scheduler_info()["workers"])
    assert marker.read_text().startswith(scheduling.KEY)  # a worker did die with a unit done
    assert before - after  # and its process is gone, a new one in its place
    want = single["attribute"]
    for got, oracle in zip(report["per_dump"], want["per_dump"]):
        assert got["pairs"] == oracle["pairs"]  # the same pairs, (row, head) by (row, head), none twice
        assert len(got["pairs"]) == len(set(map(tuple, got["pairs"]))) == 5
        for name, variant in got["variants"].items():
            assert variant["pairs"] == len(variant["cos"]) == oracle["variants"][name]["pairs"]
    assert report == want  # every cosine bitwise
    # Each unit gathered once: the first pass's (dump, KV head) units, then those holding the worst pairs.
    worst_heads = {(d, h // group) for d, (part, group) in enumerate(zip(want["per_dump"], (3, 2)))
                   for _, h in part["pairs"]}
    assert sum(t["units"] for t in timing["workers"].values()) == 4 + len(worst_heads)


class Broken(CpuEngine):
    """The emulator, failing on every call of dump b's KV head 1."""

    name = "broken"

    def run(self, call, config, *, progress=None):
        if np.array_equal(np.asarray(call.k)[0, :, 0], DUMPS["b"].k[:, 1]):
            raise RuntimeError("planted failure")
        return super().run(call, config, progress=progress)


@pytest.mark.parametrize("per_worker", [scheduling.TASKS_PER_WORKER, 0])  # 0: one task per dump, b's units together
def test_a_unit_failing_twice_is_named_and_the_rest_reported(capsys, dumps, single, scheduler, monkeypatch,
                                                             per_worker):
    monkeypatch.setattr(scheduling, "TASKS_PER_WORKER", per_worker)
    jobs = [scan.Job.of(read_dump(p)) for p in dumps]
    with cluster.cluster(cluster.Spec(address=scheduler), Broken()) as runner:
        scans = scan.scan_jobs(jobs, Config(), Broken(), where=runner)
    assert runner.failed == ["dump b.apadump, KV head 1, config default config: RuntimeError: planted failure"]
    assert sum(t["units"] for t in runner.timing.values()) == 3  # every other unit ran
    whole = scan.scan_jobs(jobs, Config(), CpuEngine())
    assert scans[0].out.tobytes() == whole[0].out.tobytes()
    kept = whole[1].pairs.heads < 2  # b's KV head 0: query heads 0 and 1
    assert np.array_equal(scans[1].pairs.rows, whole[1].pairs.rows[kept])
    assert np.array_equal(scans[1].pairs.heads, whole[1].pairs.heads[kept])
    for got, want in zip((scans[1].out, scans[1].bound, *scans[1].sums, *scans[1].split),
                         (whole[1].out, whole[1].bound, *whole[1].sums, *whole[1].split)):
        assert got.tobytes() == want[kept].tobytes()

    monkeypatch.setenv("APA_ENGINES", f"broken={__name__}:Broken")
    assert main(["scan", *dumps, "--backend", "broken", "--cluster", scheduler, "--json"]) == 1
    out, err = capsys.readouterr()
    assert err == ("apa: error: 1 unit failed twice, their pairs left out of the report:\n"
                   "  dump b.apadump, KV head 1, config default config: RuntimeError: planted failure\n")
    report = json.loads(out)
    assert report["cluster"]["failed"] == runner.failed
    assert report["per_dump"][0] == single["scan"]["per_dump"][0]  # dump a whole, bitwise
    assert report["per_dump"][1]["pairs"] == 32 * 2


class FailsOnce(CpuEngine):
    """The emulator, failing on the first call of dump b's KV head 1 in any process (the first to claim
    ``marker``)."""

    name = "fails-once"

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def run(self, call, config, *, progress=None):
        if np.array_equal(np.asarray(call.k)[0, :, 0], DUMPS["b"].k[:, 1]):
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                raise RuntimeError("planted failure, once")
        return super().run(call, config, progress=progress)


def test_a_study_runs_its_units_only_where_it_is_told(dumps, scheduler):
    """A cluster open around a study it is not handed takes none of its units: where they run is the
    study's argument, nothing the block sets behind it."""
    jobs = [scan.Job.of(read_dump(p)) for p in dumps]
    with cluster.cluster(cluster.Spec(address=scheduler), CpuEngine()) as runner:
        here = scan.scan_jobs(jobs, Config(), CpuEngine())
        assert runner.timing == {}
        there = scan.scan_jobs(jobs, Config(), CpuEngine(), where=runner)
    assert sum(t["units"] for t in runner.timing.values()) == 4 and scheduling.HERE not in runner.timing
    assert [s.out.tobytes() for s in here] == [s.out.tobytes() for s in there]


def test_a_unit_failing_once_in_a_task_of_several_is_run_again_alone(dumps, scheduler, monkeypatch, tmp_path):
    monkeypatch.setattr(scheduling, "TASKS_PER_WORKER", 0)  # one task per dump: b's two units together
    jobs = [scan.Job.of(read_dump(p)) for p in dumps]
    engine = FailsOnce(str(tmp_path / "failed"))
    with cluster.cluster(cluster.Spec(address=scheduler), engine) as runner:
        scans = scan.scan_jobs(jobs, Config(), engine, where=runner)
    assert (tmp_path / "failed").exists() and runner.failed == []
    assert sum(t["units"] for t in runner.timing.values()) == 4
    whole = scan.scan_jobs(jobs, Config(), CpuEngine())
    assert [s.out.tobytes() for s in scans] == [w.out.tobytes() for w in whole]


class BrokenHere(Broken):
    """Broken, telling when this process has called it 4 times (a worker's class is its own)."""

    calls, fourth = 0, threading.Event()

    def run(self, call, config, *, progress=None):
        BrokenHere.calls += 1
        if BrokenHere.calls == 4:
            BrokenHere.fourth.set()
        return super().run(call, config, progress=progress)


def test_a_unit_failing_in_this_process_is_run_again_on_the_cluster(dumps, monkeypatch):
    """The cluster comes up only after this process has run all 4 units, the last of which raises: the
    runner then waits for the cluster, where that unit raises again and is named."""
    start = startup.Start.run
    monkeypatch.setattr(BrokenHere, "calls", 0)
    monkeypatch.setattr(startup.Start, "run", lambda self: BrokenHere.fourth.wait(120) and start(self))
    jobs = [scan.Job.of(read_dump(p)) for p in dumps]
    with cluster.cluster(cluster.Spec(workers=2), BrokenHere()) as runner:
        scan.scan_jobs(jobs, Config(), BrokenHere(), where=runner)
    assert runner.timing[scheduling.HERE]["units"] == 3 and not runner.timing.keys() - {scheduling.HERE}
    assert runner.failed == ["dump b.apadump, KV head 1, config default config: RuntimeError: planted failure"]


class BrokenFirst(CpuEngine):
    """The emulator, failing on every call of dump a's KV head 0: the first unit, which this process
    takes after the cluster is up."""

    name = "broken-first"

    def run(self, call, config, *, progress=None):
        if np.array_equal(np.asarray(call.k)[0, :, 0], DUMPS["a"].k[:, 0]):
            raise RuntimeError("planted failure")
        return super().run(call, config, progress=progress)


def test_a_unit_failing_here_after_the_cluster_is_up_is_run_again_there(dumps, up_first):
    jobs, got = [scan.Job.of(read_dump(p)) for p in dumps], {}

    def study():
        with cluster.cluster(cluster.Spec(workers=2), BrokenFirst()) as runner:
            scan.scan_jobs(jobs, Config(), BrokenFirst(), where=runner)
        got["runner"] = runner

    thread = threading.Thread(target=study, daemon=True)
    thread.start()
    thread.join(180)
    assert not thread.is_alive(), "the study did not end"
    runner = got["runner"]
    assert runner.failed == ["dump a.apadump, KV head 0, config default config: RuntimeError: planted failure"]
    assert sum(t["units"] for t in runner.timing.values()) == 3


def spawned(process) -> list:
    """The processes ``process`` started through multiprocessing's spawn: a local cluster's workers."""
    import psutil

    found = []
    for child in process.children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # ended meanwhile (a zombie until reaped)
            pass
    return found


def ignores_sigint(pid: int) -> bool:
    ignored = next(line for line in open(f"/proc/{pid}/status") if line.startswith("SigIgn:"))
    return bool(int(ignored.split()[1], 16) & 1 << (signal.SIGINT - 1))


def test_ctrl_c_at_the_terminal_ends_the_study_and_its_workers(dumps):
    """SIGINT to the whole process group, as a terminal sends it, mid-study: one line, exit 130, and
    the local cluster's workers gone."""
    import psutil

    argv = [sys.executable, "-m", "apa_emu.study.cli", "sweep", *dumps, "--backend", "cpu", "--cluster", "local:2",
            "--json"]  # the default 7 ε: some 20 s of work
    apa = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        workers = []
        for _ in range(600):  # until the cluster is up: its workers there, and apa's SIGINT no longer ignored
            workers = spawned(psutil.Process(apa.pid))
            if len(workers) == 2 and not ignores_sigint(apa.pid) or apa.poll() is not None:
                break
            time.sleep(0.1)
        assert len(workers) == 2 and all(ignores_sigint(w.pid) for w in workers)
        time.sleep(1)
        os.killpg(apa.pid, signal.SIGINT)
        out, err = apa.communicate(timeout=60)
    finally:
        if apa.poll() is None:
            apa.kill()
    assert (apa.returncode, out, err) == (130, b"", b"apa: interrupted\n")
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_one_line_errors(capsys, dumps, monkeypatch):
    def error(*argv) -> str:
        assert main(["scan", dumps[0], "--rows", "0:2", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        return err

    assert error("--cluster", "local:x") == ("apa: error: scan: argument --cluster: local:N needs N, the workers, an "
                                             "integer >= 1, got 'local:x'\n")
    assert "expected local, local:N or tcp://HOST:PORT, got 'tcp://h'" in error("--cluster", "tcp://h")
    assert error("--cluster", "local", "--devices", "0") == ("apa: error: --devices is --cluster local on those GPUs: "
                                                             "give one of them\n")
    assert "leave --workers out" in error("--cluster", "local", "--workers", "2")
    monkeypatch.setattr(startup, "CONNECT_TIMEOUT_S", 1)
    assert error("--cluster", "tcp://127.0.0.1:1") == ("apa: error: --cluster tcp://127.0.0.1:1: no scheduler "
                                                       "answered within 1 s\n")
    monkeypatch.setitem(sys.modules, "distributed", None)
    assert error("--cluster", "local") == ("apa: error: --cluster runs the study on Dask, which is not installed: "
                                           "pip install -e '.[cluster]'\n")


def test_devices_name_the_workers_gpus(monkeypatch):
    # An engine on CuPy, as far as the cluster asks: the module's name and the GPUs this process sees.
    OnGpus = SimpleNamespace(xp=SimpleNamespace(__name__="cupy", cuda=SimpleNamespace(
        runtime=SimpleNamespace(getDeviceCount=lambda: 2))))

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert options.gpu_names(cluster.Spec(), OnGpus) == ["4", "6"]
    assert options.gpu_names(cluster.Spec(workers=1), OnGpus) == ["4"]
    assert options.gpu_names(cluster.on_devices((1, 0, 1)), OnGpus) == ["6", "4", "6"]
    with pytest.raises(ValueError, match="^--devices: GPU 2 is not there \\(2 visible\\)$"):
        options.gpu_names(cluster.on_devices((2,)), OnGpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert options.gpu_names(cluster.Spec(), OnGpus) == ["0", "1"]
    assert options.gpu_names(cluster.Spec(workers=3), CpuEngine()) == []
    assert (cluster.parse("local"), cluster.parse("local:1"), cluster.parse("tcp://host:8786")) == (
        cluster.Spec(), cluster.Spec(workers=1), cluster.Spec(address="tcp://host:8786"))
