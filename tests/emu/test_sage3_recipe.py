"""The emulated SageAttention3 recipe (numerics.md §15) against independent oracles: float64 causal
attention, a float64 model of the published causal path (the tile left of the diagonal in the row sum
but not in the output), ml_dtypes casts for the NVFP4 format steps, and hand-derived orders.

Stand-in SFU tables (correctly rounded exp2 and reciprocal at each table point) keep the recipe's
structure apart from any GPU's approximations.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from apa_emu import sfu
from apa_emu.peers import RECIPES
from apa_emu.peers import sage3 as s3
from helpers import standin_sfu_tables

F32 = np.float32
OFF = dict(quant_q=False, quant_k=False, quant_v=False, quant_p=False)


@pytest.fixture(scope="module")
def tables() -> sfu.Tables:
    return standin_sfu_tables()


def _inputs(seed: int, n: int, h_q: int, h_k: int, d: int, k_shift: float = 1.0):
    """FP16 q, k, v of standard normals, k shifted (a per-row constant of the exact scores)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, h, d)) for h in (h_q, h_k, h_k))
    return q.astype(np.float16), (k + k_shift).astype(np.float16), v.astype(np.float16)


def _scores(q, k):
    """float64 scores [h_q, n, n] with the causal mask, kv heads repeated over their group."""
    g = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), g, axis=1)
    s = np.einsum("nhd,mhd->hnm", q.astype(np.float64), kk) / np.sqrt(q.shape[2])
    s[:, np.triu(np.ones((len(q), len(k)), bool), 1)] = -np.inf
    return s


def _attend(weights, v, group):
    return np.einsum("hnm,mhd->nhd", weights, np.repeat(v.astype(np.float64), group, axis=1))


