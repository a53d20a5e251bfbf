"""What several test modules share: problem generators, oracles and comparisons. Test modules import
them from here and never from one another, so each test file can move or change on its own."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import strategies as st

from apa_emu import formats, fpmath
from apa_emu.fpmath import ex2_tables
from apa_emu.pass1 import ROWS, P1Mode, P1Rows, P1State, p1_hot_test
from apa_emu.study import scan
from apa_emu.study.synth import synthetic

from apa_gpu.probes import run_probe_quant16


@st.composite
def problems(draw, max_keys=640, dims=(64, 128)):
    """Small attention problems with the structure the hot test cares about."""
    d = draw(st.sampled_from(dims))
    nkv = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 3]))
    kv = draw(st.integers(70, max_keys))
    n = draw(st.integers(1, min(kv, 40)))
    off = draw(st.integers(0, kv - n))
    dump = synthetic(
        n, kv, nkv * G, nkv, d, seed=draw(st.integers(0, 2**31 - 1)), q_offset=off,
        sink=draw(st.sampled_from([0.0, 2.0, 6.0])),
        locality=draw(st.sampled_from([0.0, 1.0, 3.0])),
        diffuse_heads=draw(st.sampled_from([0.0, 0.5])),
        channel_offset=draw(st.sampled_from([0.0, 2.0])),
        outliers=draw(st.sampled_from([0.0, 0.01])),
    )
    return dump.q, dump.k, dump.v, dump.q_offset


def mixed_problem(d: int):
    """A problem whose warps mix hot and cold tiles at ε = 0.3, so some rows merge both parts."""
    dump = synthetic(24, 700, 4, 2, d, seed=31, q_offset=676)
    return dump.q, dump.k, dump.v, dump.q_offset


def merged_f64(rows) -> np.ndarray:
    """The §9 merge evaluated in float64 from the traced binary32 states (no final FP16 rounding)."""
    return merge_f64(*(rows[f] for f in ("m1", "l1", "part", "m2", "l2", "o2")))


def merge_f64(m1, l1, part, m2, l2, o2) -> np.ndarray:
    """§9 in float64: each part weighted by 2^(m − max(m1, m2)), an empty part (l = 0) by 0."""
    m1, l1, m2, l2 = (np.asarray(x, np.float64) for x in (m1, l1, m2, l2))
    big = np.maximum(m1, m2)
    with np.errstate(invalid="ignore"):
        w1 = np.where(l1 > 0, np.exp2(np.where(l1 > 0, m1 - big, 0)), 0.0)
        w2 = np.where(l2 > 0, np.exp2(np.where(l2 > 0, m2 - big, 0)), 0.0)
    return (w1[:, None] * part + w2[:, None] * o2) / (w1 * l1 + w2 * l2)[:, None]


def f32_exact_rne(q: Fraction) -> np.float32:
    """The binary32 nearest to the rational q, ties to the even significand (finite results): the
    oracle of fma32, from the two binary32 neighbours of q's binary64 approximation."""
    f = np.float32(float(q))
    around = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(around, key=lambda x: (abs(Fraction(float(x)) - q), int(x.view(np.uint32)) & 1))


def emulated_budget_vote(m, la, ws, c, tl, t2, beta) -> np.ndarray:
    """apa_emu.pass1.p1_hot_test under the budget test, one running row at a time (row 0 of a warp)."""
    mode = P1Mode(0, *ex2_tables(True), True, True, np.arange(64), np.float32(1), False, False, False, np.float32(1), True)
    z = np.zeros(ROWS, np.float32)
    runs = np.zeros(ROWS, bool)
    runs[0] = True
    out = []
    for i in range(len(m)):
        row = lambda x: np.concatenate([np.float32([x[i]]), z[1:]])  # noqa: E731
        st = P1State(row(m), row(la), z.copy(), z.copy(), np.zeros((ROWS, 1), np.float32), z.copy(), row(ws))
        rows = P1Rows(runs, runs, np.zeros(ROWS, np.int64), np.zeros(ROWS, np.int64), z + np.float32(1), row(beta))
        tl2 = np.stack([row(tl), z], axis=1)
        out.append(p1_hot_test(tl2, row(t2), rows, st, row(c), np.float32(0), mode))
    return np.array(out)


def budget_edge_rows(n: int, seed: int):
    """n rows whose t2 is the right side βr ⊗ (L ⊗ L) itself (ws = +0, so the left side is t2), or one
    ulp either side of it, by float32 NumPy (one rounding an operation), with a = exp2s(m ⊖ c) < 1 so
    that la ⊗ a rounds. Also what L would be fused, fma(la, a, tl)."""
    rng = np.random.default_rng(seed)
    m = np.zeros(n, np.float32)
    c = rng.uniform(0.1, 6, n).astype(np.float32)
    a = fpmath.exp2s_np(m - c)
    la, tl = rng.uniform(1, 200, n).astype(np.float32), rng.uniform(0.01, 20, n).astype(np.float32)
    beta = rng.uniform(1e-6, 1e-2, n).astype(np.float32)
    L = la * a + tl
    right = beta * (L * L)
    toward = np.where(np.arange(n) % 3 == 1, np.float32(0), np.float32(np.inf)).astype(np.float32)
    t2 = np.where(np.arange(n) % 3 == 0, right, np.nextafter(right, toward))
    fused = fpmath.fma32_arrays(la, a, tl)
    return (m, la, np.zeros(n, np.float32), c, tl, t2.astype(np.float32), beta), right, fused


