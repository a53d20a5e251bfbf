"""SageAttention3's NVFP4 recipe (``sageattn3_blackwell(q, k, v, is_causal=True)``, sm_120), emulated
(numerics.md §15). No engine runs it: the kernel needs sm_120, so this recipe is a peer to compare
against, not a reference a GPU is checked against bit for bit.

The steps are read from thu-ml/SageAttention at d1a57a5 (``sageattn3/api.py``,
``quantization/fp4_quantization_4d.cu``, ``blackwell/mainloop_tma_ws.h``, ``blackwell/softmax_fused.h``);
where the source leaves an order or a value open, §15 names the reading chosen here and a toggle
(``Toggles``) reaches the alternative. Built on the shared primitives: E2M1/E4M3 rounding from
``formats``, the block-scaled MMA ``mma.mma_sm120`` (numerics.md §3.2), ``fpmath.fma32`` and the SFU
models of ``sfu`` (``ex2.approx.ftz.f32``, ``rcp.approx.ftz.f32``, ``div.full.f32``; numerics.md §13).

Shapes: q [n, h_q, d], k and v [n, h_k, d] (one batch element), FP16, d 64 or 128, h_q a multiple of
h_k (query head h reads kv head h // (h_q / h_k), as the kernel reads kv heads repeated to h_q).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
from numba import njit

from apa_emu import formats, fpmath, mma, sfu
from apa_emu import peers
from apa_emu.peers import sageattn

BLOCK = BLOCK_M = 128  # kBlockM = kBlockN = the padding multiple = the Q mean group (GROUP_SIZE)
HEAD_DIMS = (64, 128)  # DISPATCH_HEAD_DIM of the quantizer
SIXTH = np.float32(1.0 / 6.0)  # ``vecMax / 6.0f``: ptxas folds the constant division into ⊗ f32(1/6) (§13.1)
PS_LOG2 = np.float32(-11.392317422778762)  # fp8_scalexfp4_scale_log2 = log2(1/(448·6))
FP4_LOG2 = np.float32(-2.584962500721156)  # fp4_scale_log2 = log2(1/6)
LANE_KEYS = (np.arange(4)[:, None, None] * 8 + np.arange(0, BLOCK, 32)[None, :, None]
             + np.arange(8)[None, None, :]).reshape(4, -1)  # the keys of a tile each lane of a quad sums
_F32 = np.float32


@dataclasses.dataclass(frozen=True)
class Toggles:
    """§15's choices. The defaults are the published kernel; each field turns one step off or picks
    the other reading of a value the source leaves undefined."""

    causal_dropped_tile: bool = True  # §15.7: the tile left of the diagonal enters the row sum only
    smooth_k: bool = True  # §15.2: k −= mean over tokens, in FP16
    q_mean: bool = True  # §15.2: q −= per-128-row mean, the correction qm·kᵀ added to the scores
    delta_f16: bool = True  # §15.2: the correction rounded to FP16 (off: binary32)
    quant_q: bool = True  # §15.3: NVFP4 Q (off: the FP16 values, products by mma_exact)
    quant_k: bool = True
    quant_v: bool = True
    quant_p: bool = True  # §15.5: two-level NVFP4 P (off: the binary32 P̃)
    acc_init: float = 0.0  # §15.6: the value the uncleared P·V accumulators start from
    block_max_init: float = -math.inf  # §15.5: the unwritten AbsMaxP the first tile's fmaxf reads


class Operand(NamedTuple):
    """An MMA operand along its contraction axis: E2M1 codes and UE4M3 scales (None when its
    quantization is off) and the values the codes stand for (else the FP16 values) as float32."""

    codes: np.ndarray | None
    scales: np.ndarray | None
    values: np.ndarray


class Sage3(NamedTuple):
    """The output and the intermediates, in the kernel's padded length n_pad (a multiple of 128)."""

    out: np.ndarray  # float16 [n, h_q, d]
    km: np.ndarray  # float16 [h_k, d]: the K mean (zeros with smooth_k off)
    qm: np.ndarray  # float16 [h_q, n_pad/128, d]: the Q group means (zeros with q_mean off)
    delta_s: np.ndarray  # float32 [h_q, n_pad/128, n_pad]: qm·kᵀ, the scores' initial accumulator
    q: list  # per query head, the Operand [n_pad, d] (blocks of 16 channels)
    k: list  # per kv head, the Operand [n_pad, d]
    v: list  # per kv head, the Operand Vᵀ [d, n_pad] (blocks of 16 tokens)
    row_sum: np.ndarray  # float32 [n, h_q]: the quad-reduced row sum before its reciprocal
    row_max: np.ndarray  # float32 [n, h_q]: the last running row max