def _float64_causal(q, k, v):
    s = _scores(q, k)
    p = np.exp(s - s.max(-1, keepdims=True))
    return _attend(p / p.sum(-1, keepdims=True), v, q.shape[1] // k.shape[1])


def _dropped_tile_oracle(q, k, v, rescaled: bool = True):
    """The published causal path in float64: for a row of query block b ≥ 1 the keys of tile b − 1
    stay in the row sum and leave the numerator, and (``rescaled``) the diagonal tile's part keeps the
    scale of its own max m₀ instead of max(m₀, m₁): it is weighted by e^(m₁ − m₀) too many."""
    s = _scores(q, k)
    n = len(q)
    p = np.exp(s - s.max(-1, keepdims=True))
    keep = np.ones_like(p)
    tile = np.arange(n) // s3.BLOCK
    for row in range(s3.BLOCK, n):
        b = row // s3.BLOCK
        diag, left = s[:, row, tile == b], s[:, row, tile == b - 1]
        m0 = diag.max(-1)
        boost = np.exp(np.maximum(m0, left.max(-1)) - m0) if rescaled else np.ones_like(m0)
        keep[:, row, tile == b - 1] = 0.0
        keep[:, row, tile == b] = boost[:, None]
    return _attend(p * keep / p.sum(-1, keepdims=True), v, q.shape[1] // k.shape[1])


def _cos(a, b) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_registered_as_emulated_recipe():
    rec = RECIPES["sageattention3"]
    assert rec.load() is s3 and rec.inputs == () and rec.head_dims == s3.HEAD_DIMS


@pytest.mark.parametrize("d, n, heads", [(64, 200, (2, 1)), (128, 140, (1, 1))])
def test_corrected_kernel_close_to_float64(tables, d, n, heads):
    """NVFP4 everywhere: the bar FP4 peers publish (cos ≥ 0.97); every quantization off: the FP32
    pipeline, orders of magnitude closer."""
    q, k, v = _inputs(d + n, n, *heads, d)
    ref = _float64_causal(q, k, v)
    fp4 = s3.attention(q, k, v, causal_dropped_tile=False, tables=tables)
    assert _cos(fp4, ref) >= 0.97
    exact = s3.attention(q, k, v, causal_dropped_tile=False, tables=tables, **OFF)
    assert _cos(exact, ref) >= 0.999999 and np.abs(exact - ref).max() <= 2e-3


def test_dropped_tile_is_the_published_causal_path(tables):
    """Rows < 128 are bitwise the corrected kernel's; later rows follow the float64 model of the
    defect, whose diagonal-tile weighting matters (the model without it misses by far more)."""
    q, k, v = _inputs(7, 300, 1, 1, 64)
    fixed = s3.attention(q, k, v, causal_dropped_tile=False, tables=tables, **OFF)
    published = s3.attention(q, k, v, tables=tables, **OFF)
    assert np.array_equal(fixed[:128].view(np.uint16), published[:128].view(np.uint16))
    differ = (fixed != published).any(axis=(1, 2))
    assert differ[128:].mean() > 0.9
    want = _dropped_tile_oracle(q, k, v)
    err = np.abs(published - want).max()
    assert err <= 2e-3
    assert np.abs(published - _dropped_tile_oracle(q, k, v, rescaled=False)).max() > 50 * err


def test_dropped_tile_with_fp4(tables):
    """With every quantization on, the defect still changes exactly the query blocks past the first."""
    q, k, v = _inputs(8, 260, 2, 2, 128)
    fixed = s3.attention(q, k, v, causal_dropped_tile=False, tables=tables)
    published = s3.attention(q, k, v, tables=tables)
    assert np.array_equal(fixed[:128].view(np.uint16), published[:128].view(np.uint16))
    assert (fixed[128:] != published[128:]).any(axis=2).mean() > 0.9
    assert _cos(published, _float64_causal(q, k, v)) < _cos(fixed, _float64_causal(q, k, v))


def _e4m3(x):
    return np.clip(x, 0, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def test_nvfp4_matches_ml_dtypes(tables):
    """scaled_fp4_quant: scale = e4m3(f32(amax) ⊗ f32(1/6)), subnormal and zero scales kept,
    codes e2m1(x ⊗ 1/scale) (0 for a zero scale); the blocks span normal, subnormal and zero scales."""
    rng = np.random.default_rng(3)
    mags = 10.0 ** rng.uniform(-4, 3.5, (64, 1))
    x = (rng.standard_normal((64, 128)) * mags).astype(np.float16).astype(F32)
    codes, sf = s3.nvfp4(x, tables)
    amax = np.abs(x.reshape(64, 8, 16)).max(-1)
    scale = _e4m3(amax * F32(1.0 / 6.0))
    assert np.array_equal(sf.view(ml_dtypes.float8_e4m3fn).astype(F32), scale)
    inv = np.where(scale == 0, F32(0), F32(1) / np.where(scale == 0, F32(1), scale))
    y = np.clip(x.reshape(64, 8, 16) * inv[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
    got = codes.reshape(64, 8, 16).view(np.uint8)
    assert np.array_equal(s3.formats.E2M1_VALUES[got], y.astype(F32))
    assert (sf == 0).any() and ((sf > 0) & (sf < 8)).any() and (sf >= 8).any()


def test_p_divides_by_unrounded_scale_and_dequantizes_by_rounded(tables):
    """Two-level P: codes e2m1(P̃ / s) with the binary32 s, the MMA's scale e4m3(s); so a block's
    values are e2m1(P̃ / s)·e4m3(s), not e2m1(P̃ / e4m3(s))·e4m3(s), and the two differ here."""
    rng = np.random.default_rng(5)
    p = rng.uniform(0, 2688, (32, 128)).astype(F32)
    s = rng.uniform(1, 448, (32, 8)).astype(F32)
    op = s3.p_operand(s3._Tile(p, s, None, None), True, tables)
    y = (p / np.repeat(s, 16, axis=1)).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    want = y * np.repeat(_e4m3(s), 16, axis=1)
    assert np.array_equal(op.values, want)
    other = (p / np.repeat(_e4m3(s), 16, axis=1)).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    assert (other * np.repeat(_e4m3(s), 16, axis=1) != want).any()


def test_row_sum_lanes_and_quad_reduction(tables):
    """Lane i of the quad sums keys 32c + 8i .. 32c + 8i + 7; the quad adds (l₀ ⊕ l₁) ⊕ (l₂ ⊕ l₃):
    1 at key 0 and 2⁻²⁴ at keys 8, 16, 24 give 1 + 2⁻²³, where a sum over the keys in order stays 1."""
    p = np.zeros((2, 128), F32)
    p[0, [0, 8, 16, 24]] = [1.0, 2.0**-24, 2.0**-24, 2.0**-24]
    p[1, [0, 1, 2]] = [1.0, 2.0**-24, 2.0**-24]  # one lane: left to right, each 2⁻²⁴ lost
    _, total = s3.finalize(np.zeros((2, 64), F32), s3.lane_sums(p, None, None), tables)
    assert list(total) == [F32(1.0 + 2.0**-23), F32(1.0)]


def test_gqa_equals_repeated_kv_heads(tables):
    q, k, v = _inputs(3, 150, 4, 2, 64)
    a = s3.attention(q, k, v, tables=tables)
    b = s3.attention(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), tables=tables)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("toggle", [dict(causal_dropped_tile=False), dict(smooth_k=False), dict(q_mean=False),
                                    dict(delta_f16=False), dict(quant_q=False), dict(quant_k=False),
                                    dict(quant_v=False), dict(quant_p=False), dict(acc_init=1.0),
                                    dict(block_max_init=0.0)])
def test_each_toggle_moves_the_output(tables, toggle):
    q, k, v = _inputs(11, 200, 1, 1, 64, k_shift=-2.0)
    base = s3.attention(q, k, v, tables=tables)
    moved = s3.attention(q, k, v, tables=tables, **toggle)
    assert (base != moved).any()


@pytest.mark.parametrize("shape_q, shape_kv, dtype, words", [
    ((64, 1, 256), (64, 1, 256), np.float16, "head dim 256"),
    ((64, 1, 96), (64, 1, 96), np.float16, "head dim 96"),
    ((64, 1, 64), (32, 1, 64), np.float16, "equal"),
    ((64, 3, 64), (64, 2, 64), np.float16, "multiple"),
    ((64, 1, 64), (64, 1, 64), np.float32, "float16"),
])
def test_refusals_are_one_line(shape_q, shape_kv, dtype, words):
    q, k = np.zeros(shape_q, dtype), np.zeros(shape_kv, dtype)
    if words == "equal":  # and an infinity, refused only once the shapes pass
        bad = np.zeros(shape_q, dtype)
        bad[3, 0, 5] = np.inf
        with pytest.raises(ValueError, match="finite"):
            s3.check_inputs(bad, bad, bad)
    with pytest.raises(ValueError, match=words) as e:
        s3.attention(q, k, k, tables=sfu.Tables(np.zeros(1, F32), np.zeros(1, F32), np.zeros(1, np.uint16)))
    assert "\n" not in str(e.value)
