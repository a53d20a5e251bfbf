"""tools/bench_cluster.py on the CPU at a tiny size: it runs a study in one process and on a local
cluster, finds the two reports equal, measures the scheduler, and projects onto 8 and 32 workers
from those measurements; and the projection itself against a hand count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import dask_distributed, load_tool

ROOT = Path(__file__).resolve().parents[2]
bench_cluster = load_tool("bench_cluster")
dask_distributed()  # Dask or a skip, and under CI Dask or a failure


def test_projection_counts_rounds_of_units():
    cost = dict(start_s=2.0, per_task_s=0.01, round_trip_s=0.1)
    # 2 dumps of 4 units on 1 worker: tasks of at most half the units left, within a dump: 4, 2, 1, 1;
    # 8 rounds of 1 s after the start and the warm-up, 4 round trips, 4 x 0.01 s
    assert bench_cluster._project(2, 4, 1.0, 0.5, cost, 1) == pytest.approx(2.0 + 0.5 + 8 * 1.0 + 4 * 0.1 + 0.04)
    # on 8 workers every task is one unit (8 left / 16): one round of units, one of round trips, 8 tasks
    assert bench_cluster._project(2, 4, 1.0, -0.2, cost, 8) == pytest.approx(2.0 + 1.0 + 0.1 + 0.08)


def test_a_tiny_run_on_the_cpu(tmp_path):
    out = tmp_path / "bench.md"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_cluster.py"), "--dumps", "2", "--rows", "16",
                          "--keys", "256", "--heads", "2", "--kv-heads", "1", "--d", "64", "--backend", "cpu",
                          "--cluster", "local:2", "--tasks", "20", "--reps", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    table = out.read_text()
    assert "the reports are equal field by field" in table and table in run.stdout
    rows = json.loads(run.stdout[len(table):])
    here = rows["units (dump, KV head) run in this process, a peer of the workers"]
    assert rows["units (dump, KV head) on the workers"] + here == 2 and rows["workers"] == 2
    assert sum(w["units"] for w in rows["per_worker"].values()) == 2 - here
    assert rows["scheduler cost per task (20 no-op tasks, workers busy), s"] > 0
    for name in bench_cluster.PROJECTED:
        assert rows[f"projected, {name}, s"] > rows["cluster start (scheduler and workers up, a cluster of its own), s"]
