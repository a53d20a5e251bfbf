"""The studies on the GPU engine agree with the CPU engine, on the device: the float64
reference in CuPy against apa_emu's oracle, scan, sweep and attribute with identical outputs and hot
masks and metrics within 1e-12 (the built-in dump and a synthetic 8192-key d = 128 dump; the CPU side
on a subset of rows), the CLI end to end, several processes on the GPUs, the memory refusal, memory
released after a study, and ``apa check`` passing and naming the stage of a kernel built with one
rounding changed. Marked ``gpu``.

Run: ``python -m pytest -q -m gpu tests/study/test_gpu_study.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import assert_same_scans, dask_distributed

from apa_emu import Config, reference_rows
from apa_emu.study import engine, fp64, scan
from apa_emu.study.cli import main
from apa_emu.study.commands import attribute, sweep
from apa_emu.study.dump import Dump, builtin_dump_path, read_dump, write_dump
from apa_emu.study.synth import synthetic_preset

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

import apa_gpu  # noqa: E402
import apa_gpu.api  # noqa: E402
from apa_gpu.engine import GpuEngine  # noqa: E402

WORKERS = os.cpu_count() or 1
EDGE_ROWS = 8  # the CPU side of the big dump: its first and last rows (warps at both ends of the causal range)


@pytest.fixture(scope="module")
def builtin():
    return read_dump(builtin_dump_path())


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A synthetic Llama-3.2-3B-shaped dump (24/8 heads, d = 128): 256 rows over 8192 keys, on disk."""
    d = synthetic_preset("llama-3.2-3b", 256, 8192, seed=11)
    return read_dump(write_dump(tmp_path_factory.mktemp("big") / "llama_8k.apadump", d.q, d.k, d.v, d.q_offset))


def edge_pairs(dump) -> scan.Pairs:
    rows = np.r_[0:EDGE_ROWS, dump.n - EDGE_ROWS:dump.n]
    return scan.Pairs.select(dump.n, dump.nh, rows=rows)


def _engines():
    return GpuEngine(), engine.CpuEngine(WORKERS)


