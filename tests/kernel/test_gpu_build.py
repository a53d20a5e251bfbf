"""CPU-side checks of the kernel build (no GPU needed): ``cuda/`` compiles for sm_90 with the local
nvcc and the flags numerics.md §1 requires, with no fused multiply-add, no flush-to-zero and no
approximate instruction in the bit-exact variants; every entry point takes the one struct the host
describes, laid out as the host lays it out; the head dims are those the sources allow. Skipped
when nvcc is absent."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from apa_emu.geometry import HEAD_DIMS
from apa_gpu import build, device, params, probes

try:
    NVCC = build.find_nvcc()
except build.BuildError:
    NVCC = None



@pytest.fixture(autouse=True)
def _needs_nvcc():
    """The PTX audit is the only check of §1's build flags: under CI a missing nvcc fails it."""
    if NVCC is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("nvcc not found (.ci/run installs it)")


# A representative pair in the default run; every variant under -m slow.
QUICK = [build.Variant(d=128, trace=True), build.Variant(d=64, p2_f32=True, p2_s32=True)]


@pytest.mark.parametrize("variant", [build.PROBE, *QUICK], ids=lambda v: getattr(v, "name", str(v)))
def test_compiles_for_sm90(variant):
    with tempfile.TemporaryDirectory() as td:
        log = build.compile_to(variant, Path(td) / "k.cubin", verbose=True)
        assert (Path(td) / "k.cubin").stat().st_size > 0
    assert "error" not in log.lower()
    for line in build.ptxas_report(log):
        # prep and probe kernels must not spill; the attention kernels report theirs (gpu_check.sh)
        assert "0 bytes spill stores" in line or line.startswith(("apa_pass", "apa_fused")), line


def _spill_stores(line: str) -> int:
    return int(re.search(r"(\d+) bytes spill stores", line).group(1))


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_default_pass1_keeps_its_registers(fast):
    """apa_pass1 (the mass and output tests) is a kernel of its own, apart from apa_pass1_budget: with
    both hot-test kinds behind one run-time branch in one kernel, ptxas 13.0 spilled 92-112 bytes of
    the default pass 1 (d = 128), inside its loop, and pass 1 ran 17 % (fast) and 12 % (exact) slower on
    the H200 (docs/results/performance-log.md, "The cost of §9.8 again"). Alone it spills 24."""
    with tempfile.TemporaryDirectory() as td:
        log = build.compile_to(build.Variant(d=128, exp2_fast=fast), Path(td) / "k.cubin", verbose=True)
    spills = {line.split()[0]: _spill_stores(line) for line in build.ptxas_report(log)}
    assert {"apa_pass1", "apa_pass1_budget", "apa_fused", "apa_fused_budget"} <= spills.keys()
    assert spills["apa_pass1"] <= 32, spills


@pytest.mark.slow
@pytest.mark.parametrize("variant", build.all_variants(), ids=lambda v: v.name)
def test_every_variant_compiles(variant):
    with tempfile.TemporaryDirectory() as td:
        build.compile_to(variant, Path(td) / "k.cubin")


@lru_cache(maxsize=None)
def _ptx(variant) -> str:
    src, defines, _ = build._source_and_defines(variant)
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "k.ptx"
        cmd = [NVCC, *[f for f in build.FLAGS if f != "-cubin"], "-ptx", *defines, "-o", str(out), str(src)]
        subprocess.run(cmd, check=True, capture_output=True)
        return out.read_text()


def _tables(ptx: str) -> dict[str, tuple[int, ...]]:
    """The int tables of cuda/params.cuh APA_EXPORT_INTS as the PTX initialises them."""
    tables = {}
    for name, size, init in re.findall(r"\.b8 (apa_\w+)\[(\d+)\] = \{([^}]*)\}", ptx):
        raw = bytes(int(b) for b in init.split(",")).ljust(int(size), b"\0")  # trailing zeros are left out
        ints = np.frombuffer(raw, "<i4")
        tables[name] = tuple(int(x) for x in ints[1: 1 + ints[0]])
    return tables