def check_inputs(q, k, v) -> None:
    """§15.1: what this recipe covers (SageAttention 1.0.6's scope, §14.1, and finite inputs); anything
    else is one ValueError line naming what is missing."""
    try:
        sageattn.check_inputs(q, k, v)
    except ValueError as e:
        raise ValueError(str(e).replace("sageattn:", "sageattention3:", 1)) from None
    if not all(np.isfinite(a).all() for a in (q, k, v)):
        raise ValueError("sageattention3: q, k, v must be finite")


@njit(cache=True)
def _e2m1_loop(x, out):
    for i in range(x.size):
        out[i] = formats.e2m1_code(x[i])


def nvfp4(x: np.ndarray, tables: sfu.Tables) -> tuple[np.ndarray, np.ndarray]:
    """§15.3 ``scaled_fp4_quant`` over 16-element blocks of the last axis of float32 x: SF =
    e4m3(amax ⊗ f32(1/6)) (RN, satfinite; subnormal and zero scales kept); inv = SF = 0 ? 0 :
    rcp.approx.ftz(SF); code = e2m1(x ⊗ inv) (RN, satfinite). Returns (codes, scale codes)."""
    blocks = x.reshape(x.shape[:-1] + (-1, 16))
    sf = formats.e4m3_codes(np.abs(blocks).max(axis=-1) * SIXTH)
    value = formats.e4m3_values(sf)
    inv = np.where(value == 0, _F32(0), sfu.unary_array("rcp.approx.ftz.f32", value, tables))
    y = np.ascontiguousarray(blocks * inv[..., None], _F32)
    codes = np.empty(y.shape, np.uint8)
    _e2m1_loop(y.reshape(-1), codes.reshape(-1))
    return codes.reshape(x.shape), sf


def operand(x: np.ndarray, quantize: bool, tables: sfu.Tables) -> Operand:
    """x (FP16 values as float32, contraction axis last) as an MMA operand, quantized or not."""
    x = np.ascontiguousarray(x, _F32)
    if not quantize:
        return Operand(None, None, x)
    codes, scales = nvfp4(x, tables)
    return Operand(codes, scales, formats.dequantize_blocks(codes, scales))


def matmul(a: Operand, b: Operand, c: np.ndarray) -> np.ndarray:
    """c + a·bᵀ: the sm_120 block-scaled MMA chain (numerics.md §3.2) when both operands are NVFP4,
    else the exact model (numerics.md §3.3) on their values."""
    out = np.empty(c.shape, _F32)
    c = np.ascontiguousarray(c, _F32)
    if a.codes is not None and b.codes is not None:
        mma.mma_sm120(a.codes, a.scales, b.codes, b.scales, c, out)
    else:
        mma.mma_exact(a.values, b.values, c, out)
    return out


def _padded(x: np.ndarray, n_pad: int) -> np.ndarray:
    out = np.zeros((n_pad,) + x.shape[1:], x.dtype)
    out[:len(x)] = x
    return out