def test_fp64_reference_on_the_gpu_matches_the_oracle(builtin, big):
    for dump, rows in ((builtin, np.arange(builtin.n)), (big, np.arange(0, big.n, 5))):
        scale = float(Config().softmax_scale(dump.hd))
        G = dump.group
        for hk in range(dump.nkv):
            r, h = np.repeat(rows, G), np.tile(np.arange(G), rows.size)
            q, k, v = (cupy.asarray(np.ascontiguousarray(x)) for x in
                       (dump.q[:, hk * G:(hk + 1) * G], dump.k[:, hk], dump.v[:, hk]))
            hot = apa_gpu.attention(q, k[:, None], v[:, None], dump.q_offset, Config()).hot[0, 0]
            gpu = fp64.reference(cupy, q, k, v, dump.q_offset, r, h, scale, hot=cupy.asarray(hot),
                                 block_elements=GpuEngine.block_elements)
            cpu = fp64.reference(np, dump.q[:, hk * G:(hk + 1) * G], dump.k[:, hk], dump.v[:, hk], dump.q_offset,
                                 r, h, scale, hot=hot)
            oracle = reference_rows(dump.q, dump.k, dump.v, dump.q_offset, r, hk * G + h, scale)
            out = cupy.asnumpy(gpu.out)
            rel = np.linalg.norm(out - oracle, axis=1) / np.linalg.norm(oracle, axis=1)
            assert rel.max() <= 1e-12, (dump.path.name, hk, rel.max())
            for x, y in zip(gpu[1:], cpu[1:]):
                np.testing.assert_allclose(cupy.asnumpy(x), y, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("which", ["builtin", "big"])
def test_scan_and_sweep_match_the_cpu_engine(which, builtin, big):
    dump = builtin if which == "builtin" else big
    pairs = scan.Pairs.select(dump.n, dump.nh) if which == "builtin" else edge_pairs(dump)
    gpu, cpu = _engines()
    assert_same_scans(scan.run_pairs(dump, Config(), pairs, backend=gpu),
                      scan.run_pairs(dump, Config(), pairs, backend=cpu))
    jobs = [scan.Job.of(dump, edge_pairs(dump))]
    configs = [Config(eps=e) for e in (-1.0, 0.001, 0.02, 1e9)]
    for g, c in zip(scan.evaluate(jobs, configs, gpu)[0], scan.evaluate(jobs, configs, cpu)[0]):
        assert_same_scans(g, c)
    rows = [sweep.sweep_jobs(jobs, Config(), [-1.0, 0.005, 1e9], e)[0][0] for e in (gpu, cpu)]
    for g, c in zip(*rows):
        assert (g.hot_share, g.pass2_tiles, g.below_0_999, g.nonfinite) == (c.hot_share, c.pass2_tiles,
                                                                           c.below_0_999, c.nonfinite)
        assert g.min_cos == pytest.approx(c.min_cos, abs=1e-12) and g.mean_cos == pytest.approx(c.mean_cos, abs=1e-12)


@pytest.mark.parametrize("which", ["builtin", "big"])
def test_attribute_matches_the_cpu_engine(which, builtin, big):
    dump = builtin if which == "builtin" else big
    jobs = [scan.Job.of(dump, edge_pairs(dump))]
    gpu, cpu = _engines()
    g, c = (attribute.attribute_jobs(jobs, Config(), e, cpu_worst=3, workers=WORKERS, seed=False).tables[0]
            for e in (gpu, cpu))  # the seed column runs on the CPU emulator under either engine
    assert list(g.variants) == list(c.variants) == list(attribute.ATTRIBUTE_VARIANTS)
    lacks = {"all, exact MMA", "all, sm120 MMA"}
    assert {n for n, s in g.variants.items() if s.engine == "cpu"} == lacks
    # The tables list pairs worst first; cosines equal to 1e-12 may order a near tie differently.
    for name in attribute.ATTRIBUTE_VARIANTS:
        by_pair = [dict(zip(zip(t.pairs.rows.tolist(), t.pairs.heads.tolist()), t.variants[name].cos)) for t in (g, c)]
        common = by_pair[0].keys() & by_pair[1].keys()
        assert len(common) >= (2 if name in lacks else len(jobs[0].pairs)), name
        for p in common:
            assert by_pair[0][p] == pytest.approx(by_pair[1][p], abs=1e-12), (name, p)
    np.testing.assert_allclose(g.breakdown.min_cos, c.breakdown.min_cos, rtol=0, atol=1e-12)


def test_cli_end_to_end(capsys, big):
    path = str(big.path)
    common = ["--rows", f"0:{EDGE_ROWS}", "--json"]
    assert main(["scan", path, "--backend", "gpu", *common]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert main(["scan", path, "--backend", "cpu", "--workers", str(WORKERS), *common]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert (gpu["backend"], cpu["backend"]) == ("gpu", "cpu")
    assert gpu["summary"] == pytest.approx(cpu["summary"], rel=0, abs=1e-12)
    assert gpu["histogram"] == cpu["histogram"] and gpu["summary"]["hot_share"] == cpu["summary"]["hot_share"]


def test_several_processes_give_the_single_process_report(capsys, big, tmp_path):
    dask_distributed()
    second = tmp_path / "second.apadump"
    second.write_bytes(big.path.read_bytes())
    argv = ["scan", str(big.path), str(second), "--backend", "gpu", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    devices = ["0,0"] + (["0,1"] if cupy.cuda.runtime.getDeviceCount() > 1 else [])
    # Dask workers, one per listed GPU (0,0: two share GPU 0), or one per GPU (--cluster local): the
    # single process's report, and each worker's units and seconds.
    for extra in [*(["--devices", ids] for ids in devices), ["--cluster", "local"]]:
        assert main([*argv, *extra]) == 0
        got = json.loads(capsys.readouterr().out)
        timing = got.pop("cluster")
        here = timing.get("this_process", {}).get("units", 0)  # units run here while the workers warmed up
        assert here + sum(w["units"] for w in timing["workers"].values()) == 2 * 8 and got == one, extra
    pool = cupy.get_default_memory_pool()
    assert pool.total_bytes() == pool.used_bytes()  # every block handed back after the study


def test_dump_too_large_for_the_device_is_refused(monkeypatch):
    S = 1 << 28  # shapes only: broadcast views hold no memory
    k = np.broadcast_to(np.float16(1), (S, 1, 128))
    huge = Dump(np.broadcast_to(np.float16(1), (4, 1, 128)), k, k, S - 4)
    monkeypatch.setattr(apa_gpu.api, "run", lambda *a, **kw: pytest.fail("ran before the memory check"))
    with pytest.raises(ValueError, match=r"^the 128\.00 GiB dump \(268435456 keys, d = 128\) needs about"):
        scan.run_pairs(huge, Config(), scan.Pairs.select(4, 1), backend=GpuEngine())


def test_apa_check_passes_and_names_a_planted_kernel_bug(capsys, monkeypatch, tmp_path):
    """`apa check` passes on the kernel as it is, and on a kernel built by nvcc from cuda/ with one
    rounding changed (mutant K6: the P-scale exponent fused, as the seed's fmaf) exits 1 naming pass 1."""
    from planted import apa_check, planted_sources

    monkeypatch.setenv("APA_GPU_REPRO_DIR", str(tmp_path))
    assert main(["check", "--warps", "0:4", "--workers", str(WORKERS)]) == 0
    assert "bitwise" in capsys.readouterr().out
    assert main(["check", "--hypothesis", "8", "--seed", "3"]) == 0
    assert "on 8 generated problems" in capsys.readouterr().out
    r = apa_check(["--warps", "3", "--schedule", "fused"], backend="cuda", cache=tmp_path / "cache",
                  repro=tmp_path / "repro", sources=planted_sources(tmp_path, "K6"))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "(KV head 0, fused schedule), stage pass 1 (visit records" in lines[0], r.stdout
    assert "where='visits'" in lines[1] and "tile=" in lines[1] and os.path.exists(lines[2].split()[-1])