@pytest.mark.parametrize("variant", [build.PROBE, *QUICK], ids=lambda v: getattr(v, "name", str(v)))
def test_entry_points_take_the_host_structs(variant):
    """Each entry point has one parameter, of its host struct's size, and every struct's exported
    layout equals the host's (apa_gpu.device refuses to launch otherwise)."""
    ptx = _ptx(variant)
    kernels = probes.KERNELS if variant == build.PROBE else params.KERNELS
    entries = dict(re.findall(r"\.entry (\w+)\(([^)]*)\)", ptx))
    assert set(entries) == set(kernels)
    tables = _tables(ptx)
    for name, struct in kernels.items():
        assert re.findall(r"\.param .*\[(\d+)\]", entries[name]) == [str(struct.dtype.itemsize)], name
        device.check_struct(tables.__getitem__, struct)
    if variant != build.PROBE:
        device.check_layout(tables["apa_layout"], variant)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_head_dims_are_those_the_sources_allow(d):
    cmd = [NVCC, "-E", "-std=c++17", f"-DAPA_D={d}", "-o", "/dev/null", str(build.CUDA_DIR / "apa.cu")]
    assert (subprocess.run(cmd, capture_output=True).returncode == 0) == (d in build.SUPPORTED_D)


@pytest.mark.parametrize("variant", QUICK, ids=lambda v: v.name)
def test_ptx_has_no_fma_ftz_or_approx(variant):
    """numerics.md §1.1–1.2: every binary32 operation is a single rounding without flush; the only
    fused operations are the binary16 fma of quant16 (§4.4, two per fma.rn.f16x2), the exact FMAs of the P' thresholds
    (§7.5), config fma's sites (§1.8, fpmath.cuh madd, marked in the PTX) and pass 2's Σp² (§8.4,
    fpmath.cuh fma_sq, marked, four per hot-tile step of 8 keys); the only flushing one is
    exp2s_nonpos's multiply, whose flush is §2 step 6 (fpmath.cuh fmul_step6, marked); MUFU only in the
    fast exp2 variant."""
    ptx = _ptx(variant)
    ops = re.findall(r"^\s+([a-z][a-z0-9_.]*)", ptx, flags=re.M)
    fused = {o for o in ops if o.startswith("fma") and o not in ("fma.rn.f16", "fma.rn.f16x2")}
    assert fused <= {"fma.rn.f32", "fma.rn.sat.f32"}, fused
    # The binary32 FMAs besides madd's: formats.cuh e2m1_exp2s_scaled (§7.5), 7 saturated steps and 2
    # exact sums per call.
    madd = len(re.findall(r"^\s+fma\.rn\.f32 [^\n]*// madd$", ptx, flags=re.M))
    sq = len(re.findall(r"^\s+fma\.rn\.f32 [^\n]*// sq$", ptx, flags=re.M))
    plain = ops.count("fma.rn.f32") - madd - sq
    assert madd > 0, "config fma's sites are missing"
    assert sq > 0 and sq % 4 == 0, f"§8.4's Σp² fmas: {sq}"
    assert 7 * plain == 2 * ops.count("fma.rn.sat.f32"), "a binary32 FMA outside the P' thresholds and madd"
    step6 = len(re.findall(r"^\s+mul\.rn\.ftz\.f32 [^\n]*// step 6$", ptx, flags=re.M))
    assert {o for o in ops if ".ftz" in o} <= {"mul.rn.ftz.f32"}
    assert ops.count("mul.rn.ftz.f32") == step6, "a flushing multiply outside exp2s_nonpos's step 6"
    assert not {o for o in ops if ".approx" in o}
    arith = {o for o in ops if re.match(r"(add|sub|mul|div)\.[a-z0-9.]*f(16|32)", o)}
    assert all(".rn" in o for o in arith), arith


def test_cache_key_tracks_sources(tmp_path, monkeypatch):
    """A build is reused while nothing changes and rebuilt after an edit to any file of cuda/, also
    one the entry file only includes; $APA_GPU_SOURCES chooses the copy built."""
    cuda = tmp_path / "cuda"
    shutil.copytree(build.CUDA_DIR, cuda)
    monkeypatch.setenv("APA_GPU_SOURCES", str(cuda))
    monkeypatch.setenv("APA_GPU_CACHE", str(tmp_path / "cache"))
    p1 = build.build(build.PROBE)
    assert p1.parent == tmp_path / "cache" and p1.is_file()
    assert build.build(build.PROBE) == p1  # cached
    with open(cuda / "fpmath.cuh", "a") as f:
        f.write("\n// edited\n")
    p2 = build.build(build.PROBE)
    assert p2 != p1 and p2.is_file() and p1.is_file()
    monkeypatch.setenv("APA_GPU_SOURCES", str(tmp_path / "cache"))
    with pytest.raises(build.BuildError, match=r"^APA_GPU_SOURCES=.*: not a copy of cuda/ \(it has no apa\.cu\)$"):
        build.build(build.PROBE)
