"""The study engines without a GPU: the choice of engine and its one-line messages, the
blocked float64 reference and per-pair sums against apa_emu's oracle, the certificate a scan carries
and reports (a planted violation included), every study command on several dumps and on a folder,
and the GPU engine's own code (units, hot masks of the chosen warps, the memory check, apa check)
with NumPy standing in for CuPy and the emulator for the kernel. tests/study/test_gpu_study.py runs
the same on the device; tests/study/test_cluster.py runs the units on Dask."""

from __future__ import annotations

import json
import re
import sys
import types
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from helpers import assert_same_scans

import apa_emu
import apa_gpu.api
from apa_emu import Config, pair_metrics, reference_rows
from apa_gpu import engine as gpu_engine
from apa_gpu.engine import GpuEngine
from apa_emu.study import engine, fp64, scan
from apa_emu.study.cli import main
from apa_emu.study.commands import attribute, sweep
from apa_emu.study.dump import Dump, write_dump
from apa_emu.study.synth import synthetic

pytest.importorskip("rich")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Two small dumps in one folder: a (d = 64, 6/2 heads, 320 keys) and b (4/2 heads, 2500 keys:
    two key blocks of the reference, a strong sink: about half the tiles cold)."""
    root = tmp_path_factory.mktemp("many")
    a = synthetic(48, 320, 6, 2, 64, seed=4)
    b = synthetic(32, 2500, 4, 2, 64, seed=5, sink=16.0)
    paths = [str(write_dump(root / f"{name}.apadump", d.q, d.k, d.v, d.q_offset)) for name, d in (("a", a), ("b", b))]
    return dict(a=a, b=b, paths=paths, root=str(root))


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- the float64 reference and the sums --------------------------------------------------------


def test_reference_matches_the_oracle_and_splits_by_hot_tile(dumps):
    d = dumps["b"]
    cfg = Config()
    scale = float(cfg.softmax_scale(d.hd))
    rows = np.repeat(np.arange(d.n), 2)
    heads = np.tile([0, 1], d.n)  # KV head 0: its heads have a sink, few hot tiles (2 and 3 are diffuse)
    res = apa_emu.attention(d.q, d.k, d.v, d.q_offset, cfg)
    # a small block bound: chunks of 3 pairs, so chunking and the key blocks are both exercised
    ref = fp64.reference(np, d.q[:, 0:2], d.k[:, 0], d.v[:, 0], d.q_offset, rows, heads, scale,
                         hot=res.hot[0, 0], block_elements=3 * fp64.KEY_BLOCK)
    oracle = reference_rows(d.q, d.k, d.v, d.q_offset, rows, heads, scale)
    rel = np.linalg.norm(ref.out - oracle, axis=1) / np.linalg.norm(oracle, axis=1)
    assert rel.max() <= 1e-12
    for i in (0, 17, len(rows) - 1):
        _, mass, contrib = scan.tile_breakdown(d, int(rows[i]), int(heads[i]), scale)
        tile_hot = scan.pair_hot(d, res, int(rows[i]), int(heads[i]))
        assert 0 < tile_hot.sum() < tile_hot.size
        assert ref.cold_mass[i] == pytest.approx(mass[~tile_hot].sum(), rel=1e-12, abs=1e-15)
        assert ref.hot_norm[i] == pytest.approx(np.linalg.norm(contrib[tile_hot].sum(axis=0)), rel=1e-12)
        assert ref.cold_norm[i] == pytest.approx(np.linalg.norm(contrib[~tile_hot].sum(axis=0)), rel=1e-12)


def test_sums_give_the_core_metrics():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 64))
    out = (ref + 0.01 * rng.standard_normal((6, 64))).astype(np.float16)
    out[1], ref[2], out[3], ref[3] = 0, 0, 0, 0  # zero output, zero reference, both zero
    cos, rel = fp64.cos_rel(fp64.pair_sums(np, out, ref))
    want_cos, want_rel = pair_metrics(out, ref)
    np.testing.assert_allclose(cos, want_cos, rtol=1e-14, atol=0)
    np.testing.assert_allclose(rel, want_rel, rtol=1e-14, atol=0)


# -- the certificate ---------------------------------------------------------------------------


def test_scan_carries_the_emulators_certificate(dumps):
    d = dumps["b"]
    cfg = Config()
    pairs = scan.Pairs.select(d.n, d.nh, rows=[0, 5, 17, 31])  # every head: both KV heads, several warps
    s = scan.run_pairs(d, cfg, pairs, backend="cpu")
    whole = apa_emu.attention(d.q, d.k, d.v, d.q_offset, cfg).err_bound
    assert s.bound.dtype == np.float32 and s.bound.tobytes() == whole[pairs.rows, pairs.heads].tobytes()
    chosen = np.zeros(whole.shape, bool)
    chosen[pairs.rows, pairs.heads] = True
    assert s.result.err_bound.dtype == np.float32 and s.result.err_bound.shape == (d.n, d.nh)
    assert s.result.err_bound[chosen].tobytes() == whole[chosen].tobytes()
    assert np.isnan(s.result.err_bound[~chosen]).all()

    oracle = reference_rows(d.q, d.k, d.v, d.q_offset, pairs.rows, pairs.heads, cfg.softmax_scale(d.hd))
    err = np.linalg.norm(s.out.astype(np.float64) - oracle, axis=1)
    bound = whole[pairs.rows, pairs.heads].astype(np.float64)
    assert np.isfinite(bound).all() and (err > 0).all() and (bound >= err).all()
    cert = s.certificate
    assert (cert["coverage"], cert["violations"], cert["first_violations"], cert["infinite"]) == (1.0, 0, [], 0)
    assert cert["bound_over_err_min"] == pytest.approx((bound / err).min(), rel=1e-9)
    assert cert["bound_over_err_median"] == pytest.approx(np.median(bound / err), rel=1e-9)
    assert cert["bound_over_ref_median"] == pytest.approx(np.median(bound / np.linalg.norm(oracle, axis=1)), rel=1e-12)


def test_a_bound_below_the_error_is_reported(capsys, monkeypatch, dumps):
    cpu_run = engine.CpuEngine.run

    def run(*args, **kw):  # row 3 of the first head of each KV head: the dump's pairs (3, 0) and (3, 3)
        res = cpu_run(*args, **kw)
        res.err_bound[3, 0] = 0
        return res

    monkeypatch.setattr(engine.CpuEngine, "run", run)
    a = dumps["paths"][0]
    cert = run_json(capsys, "scan", a, "--rows", "0:4", "--backend", "cpu")["certificate"]
    assert (cert["violations"], cert["first_violations"]) == (2, [[3, 0], [3, 3]])
    assert cert["coverage"] == pytest.approx(22 / 24) and cert["bound_over_err_min"] == 0
    assert main(["scan", a, "--rows", "0:4", "--backend", "cpu"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"│ violations\s+│\s+2 │", text)
    assert re.search(r"│ first violations \(row, head\)\s+│\s+\(3, 0\) \(3, 3\) │", text)


# -- choosing the engine -----------------------------------------------------------------------


def numpy_cupy(free_bytes=64 << 30):
    """A module named cupy that is NumPy, with the few device calls the GPU engine makes."""
    m = types.ModuleType("cupy")
    m.__dict__.update({k: v for k, v in np.__dict__.items() if not k.startswith("__")})

    @contextmanager
    def device(i):
        yield

    pool = types.SimpleNamespace(free_all_blocks=lambda: None, free_bytes=lambda: 0)
    m.get_default_memory_pool = m.get_default_pinned_memory_pool = lambda: pool
    m.cuda = types.SimpleNamespace(Device=device, runtime=types.SimpleNamespace(
        getDevice=lambda: 0, getDeviceCount=lambda: 1, memGetInfo=lambda: (free_bytes, 2 * free_bytes)))
    return m


@pytest.fixture
def numpy_gpu(monkeypatch):
    """The GPU engine's code on the CPU: NumPy as CuPy, the emulator (every warp) as the kernel."""
    fake = numpy_cupy()
    monkeypatch.setenv("APA_GPU_BACKEND", "cuda")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(apa_gpu.api, "run", lambda call, cfg, **kw: apa_emu.api.run(replace(call, warps=None), cfg))
    monkeypatch.setattr(gpu_engine, "kernel_missing", lambda: None)
    return fake


