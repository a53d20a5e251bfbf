"""The emulated SageAttention2 sm_90 recipe (numerics.md §16) against independent oracles: float64
causal attention, ml_dtypes casts for the FP8 steps, hand-derived values of the Hopper FP8 wgmma
model and of the per-thread quantization groups. The SFU tables are the stand-ins (correctly
rounded at every table point), so no GPU's approximation enters.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from apa_emu import formats, mma, sfu
from apa_emu.peers import RECIPES
from apa_emu.peers import sage2 as s2
from helpers import standin_sfu_tables

F32 = np.float32
OFF = {f"quant_{x}": False for x in "qkpv"}


@pytest.fixture(scope="module", name="tables")
def standin_tables() -> sfu.Tables:
    return standin_sfu_tables()


def _qkv(seed: int, n: int, h_q: int, h_k: int, d: int):
    """FP16 standard normals; k gets a channel offset so that K smoothing has work to do."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, h_q, d))
    k = rng.standard_normal((n, h_k, d)) + rng.standard_normal(d) * 2
    v = rng.standard_normal((n, h_k, d))
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)


def _exact(q, k, v) -> np.ndarray:
    """softmax(q·kᵀ/√d) v in float64 with the causal mask, query head h reading kv head h div g."""
    g = q.shape[1] // k.shape[1]
    n, d = len(q), q.shape[2]
    logits = np.einsum("ihc,jhc->hij", q.astype(np.float64), np.repeat(k, g, 1).astype(np.float64)) / d**0.5
    logits = np.where(np.tri(n, dtype=bool)[None], logits, -np.inf)
    w = np.exp(logits - logits.max(axis=2, keepdims=True))
    return np.einsum("hij,jhc->ihc", w / w.sum(axis=2, keepdims=True), np.repeat(v, g, 1).astype(np.float64))


def _worst_cosine(out, want) -> float:
    a = out.astype(np.float64)
    return float(((a * want).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(want, axis=-1)).min())


@pytest.mark.parametrize("n,h_q,h_k,d,gran", [(150, 2, 1, 64, "per_thread"), (130, 2, 2, 128, "per_warp")])
def test_close_to_float64_attention(tables, n, h_q, h_k, d, gran):
    """INT8 Q·K and FP8 P·V keep every row's cosine above 0.99; with all four quantizations off only
    binary32 arithmetic is left and the worst row is within 1e-6 of the exact one."""
    q, k, v = _qkv(1, n, h_q, h_k, d)
    want = _exact(q, k, v)
    assert _worst_cosine(s2.attention(q, k, v, tables=tables, qk_quant_gran=gran), want) > 0.99
    assert _worst_cosine(s2.attention(q, k, v, tables=tables, qk_quant_gran=gran, **OFF), want) > 1 - 1e-6


def test_p_fp8_is_ml_dtypes_e4m3fn():
    """§16.6: P̃ in (0, 448] to E4M3 is RN with subnormals, as ml_dtypes' float8_e4m3fn cast."""
    rng = np.random.default_rng(2)
    p = np.concatenate([2.0 ** rng.uniform(-12, 8.807, 4000), [448.0, 447.9, 2.0**-9, 2.0**-10]]).astype(F32)
    got = formats.e4m3_values(formats.e4m3_codes(p))
    assert np.array_equal(got, p.astype(ml_dtypes.float8_e4m3fn).astype(F32))


def test_v_per_channel_fp8(tables):
    """§16.4: per (kv head, channel) scale = amax ⊗ rcp(448) and values e4m3(v ⊗ 448 ⊗ rcp(amax)),
    the cast as ml_dtypes does it; with stand-in tables rcp is correctly rounded."""
    _, _, v = _qkv(3, 100, 1, 2, 64)
    ops = s2.quantize_v(v, s2.Toggles(), tables)
    vt = np.zeros((2, 64, 128), F32)
    vt[:, :, :100] = v.astype(F32).transpose(1, 2, 0)
    amax = np.abs(vt).max(axis=2)
    for h, op in enumerate(ops):
        assert np.array_equal(op.scales, amax[h] * F32(1 / 448))
        y = vt[h] * (F32(448) * (F32(1) / amax[h]))[:, None]
        assert np.array_equal(op.values, y.astype(ml_dtypes.float8_e4m3fn).astype(F32))
        assert np.all(op.values[:, 100:] == 0)  # the zero padding to 128 tokens


