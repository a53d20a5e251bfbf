"""tools/bench_cluster.py on the CPU at a tiny size: it runs a study in one process and on a local
cluster, finds the two reports equal, measures the scheduler, and projects onto 8 and 32 workers
from those measurements; and the projection itself against a hand count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import bench_cluster  # noqa: E402
from test_cluster import distributed  # noqa: E402, F401 (Dask or a skip, and under CI Dask or a failure)


def test_projection_counts_rounds_of_units():
    cost = dict(start_s=2.0, per_task_s=0.01, round_trip_s=0.1)
    # 80 units on 8 workers, in 16 tasks: 10 rounds of 1 s and 2 of a round trip after the start and the
    # warm-up, plus 16 × 0.01 s; on 32 workers, 64 tasks: 3 rounds of units, 2 round trips, 64 × 0.01 s
    assert bench_cluster._project(80, 1.0, 0.5, cost, 8) == pytest.approx(2.0 + 0.5 + 10 * 1.0 + 2 * 0.1 + 0.16)
    assert bench_cluster._project(80, 1.0, -0.2, cost, 32) == pytest.approx(2.0 + 3 * 1.0 + 2 * 0.1 + 0.64)


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
    here = rows["units (dump, KV head) run in this process meanwhile"]
    assert rows["units (dump, KV head) on the workers"] + here == 2 and rows["workers"] == 2
    assert sum(w["units"] for w in rows["per_worker"].values()) == 2 - here
    assert rows["scheduler cost per task (20 no-op tasks, workers busy), s"] > 0
    for name in bench_cluster.PROJECTED:
        assert rows[f"projected, {name}, s"] > rows["cluster start (scheduler and workers up, a cluster of its own), s"]