def test_engine_choice_and_why(monkeypatch):
    monkeypatch.setattr(gpu_engine, "kernel_missing", lambda: "CuPy is not installed (pip install -e '.[gpu]')")
    cpu = engine.select_engine("cpu", [Config()], [64])
    assert (cpu.name, cpu.note) == ("cpu", None)
    auto = engine.select_engine("auto", [Config()], [64], workers=2)
    assert (auto.name, auto.workers) == ("cpu", 2)
    assert auto.note is None  # no GPU here: the CPU without a note
    assert engine.select_engine("auto", [Config()], [64], devices=(0,)).note == \
        "running on the CPU emulator: CuPy is not installed (pip install -e '.[gpu]')"
    with pytest.raises(engine.BackendError, match=r"^--backend gpu: CuPy is not installed"):
        engine.select_engine("gpu", [Config()], [64])
    with pytest.raises(ValueError, match="--devices chooses GPUs"):
        engine.select_engine("cpu", [Config()], [64], devices=(0, 1))
    monkeypatch.setattr(gpu_engine, "kernel_missing", lambda: None)
    for cfg, d, why in ((Config(mma="exact"), 64, "config.mma='exact' is an emulator model"),
                        (Config(mma="sm120"), 256, "config.mma='sm120' is an emulator model")):
        assert why in engine.select_engine("auto", [cfg], [64, d]).note
        with pytest.raises(engine.BackendError, match=f"^--backend gpu: {why}"):
            engine.select_engine("gpu", [cfg], [d])
    monkeypatch.setitem(sys.modules, "cupy", numpy_cupy())
    gpu = engine.select_engine("auto", [Config()], [64, 128], devices=(0, 1))
    assert (gpu.name, gpu.devices, gpu.note) == ("gpu", (), None)  # the GPUs are a cluster's workers' 
    assert engine.select_engine(gpu, [Config(mma="exact")], [256]) is gpu