def test_per_thread_groups(tables):
    """§16.3: a Q row shares its scale with the row 8 away in its warp's 16, a key with the keys of
    its lane ((j mod 8) div 2) in its tile of 128; a single large element shows which rows share."""
    x = np.full((128, 1, 64), F32(0.5))
    x[19, 0, 5] = 100.0
    _, qs = s2.quant_per_thread(x, s2.thread_groups(128, False), tables)
    assert set(np.flatnonzero(qs[:, 0] > 0.1)) == {19, 27}
    _, ks = s2.quant_per_thread(x, s2.thread_groups(128, True), tables)
    assert set(np.flatnonzero(ks[:, 0] > 0.1)) == {j for j in range(128) if (j % 8) // 2 == 1}
    assert ks[19, 0] == F32(F32(100) * F32(1 / 127)) + F32(1e-7)


def test_int8_codes_round_half_away(tables):
    """§16.3 per thread: div.full, ⊕ ±0.5, truncation: |code − x/scale| ≤ ½ and ties go away from 0."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 1, 64)).astype(F32)
    codes, scale = s2.quant_per_thread(x, s2.thread_groups(64, False), tables)
    ratio = x[:, 0] / scale[:, :1].astype(np.float64)
    assert np.abs(codes[:, 0] - ratio).max() <= 0.5 + 1e-5
    assert np.abs(codes).max() == 127


def test_hopper_fp8_wgmma_truncates_to_13_bits():
    """§16.7 (hand-derived): with C = 1 every product below 2^−13 is truncated away, 32 products of
    2^−13 add 2^−8 exactly, and a result keeps 13 fraction bits, truncated toward zero."""
    a, b = np.full((1, 32), F32(2.0**-7)), np.full((1, 32), F32(2.0**-7))
    out = np.empty((1, 1), F32)
    mma.mma_sm90_e4m3(a, b, np.ones((1, 1), F32), out)
    assert out[0, 0] == 1.0  # 32 × 2^−14 lost
    mma.mma_sm90_e4m3(a * 2, b, np.ones((1, 1), F32), out)
    assert out[0, 0] == 1 + 2.0**-8
    c = np.full((1, 1), F32(1 + 2.0**-13 + 2.0**-20))
    mma.mma_sm90_e4m3(np.zeros((1, 32), F32), b, c, out)
    assert out[0, 0] == F32(1 + 2.0**-13) and (out.view(np.uint32) & 0x3FF == 0).all()


TOGGLES = [dict(qk_quant_gran="per_warp"), dict(pv_accum="fp32"), dict(smooth_k=False), dict(quant_q=False),
           dict(quant_k=False), dict(quant_p=False), dict(quant_v=False), dict(fp8_mma="exact"),
           dict(masked_load=50.0)]


@pytest.fixture(scope="module")
def base(tables):
    q, k, v = _qkv(5, 300, 2, 1, 64)
    return (q, k, v), s2.run(q, k, v, tables=tables)


@pytest.mark.parametrize("toggle", TOGGLES, ids=lambda t: ",".join(f"{a}={b}" for a, b in t.items()))
def test_each_toggle_moves_the_output(tables, base, toggle):
    (q, k, v), ref = base
    assert not np.array_equal(s2.attention(q, k, v, tables=tables, **toggle), ref.out)


def test_contract_rescale_moves_the_row_sum(tables, base):
    """The contraction of ``d *= o_scale`` with the first add changes d's bits on some row (the output
    may round to the same FP16)."""
    (q, k, v), ref = base
    assert not np.array_equal(s2.run(q, k, v, tables=tables, contract_rescale=False).row_sum, ref.row_sum)


@pytest.mark.parametrize("args,words", [
    (dict(dtype=np.float32), "float16"), (dict(d=96), "head dim 96"), (dict(n_k=10), "equal"),
    (dict(toggles=dict(pv_accum="fp32+fp16")), "sm_89"), (dict(toggles=dict(qk_quant_gran="per_block")), "per_warp"),
    (dict(nan=True), "finite")])
def test_refusals_are_one_line(args, words):
    q = np.ones((8, 1, args.get("d", 64)), args.get("dtype", np.float16))
    k = np.ones((args.get("n_k", 8), 1, q.shape[2]), q.dtype)
    if args.get("nan"):
        q[0, 0, 0] = np.nan
    with pytest.raises(ValueError) as e:
        s2.run(q, k, k.copy(), **args.get("toggles", {}))
    assert "\n" not in str(e.value) and words in str(e.value) and str(e.value).startswith("sageattention2:")


def test_registered():
    assert RECIPES["sageattention2"].load() is s2 and RECIPES["sageattention2"].head_dims == s2.HEAD_DIMS