def first_diff(a, b, x):
    ab, bb = a.view(np.uint32) if a.dtype == np.float32 else a, b.view(np.uint32) if b.dtype == np.float32 else b
    bad = np.flatnonzero(ab.ravel() != bb.ravel())
    if bad.size:
        i = bad[0]
        return f"{bad.size} differ; first x={x.ravel()[i]!r}: gpu {a.ravel()[i]!r} vs emulator {b.ravel()[i]!r}"
    return None


def check_quant16(nb, lsq):
    """quant16 of nb blocks on the GPU (or the simulator: tests/kernel/test_gpu_sim.py) against the emulator."""
    rng = np.random.default_rng(11 + lsq)
    scale = np.exp2(rng.uniform(-40, 12, (nb, 1))).astype(np.float32)
    x = (rng.standard_normal((nb, 16)) * scale).astype(np.float32)
    # sparse, one-hot, ties and exact grid values
    x[: nb // 8, ::2] = 0
    x[nb // 8: nb // 4, 1:] = 0
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    ng = min(4096, nb // 4)
    x[nb // 4: nb // 4 + ng] = grid[rng.integers(0, 8, (ng, 16))] * np.float32(2.0) ** rng.integers(
        -9, 9, (ng, 1)).astype(np.float32) * rng.choice(np.float32([-1, 1]), (ng, 16))
    x[-1] = 0
    x = np.clip(x, -2688, 2688)
    gq, gs = run_probe_quant16(x, lsq)
    ec, es = formats.quantize_blocks(x, lsq)
    assert (msg := first_diff(gs, es[:, 0], np.arange(nb))) is None, "block scale: " + msg
    assert (msg := first_diff(gq, formats.dequantize_blocks(ec, es), x)) is None, "values: " + msg


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """Float64 perplexity of next-token logits [T, vocab] on the token ids [T]: the oracle both
    forward-pass cross-checks (SmolLM2, Gemma 3) compare against transformers with."""
    top = logits.max(axis=1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    return math.exp((lse[:-1] - logits[np.arange(ids.size - 1), ids[1:]]).mean())


def assert_same_scans(gpu: scan.Scan, cpu: scan.Scan):
    """The GPU engine's scan is the CPU engine's: outputs, certificates and hot masks bitwise, the
    metrics within 1e-12, the products of output and reference within 1e-12 relative (not
    Σ(out − ref)², which cancels: its metric, the relative L2, is compared)."""
    assert gpu.engine == "gpu" and cpu.engine == "cpu"
    assert gpu.out.tobytes() == cpu.out.tobytes() and gpu.bound.tobytes() == cpu.bound.tobytes()
    assert np.array_equal(gpu.result.hot, cpu.result.hot)
    assert (gpu.hot_tiles, gpu.active_tiles) == (cpu.hot_tiles, cpu.active_tiles)
    for x, y in zip(gpu.sums[:3], cpu.sums[:3]):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=0)
    for x, y in zip((gpu.cos, gpu.rel, gpu.sums.max_abs, *(gpu.split or ())),
                    (cpu.cos, cpu.rel, cpu.sums.max_abs, *(cpu.split or ()))):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)


def dask_distributed():
    """Dask's distributed, for a test module that needs it; without it the module is skipped."""
    try:
        import distributed
    except ImportError:
        if os.environ.get("CI"):  # the test extra installs it: under CI these run, never skip
            raise
        pytest.skip("Dask's distributed is not installed (pip install -e '.[test]')", allow_module_level=True)
    return distributed


# A script of tools/ loaded as a module, the way ``python tools/NAME.py`` runs it: the package importable
# (installed, or the checkout on PYTHONPATH), and the sibling tools it imports found by their own names (a
# script's folder is first on sys.path when it runs; here they are loaded first instead).
TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str, *siblings: str) -> ModuleType:
    """tools/NAME.py as the module NAME, after the SIBLINGS (tool names) it imports at its top; each is
    registered in sys.modules, so that ``import SIBLING`` inside a tool finds the one loaded here."""
    for sibling in siblings:
        load_tool(sibling)
    path = TOOLS / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_dump(folder: Path) -> str:
    """A dump of 16 rows, 4/2 heads, 128 keys, d = 64 (one warp per KV head) in ``folder``."""
    from apa_emu.study.dump import write_dump

    d = synthetic(16, 128, 4, 2, 64, seed=3)
    return str(write_dump(folder / "tiny.apadump", d.q, d.k, d.v, d.q_offset))


def one_error_line(capsys, argv, words: str) -> str:
    """``apa ARGV`` exits 2 with one line, ``apa: error: WORDS…``, and no traceback; returns the line."""
    from apa_emu.study.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"apa: error: {words}"), err
    assert "Traceback" not in out + err
    return err


@functools.lru_cache(maxsize=1)
def standin_sfu_tables():
    """apa_emu.sfu's stand-in tables (correctly rounded values at each table point), so that a recipe's
    structure is tested apart from the hardware's approximations."""
    from apa_emu import sfu

    return sfu.standin()