def test_gpu_missing_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("APA_GPU_BACKEND", "cuda")
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert gpu_engine.kernel_missing() == "CuPy is not installed (pip install -e '.[gpu]')"
    fake = numpy_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(apa_gpu.api, "available", lambda: False)
    fake.cuda.runtime.getDeviceCount = lambda: 0
    assert gpu_engine.kernel_missing() == "no CUDA device is visible"
    fake.cuda.runtime.getDeviceCount = lambda: 2
    assert gpu_engine.kernel_missing().startswith("nvcc is not found")
    monkeypatch.setattr(apa_gpu.api, "available", lambda: True)
    assert gpu_engine.kernel_missing() is None


def test_backend_messages_are_one_line(capsys, monkeypatch, dumps):
    a = dumps["paths"][0]
    monkeypatch.setattr(gpu_engine, "kernel_missing", lambda: "no CUDA device is visible")
    for argv in (["scan", a, "--backend", "gpu"], ["attribute", a, "--backend", "gpu"],
                 ["pair", a, "--row", "3", "--head", "1", "--backend", "gpu"]):
        assert main(argv) == 2
        assert capsys.readouterr() == ("", "apa: error: --backend gpu: no CUDA device is visible\n")
    monkeypatch.setattr(gpu_engine, "kernel_missing", lambda: "no CUDA device is visible")
    assert main(["check", a]) == 2
    assert capsys.readouterr() == ("", "apa: error: apa check runs the kernel: no CUDA device is visible\n")
    assert main(["scan", a, "--rows", "0:2", "--json"]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(gpu_engine, "kernel_missing", lambda: None)
    assert main(["scan", a, "--rows", "0:2", "--config", "mma=exact", "--json"]) == 0
    assert capsys.readouterr().err == ("apa: note: running on the CPU emulator: config.mma='exact' is an emulator "
                                       "model; the sm_90 kernel implements mma='sm90' only\n")
    assert main(["scan", a, "--backend", "cpu", "--devices", "0,1"]) == 2
    assert "--devices chooses GPUs" in capsys.readouterr().err


# -- every command on several dumps ------------------------------------------------------------


def test_scan_of_several_dumps_and_a_folder(capsys, dumps):
    a, b = dumps["paths"]
    many = run_json(capsys, "scan", a, b, "--backend", "cpu")
    assert many["dumps"] == [a, b] and [d["dump"] for d in many["per_dump"]] == [a, b]
    alone = [run_json(capsys, "scan", p, "--backend", "cpu") for p in (a, b)]
    for one, part in zip(alone, many["per_dump"]):
        assert part["summary"] == one["summary"] and part["errors"] == one["errors"]
    scans = [scan.run_pairs(d, Config(), scan.Pairs.select(d.n, d.nh), backend="cpu") for d in (dumps["a"], dumps["b"])]
    outs = np.concatenate([s.out for s in scans])
    refs = np.concatenate([reference_rows(d.q, d.k, d.v, d.q_offset, s.pairs.rows, s.pairs.heads, Config().softmax_scale(
        d.hd)) for d, s in zip((dumps["a"], dumps["b"]), scans)])
    want = apa_emu.summarize(outs, refs).as_dict()
    pooled = many["pooled"]["summary"]
    assert pooled["pairs"] == len(outs)
    for key in ("pooled_cos", "mean_cos", "min_cos", "rel_l2_mean", "rel_l2_p99", "rel_l2_max"):
        assert pooled[key] == pytest.approx(want[key], rel=1e-12), key
    hot = sum(s.hot_tiles for s in scans) / sum(s.active_tiles for s in scans)
    assert pooled["hot_share"] == pytest.approx(hot) and 0 < hot < 1
    for part, one in zip(many["per_dump"], alone):
        assert part["certificate"] == one["certificate"] and one["certificate"]["coverage"] == 1.0
    bound = np.concatenate([s.bound for s in scans]).astype(np.float64)
    cert = many["pooled"]["certificate"]
    assert (cert["coverage"], cert["violations"]) == (1.0, 0)
    assert cert["bound_over_ref_median"] == pytest.approx(np.median(bound / np.linalg.norm(refs, axis=1)), rel=1e-12)
    assert cert["bound_over_err_min"] == pytest.approx(
        (bound / np.linalg.norm(outs.astype(np.float64) - refs, axis=1)).min(), rel=1e-9)
    assert run_json(capsys, "scan", dumps["root"], "--backend", "cpu") == many
    assert main(["scan", a, b, "--backend", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "a.apadump" in text and "b.apadump" in text and "pooled" in text
    assert "certificate err_bound" in text and "bound_over_err_median" in text


def test_worst_attribute_sweep_headroom_of_several_dumps(capsys, dumps, tmp_path):
    a, b = dumps["paths"]
    cpu = ("--backend", "cpu")
    worst = run_json(capsys, "worst", a, b, "-n", "5", *cpu)["worst"]
    assert [w["cos"] for w in worst] == sorted(w["cos"] for w in worst)
    scans = {"a.apadump": scan.run_pairs(dumps["a"], Config(), scan.Pairs.select(48, 6), backend="cpu"),
             "b.apadump": scan.run_pairs(dumps["b"], Config(), scan.Pairs.select(32, 4), backend="cpu")}
    every = sorted(float(c) for s in scans.values() for c in s.cos)
    assert [w["cos"] for w in worst] == pytest.approx(every[:5], rel=1e-12)
    assert {w["dump"] for w in worst} <= set(scans)

    png = tmp_path / "heat.png"
    att = run_json(capsys, "attribute", a, b, "--worst", "2", "--plot", str(png), *cpu)
    assert png.stat().st_size > 1000 and att["plot"] == str(png)
    assert set(att["pooled"]) == set(attribute.ATTRIBUTE_VARIANTS)
    for name, pooled in att["pooled"].items():
        parts = [d["variants"][name]["cos"] for d in att["per_dump"]]
        assert pooled["cos"] == sum(parts, []) and pooled["pairs"] == 4 and pooled["engine"] == "cpu"
    assert [len(d["breakdown"]["heads"]) for d in att["per_dump"]] == [6, 4]

    png = tmp_path / "frontier.png"
    sweep = run_json(capsys, "sweep", dumps["root"], "--eps", "-1", "0.01", "1e9", "--plot", str(png), *cpu)
    assert png.stat().st_size > 1000
    pooled = sweep["pooled"]
    assert [r["hot_share"] for r in pooled][::2] == [1.0, 0.0] and pooled[2]["pass2_tiles"] == 0
    assert pooled[0]["pass2_tiles"] == sum(d["sweep"][0]["pass2_tiles"] for d in sweep["per_dump"])
    assert pooled[1]["pairs"] == 48 * 6 + 32 * 4

    room = run_json(capsys, "headroom", a, b, *cpu)
    assert [d["headroom"]["pairs"] for d in room["per_dump"]] == [48 * 6, 32 * 4]
    for argv in (["attribute", a, b, "--worst", "1", "--plot", ""], ["sweep", a, b, "--eps", "0.01", "--plot", ""],
                 ["headroom", a, b], ["worst", a, b, "-n", "2"]):
        assert main([*argv, *cpu]) == 0
        assert "pooled" in capsys.readouterr().out or argv[0] == "worst"


def test_empty_folder_is_one_line(capsys, tmp_path):
    assert main(["scan", str(tmp_path), "--backend", "cpu"]) == 2
    assert capsys.readouterr().err == f"apa: error: {tmp_path}: a folder with no .apadump file\n"


def test_attribute_every_pair_with_breakdown(dumps, tmp_path):
    from apa_emu.study.commands.attribute import plot_heatmap

    d = dumps["b"]
    variants = {k: attribute.ATTRIBUTE_VARIANTS[k] for k in ("all (default)", "none", "all, exact MMA")}
    table = attribute.attribute(d, Config(), backend="cpu", variants=variants, buckets=3)
    base = scan.run_pairs(d, Config(), scan.Pairs.select(d.n, d.nh), backend="cpu")
    order = base.order()
    assert np.array_equal(table.pairs.rows, base.pairs.rows[order])
    assert table.variants["all (default)"].cos == pytest.approx(base.cos[order].tolist(), rel=1e-12)
    assert {s.pairs for s in table.variants.values()} == {d.n * d.nh}
    b = table.breakdown
    assert [h for h, _ in b.heads] == [0, 1, 2, 3] and len(b.buckets) == 3
    assert sum(st["pairs"] for _, st in b.buckets) == d.n * d.nh
    assert np.nanmin(b.min_cos) == pytest.approx(base.cos.min()) == min(st["min_cos"] for _, st in b.heads)
    assert b.buckets[0][0] == f"{d.q_offset}-{d.q_offset + 10}"
    png = plot_heatmap({"b": b, "again": b}, tmp_path / "h.png", "two panels")
    assert (tmp_path / "h.png").stat().st_size > 1000 and png.endswith("h.png")


# -- the GPU engine's code, NumPy standing in ---------------------------------------------------


def test_gpu_engine_code_gives_the_cpu_engines_results(numpy_gpu, dumps):
    d = dumps["b"]
    pairs = scan.Pairs.select(d.n, d.nh, rows=[0, 1, 30], heads=[1, 2])  # some warps, both KV heads
    gpu, cpu = GpuEngine(), engine.CpuEngine()
    assert_same_scans(scan.run_pairs(d, Config(), pairs, backend=gpu), scan.run_pairs(d, Config(), pairs, backend=cpu))
    jobs = [scan.Job.of(d, pairs)]
    for g, c in zip(*(sweep.sweep_jobs(jobs, Config(), [-1, 0.02], e)[0][0] for e in (gpu, cpu))):
        assert g.pass2_tiles == c.pass2_tiles and g.min_cos == pytest.approx(c.min_cos, abs=1e-12)
    variants = {k: attribute.ATTRIBUTE_VARIANTS[k] for k in ("all (default)", "K only", "all, exact MMA")}
    g, c = (attribute.attribute_jobs(jobs, Config(), e, variants=variants, cpu_worst=2, seed=False).tables[0]
            for e in (gpu, cpu))
    assert [s.engine for s in g.variants.values()] == ["gpu", "gpu", "cpu"]
    assert [s.pairs for s in g.variants.values()] == [6, 6, 2]
    for name in variants:
        np.testing.assert_allclose(g.variants[name].cos, c.variants[name].cos[:len(g.variants[name].cos)],
                                   rtol=0, atol=1e-12)


def test_dump_too_large_for_the_device_is_refused_up_front(numpy_gpu, monkeypatch):
    numpy_gpu.cuda.runtime.memGetInfo = lambda: (8 << 30, 16 << 30)
    S = 1 << 26  # 2^26 keys of d = 128, shapes only: broadcast views hold no memory
    k = np.broadcast_to(np.float16(1), (S, 1, 128))
    huge = Dump(np.broadcast_to(np.float16(1), (4, 1, 128)), k, k, S - 4)
    monkeypatch.setattr(apa_gpu.api, "run", lambda *a, **kw: pytest.fail("ran before the memory check"))
    with pytest.raises(ValueError, match=r"^the 32\.00 GiB dump \(67108864 keys, d = 128\) needs about \d+\.\d GiB "
                                         r"of GPU memory per KV head, more than the 8\.0 GiB free on GPU 0$"):
        scan.run_pairs(huge, Config(), scan.Pairs.select(4, 1), backend=GpuEngine())


# -- apa check, NumPy standing in ---------------------------------------------------------------


def _planted(field: str):
    """The emulator as the kernel, with one bit of one value flipped."""
    def run(call, cfg, **options):
        res = apa_emu.api.run(replace(call, warps=None), cfg)
        target = res.out if field == "out" else res.rows[field]
        first, bits = (0,) * target.ndim, np.uint16 if target.dtype == np.float16 else np.uint32
        target[first] = (np.asarray(target[first]).view(bits) ^ bits(1)).view(target.dtype)
        return res
    return run


@pytest.mark.parametrize("field, stage", [("l2", "pass 2 (FP16 scores q·k, row max and sum)"), ("part", "pass 1 (FP4 estimate"),
                                          ("out", "the merge (FP16 output)")])
def test_check_finds_a_planted_divergence(capsys, numpy_gpu, monkeypatch, dumps, tmp_path, field, stage):
    monkeypatch.setenv("APA_GPU_REPRO_DIR", str(tmp_path))
    a = dumps["paths"][0]
    assert main(["check", a, "--warps", "0:2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and "bitwise" in out and "on 4 warps of 1 dump under default config" in out
    assert out.endswith("\napa check: PASS: 4 warps passed, 0 failed\n")
    monkeypatch.setattr(apa_gpu.api, "run", _planted(field))
    assert main(["check", a, "--warps", "0,1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("apa check: the kernel differs from the emulator in a.apadump (KV head 0, separate "
                               "schedule), stage "
                               + stage)
    assert f"field='{field}'" in lines[1] or (field == "out" and "where='out'" in lines[1])
    repro = lines[2].split()[-1]
    from apa_emu.compare import load_reproducer

    saved = load_reproducer(repro)
    assert saved["q"].shape == (48, 3, 64) and saved["trace"] == [(0, 0, 0), (0, 0, 1)]


def test_check_generated_problems(capsys, numpy_gpu, monkeypatch, tmp_path):
    pytest.importorskip("hypothesis")
    monkeypatch.setenv("APA_GPU_REPRO_DIR", str(tmp_path))
    assert main(["check", "--hypothesis", "3", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"on 3 generated problems and configs \(--seed 7; exp2 [a-z0-9 /,_]+\), separate, fused and "
                     r"bounded schedules\napa check: PASS: 3 generated problems passed, 0 failed\n$", out)
    monkeypatch.setattr(apa_gpu.api, "run", _planted("out"))
    assert main(["check", "--hypothesis", "3", "--seed", "7"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "generated problem 1 (shrunk: " in lines[0] and "stage the merge (FP16 output)" in lines[0]
    assert lines[-2].startswith("  replay: apa check --engine gpu --repro ")
    assert lines[-1] == "apa check: FAIL: 0 generated problems passed, 1 failed"
    assert list(tmp_path.glob("apa_gpu_*.npz"))
    assert main(["check", "x.apadump", "--hypothesis", "2"]) == 2