def preprocess(q, k, t: Toggles):
    """§15.2 ``preprocess_qkv``: K smoothing over the n real tokens, zero padding to a multiple of 128,
    Q smoothing by 128-row group means, and the correction delta_s = qm·kᵀ of the smoothed K.
    Returns (q_smooth [n_pad, h_q, d], k_smooth [n_pad, h_k, d], km, qm [h_q, G, d], delta_s [h_q, G, n_pad])."""
    n_pad = -(-q.shape[0] // BLOCK) * BLOCK
    km = sageattn.k_mean(k) if t.smooth_k else np.zeros(k.shape[1:], np.float16)
    ks = _padded(sageattn.smooth_k(k, km), n_pad)
    qp = _padded(q, n_pad)
    groups = qp.reshape(-1, BLOCK, *q.shape[1:])
    qm = np.stack([sageattn.k_mean(g) for g in groups], axis=1) if t.q_mean else \
        np.zeros((q.shape[1], len(groups), q.shape[2]), np.float16)
    qs = sageattn.smooth_k(groups.transpose(1, 0, 2, 3), qm.transpose(1, 0, 2)).transpose(1, 0, 2, 3).reshape(qp.shape)
    group = q.shape[1] // k.shape[1]
    # §15.2 chooses a binary64 sum (no hardware fixes its order); the FP16/binary32 rounding after it
    # removes the order's effect on the last binary64 bits except at exact ties
    exact = np.einsum("hgd,nhd->hgn", qm.astype(np.float64),  # ok: §15.2's chosen binary64 sum
                      np.repeat(ks, group, axis=1).astype(np.float64))
    delta = exact.astype(np.float16) if t.delta_f16 else exact
    return qs, ks, km, qm, delta.astype(_F32)


def _fma(a, b, c) -> np.ndarray:
    a, b, c = (np.ascontiguousarray(x, _F32) for x in np.broadcast_arrays(a, b, c))
    return fpmath.fma32_arrays(a, b, c)


def lane_sums(p: np.ndarray, start: np.ndarray | None, alpha: np.ndarray | None) -> np.ndarray:
    """§15.5 the row sum's four lane partials [4, R] after one tile: lane i adds its 32 keys
    (``LANE_KEYS[i]``) left to right; on a later tile the first add is fma(sum, α, p) (``row_sum *=
    scores_scale`` contracted with the first ``+=``), on the first tile the sum starts at p."""
    out = np.empty((4, p.shape[0]), _F32)
    for lane, keys in enumerate(LANE_KEYS):
        s = p[:, keys[0]].copy() if start is None else _fma(start[lane], alpha, p[:, keys[0]])
        for key in keys[1:]:
            s = s + p[:, key]
        out[lane] = s
    return out


class _Tile(NamedTuple):
    """One key tile's softmax step (§15.5): P̃, its per-16-key scales s, the new max and α."""

    p: np.ndarray  # float32 [R, 128]
    s: np.ndarray  # float32 [R, 8]
    m: np.ndarray  # float32 [R]
    alpha: np.ndarray | None  # float32 [R]; None on the first tile


def softmax_tile(scores: np.ndarray, m_old: np.ndarray | None, c: np.float32, block_max_init: float,
                 tables: sfu.Tables) -> _Tile:
    """§15.5 ``online_softmax_with_quant``: per 16 keys the block max (fmaxf, on the first tile
    starting from the unwritten AbsMaxP, ``block_max_init``), the row max over the block maxima,
    max_scaled = fma(m, c, log2(1/2688)), P̃ = ex2(fma(S, c, −max_scaled)), s = ex2(fma(bmax, c,
    −max_scaled) ⊕ log2(1/6)); a later tile also gives α = ex2((m_old ⊖ m) ⊗ c)."""
    bmax = scores.reshape(scores.shape[0], -1, 16).max(axis=-1)
    if m_old is None:
        bmax = np.fmax(_F32(block_max_init), bmax)
    m = bmax.max(axis=1) if m_old is None else np.fmax(m_old, bmax.max(axis=1))
    neg_scaled = -_fma(m, c, PS_LOG2)
    ex2 = "ex2.approx.ftz.f32"
    p = sfu.unary_array(ex2, _fma(scores, c, neg_scaled[:, None]), tables)
    s = sfu.unary_array(ex2, _fma(bmax, c, neg_scaled[:, None]) + FP4_LOG2, tables)
    alpha = None if m_old is None else sfu.unary_array(ex2, (m_old - m) * c, tables)
    return _Tile(p, s, m, alpha)


def p_operand(tile: _Tile, quantize: bool, tables: sfu.Tables) -> Operand:
    """§15.5 P as the P·V operand: codes e2m1(div.full(P̃, s)) (the unrounded s) and scales e4m3(s)
    (RN, satfinite), so the MMA dequantizes with the rounded s; with quant_p off, P̃ itself."""
    if not quantize:
        return Operand(None, None, tile.p)
    y = sfu.div_array(tile.p, np.repeat(tile.s, 16, axis=1), tables)
    codes = np.empty(y.shape, np.uint8)
    _e2m1_loop(y.reshape(-1), codes.reshape(-1))
    scales = formats.e4m3_codes(tile.s)
    return Operand(codes, scales, formats.dequantize_blocks(codes, scales))


def _cols(op: Operand, keys: slice) -> Operand:
    """Vᵀ's columns ``keys`` (a tile of 128 tokens; its scales are those of 8 blocks of 16)."""
    blocks = slice(keys.start // 16, keys.stop // 16)
    return Operand(None if op.codes is None else op.codes[:, keys],
                   None if op.scales is None else op.scales[:, blocks], op.values[:, keys])


def _rows(op: Operand, rows: slice) -> Operand:
    return Operand(*(None if a is None else a[rows] for a in op))


def attend_block(q_op, k_op, vt_op, delta, mb: int, c: np.float32, t: Toggles, tables):
    """§15.4–§15.8 one query block mb (128 rows) of one head: key tiles mb (the diagonal, masked),
    mb − 1, …, 0. Returns (O before the row sum's reciprocal, lane partials, row max)."""
    rows = mb * BLOCK + np.arange(BLOCK)
    o = lanes = m = None
    for step, nb in enumerate(range(mb, -1, -1)):
        keys = slice(nb * BLOCK, (nb + 1) * BLOCK)
        s = matmul(q_op, _rows(k_op, keys), np.broadcast_to(delta[keys], (BLOCK, BLOCK)))
        if step == 0:
            s = np.where(rows[:, None] >= np.arange(keys.start, keys.stop)[None, :], s, _F32(-np.inf))
        tile = softmax_tile(s, m, c, t.block_max_init, tables)
        lanes, m = lane_sums(tile.p, lanes, tile.alpha), tile.m
        pv = matmul(p_operand(tile, t.quant_p, tables), _cols(vt_op, keys),
                    np.full((BLOCK, vt_op.values.shape[0]), t.acc_init, _F32))
        if step == 0:
            o = pv
        elif not (step == 1 and t.causal_dropped_tile):
            o = _fma(o, tile.alpha[:, None], pv)  # rescale_o: O_store ⊗ scores_scale ⊕ tOrO, contracted
    return o, lanes, m


def finalize(o: np.ndarray, lanes: np.ndarray, tables: sfu.Tables) -> tuple[np.ndarray, np.ndarray]:
    """§15.8: the quad's partials by ``__shfl_xor`` 1 then 2, (l₀ ⊕ l₁) ⊕ (l₂ ⊕ l₃); inv = 0 for a
    zero or NaN sum, else rcp.approx.ftz(sum); out = f16(O ⊗ inv). Returns (out, row sum)."""
    total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
    bad = (total == 0) | np.isnan(total)
    inv = np.where(bad, _F32(0), sfu.unary_array("rcp.approx.ftz.f32", np.where(bad, _F32(1), total), tables))
    return (o * inv[:, None]).astype(np.float16), total


def softmax_scale_log2(d: int) -> np.float32:
    """§15.4: the launcher's f32(f32(d^−½) · log2 e), the product in binary64."""
    return _F32(float(_F32(d**-0.5)) * math.log2(math.e))


def run(q, k, v, *, tables: sfu.Tables | None = None, **toggles) -> Sage3:
    """§15: ``sageattn3_blackwell(q, k, v, is_causal=True)`` for one batch element, with its
    intermediates; ``toggles`` are fields of ``Toggles``."""
    check_inputs(q, k, v)
    t = Toggles(**toggles)
    tables = tables or sfu.tables()
    n, h_q, d = q.shape
    group = h_q // k.shape[1]
    qs, ks, km, qm, delta = preprocess(q, k, t)
    n_pad = qs.shape[0]
    vt = _padded(v, n_pad).astype(_F32).transpose(1, 2, 0)
    q_ops = [operand(qs[:, h], t.quant_q, tables) for h in range(h_q)]
    k_ops = [operand(ks[:, h], t.quant_k, tables) for h in range(k.shape[1])]
    v_ops = [operand(vt[h], t.quant_v, tables) for h in range(k.shape[1])]
    c = softmax_scale_log2(d)
    out = np.empty((n_pad, h_q, d), np.float16)
    l_all, m_all = np.empty((n_pad, h_q), _F32), np.empty((n_pad, h_q), _F32)
    for h in range(h_q):
        for mb in range(n_pad // BLOCK):
            sl = slice(mb * BLOCK, (mb + 1) * BLOCK)
            o, lanes, m_all[sl, h] = attend_block(_rows(q_ops[h], sl), k_ops[h // group], v_ops[h // group],
                                                  delta[h, mb], mb, c, t, tables)
            out[sl, h], l_all[sl, h] = finalize(o, lanes, tables)
    return Sage3(out[:n], km, qm, delta, q_ops, k_ops, v_ops, l_all[:n], m_all[:n])


def attention(q, k, v, *, causal_dropped_tile: bool = True, tables: sfu.Tables | None = None,
              **toggles) -> np.ndarray:
    """The FP16 output [n, h_q, d] of ``run`` (numerics.md §15)."""
    return run(q, k, v, causal_dropped_tile=causal_dropped_tile, tables=tables, **toggles).out


def tile(row: int, head: int, n: int, h_q: int, h_k: int, nan: bool = False) -> str:
    """The kernel's work tile that computed output (row, head): its query block and key tiles in the
    order visited, and which tile the published causal path leaves out of the output (§15.7). ``nan``
    (the recipe interface's flag for an engine's NaN) adds nothing: no read here passes an end."""
    mb = row // BLOCK
    lo, hi = mb * BLOCK, min(n, (mb + 1) * BLOCK) - 1
    dropped = f"; key tile {mb - 1} enters the row sum only (published causal path)" if mb else ""
    return (f"query block {mb} (rows {lo}..{hi}, row {row - lo} of it) of query head {head} (kv head "
            f"{head // (h_q // h_k)}); key tiles {mb} (diagonal) down to 0{dropped}")


def parse_toggles(text: str) -> dict:
    """``KEY=VAL,...`` of ``Toggles`` fields (booleans as 0/1/true/false, the inits as numbers) as
    keyword arguments of ``run``; a ValueError of one line for an unknown key or a bad value."""
    return peers.parse_toggles("sageattention3", Toggles, text)
