"""SageAttention2's Hopper recipe (``sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, is_causal=True)``,
``pv_accum_dtype="fp32+fp32"``), emulated (numerics.md §16). No engine runs it here: this recipe is a
peer to compare against, not a reference a GPU is checked against bit for bit.

The steps are read from thu-ml/SageAttention (``sageattention/core.py``, ``sageattention/quant.py``,
``sageattention/triton/quant_per_thread.py``, ``csrc/fused/fused.cu``, ``csrc/qattn/qk_int_sv_f8_cuda_sm90.cu``,
``csrc/qattn/attn_utils.cuh``); where the source leaves an order or a value open, §16 names the reading
chosen here and a toggle (``Toggles``) reaches the alternative. Built on the shared primitives: E4M3
rounding from ``formats``, the INT8 wgmma as exact integer arithmetic, the FP8 wgmma ``mma.mma_sm90_e4m3``
(§16.7), ``fpmath.fma32`` and the SFU models of ``sfu`` (``ex2.approx.ftz.f32``, ``rcp.approx.ftz.f32``,
``div.full.f32``; numerics.md §13).

Shapes: q [n, h_q, d], k and v [n, h_k, d] (one batch element), FP16, d 64 or 128, h_q a multiple of h_k.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from apa_emu import formats, fpmath, mma, peers, sfu
from apa_emu.peers import sageattn

BLOCK_M = 64  # CTA_Q: query rows per program (and BLKQ of the quantizers)
BLOCK_N = 128  # CTA_K: keys per tile (and BLKK of the quantizers, the V padding multiple)
WARP_Q = 16  # rows per warp (WARPQ)
HEAD_DIMS = (64, 128)
GRANULARITIES = ("per_thread", "per_warp")
PV_ACCUMS = ("fp32+fp32", "fp32")
FP8_MMAS = ("hopper", "exact")
S_FP8_OFFSET = np.float32(8.807)  # ``#define S_FP8_OFFSET 8.807f``: P̃ ≤ 2^8.807 ≈ 447.8
LOG2E = np.float32(1.44269504088896340736)  # ``math::log2e``
MASK = np.float32(-5000000.0)  # the masked score and the initial row max
EPS = np.float32(1e-7)  # the quantizers' guard against a zero scale
FP8_MAX = np.float32(448.0)  # ``scale_max``
_F32 = np.float32
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)


@dataclasses.dataclass(frozen=True)
class Toggles:
    """§16's choices. Defaults are the published sm_90 path; each field turns one step off or picks
    another reading."""

    qk_quant_gran: str = "per_thread"  # §16.3: "per_thread" (core.py's default) or "per_warp"
    pv_accum: str = "fp32+fp32"  # §16.7: per-tile wgmma chain added to an fp32 buffer; "fp32": one chain
    smooth_k: bool = True  # §16.2: k −= mean over tokens
    quant_q: bool = True  # §16.3: INT8 Q (off: the FP16 values, scores by the exact model)
    quant_k: bool = True
    quant_p: bool = True  # §16.6: FP8 P (off: the binary32 P̃, P·V by the exact model)
    quant_v: bool = True  # §16.4: per-channel FP8 V (off: the FP16 values, no V scale)
    fp8_mma: str = "hopper"  # §16.7: the FP8 wgmma's 13-bit truncation, or "exact"
    contract_rescale: bool = True  # §16.6: ``RO *= o_scale`` then ``RO += RO_temp`` contracted to one fma
    masked_load: float = 0.0  # §16.3: what Triton's masked ``tl.load`` without ``other`` gives past n

    def check(self) -> None:
        for name, allowed in (("qk_quant_gran", GRANULARITIES), ("pv_accum", PV_ACCUMS), ("fp8_mma", FP8_MMAS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"sageattention2: {name} is one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                                 + ("; 'fp32+fp16' is the sm_89 kernel's, not sm_90's" if name == "pv_accum" else ""))


class Operand(NamedTuple):
    """An MMA operand: the values that enter the MMA (INT8 or E4M3 codes' values, or FP16 values when
    quantization is off) and its scales (ones when off)."""

    values: np.ndarray
    scales: np.ndarray
    quantized: bool


class Sage2(NamedTuple):
    """The output and the intermediates (query rows padded to a multiple of 64, keys to 128)."""

    out: np.ndarray  # float16 [n, h_q, d]
    km: np.ndarray  # float16 [h_k, d]: the K mean (zeros with smooth_k off)
    q: list  # per query head, Operand [n_q, d] with scales per row (the row's group scale)
    k: list  # per kv head, Operand [n_k, d] with scales per key
    v: list  # per kv head, Operand Vᵀ [d, n_k] with scales per channel
    row_sum: np.ndarray  # float32 [n, h_q]: the quad-reduced d before its reciprocal
    row_max: np.ndarray  # float32 [n, h_q]: the last running max (log2 units, offset by S_FP8_OFFSET)


def check_inputs(q, k, v) -> None:
    """§16.1: SageAttention 1.0.6's scope (§14.1) and finite inputs; else one ValueError line."""
    try:
        sageattn.check_inputs(q, k, v)
    except ValueError as e:
        raise ValueError("sageattention2:" + str(e).partition(":")[2]) from None
    if not all(np.isfinite(a).all() for a in (q, k, v)):
        raise ValueError("sageattention2: q, k, v must be finite")


def _padded(x: np.ndarray, n_pad: int, fill: float = 0.0) -> np.ndarray:
    out = np.full((n_pad,) + x.shape[1:], fill, x.dtype)
    out[:len(x)] = x
    return out


def thread_groups(n_pad: int, is_key: bool) -> np.ndarray:
    """§16.3 the per-thread quantization group of each row: Q rows r and r + 8 of a warp's 16 (the
    rows of one lane quad), 8 groups per warp; K rows 8j + 2t, 8j + 2t + 1 of a 128-key tile (the keys
    of lane t of every quad), 4 groups per tile."""
    r = np.arange(n_pad)
    if is_key:
        return (r // BLOCK_N) * 4 + (r % 8) // 2
    return (r // WARP_Q) * 8 + r % 8


def _group_amax(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """max |x| over each group's rows and all channels: [G, h] for x [n_pad, h, d]."""
    out = np.zeros((int(groups.max()) + 1, x.shape[1]), _F32)
    np.maximum.at(out, groups, np.abs(x).max(axis=2))
    return out


def quant_per_thread(x: np.ndarray, groups: np.ndarray, tables) -> tuple[np.ndarray, np.ndarray]:
    """§16.3 Triton ``quant_{query,key}_per_thread_int8_kernel`` on float32 x [n_pad, h, d]: scale =
    amax ⊗ f32(1/127) ⊕ f32(1e-7), code = to_int8(div.full(x, scale) ⊕ ±0.5). Returns (int8 codes,
    per-row scales [n_pad, h])."""
    scale = (_group_amax(x, groups) * sageattn.RCP_127 + EPS)[groups]
    y = sfu.div_array(x, scale[:, :, None], tables)
    return sageattn.to_int8(y + np.where(y >= 0, _F32(0.5), _F32(-0.5))), scale


def quant_per_block(x: np.ndarray, groups: np.ndarray, tables) -> tuple[np.ndarray, np.ndarray]:
    """§16.3 CUDA ``QuantInt8Kernel`` (per warp for Q, per 128-key block for K): amax = max(1e-7,
    max |x|), scale = amax ⊗ f32(1/127), code = cvt.rni.sat.s8(x ⊗ (127 ⊗ rcp(amax)))."""
    amax = np.fmax(_group_amax(x, groups), EPS)
    inv = _F32(127.0) * sfu.unary_array("rcp.approx.ftz.f32", amax, tables)
    y = x * inv[groups][:, :, None]
    codes = np.clip(np.rint(np.where(np.isnan(y), _ZERO, y)), -128, 127).astype(np.int8)
    return codes, (amax * sageattn.RCP_127)[groups]


def quantize_qk(q, k, km, t: Toggles, tables):
    """§16.2–§16.3: Q padded to a multiple of 64 rows, K (smoothed) to 128, both quantized to INT8 at
    ``t.qk_quant_gran``. Returns per-head Operand lists (q, k)."""
    n = q.shape[0]
    nq, nk = -(-n // BLOCK_M) * BLOCK_M, -(-n // BLOCK_N) * BLOCK_N
    if t.qk_quant_gran == "per_thread":
        qx = _padded(q.astype(_F32), nq, t.masked_load)
        kx = _padded(sageattn.smooth_k(k, km).astype(_F32), nk, t.masked_load)
        qc, qs = quant_per_thread(qx, thread_groups(nq, False), tables)
        kc, ks = quant_per_thread(kx, thread_groups(nk, True), tables)
    else:
        qx = _padded(q.astype(_F32), nq)
        kx = _padded(k.astype(_F32) - km.astype(_F32)[None], nk)  # fused sub-mean, binary32, not rounded
        qc, qs = quant_per_block(qx, np.arange(nq) // WARP_Q, tables)
        kc, ks = quant_per_block(kx, np.arange(nk) // BLOCK_N, tables)
    ones_q, ones_k = np.ones(nq, _F32), np.ones(nk, _F32)
    q_ops = [Operand(qc[:, h].astype(_F32), qs[:, h], True) if t.quant_q else Operand(qx[:, h], ones_q, False)
             for h in range(q.shape[1])]
    k_ops = [Operand(kc[:, h].astype(_F32), ks[:, h], True) if t.quant_k else Operand(kx[:, h], ones_k, False)
             for h in range(k.shape[1])]
    return q_ops, k_ops


def quantize_v(v: np.ndarray, t: Toggles, tables) -> list:
    """§16.4 ``per_channel_fp8(v, smooth_v=False)`` (``MeanScaleKernel``): per kv head and channel
    over the tokens padded with zeros to a multiple of 128, amax = max(|max|, |min|), scale = amax ⊗
    rcp(448), codes e4m3(x ⊗ (448 ⊗ rcp(amax))) (RN, satfinite; an all-zero channel gives 0 · inf = NaN,
    as on the GPU). Returns per kv head the Operand Vᵀ [d, n_k]."""
    nk = -(-v.shape[0] // BLOCK_N) * BLOCK_N
    vt = _padded(v, nk).astype(_F32).transpose(1, 2, 0)  # [h_k, d, n_k]
    if not t.quant_v:
        return [Operand(np.ascontiguousarray(x), np.ones(x.shape[0], _F32), False) for x in vt]
    rcp = functools.partial(sfu.unary_array, "rcp.approx.ftz.f32", t=tables)
    amax = np.abs(vt).max(axis=2)
    scale = amax * rcp(np.full(amax.shape, FP8_MAX, _F32))
    with np.errstate(invalid="ignore"):
        y = vt * (FP8_MAX * rcp(amax))[:, :, None]
    codes = np.where(np.isnan(y), np.uint8(0x7F), formats.e4m3_codes(np.where(np.isnan(y), _ZERO, y)))
    return [Operand(formats.e4m3_values(codes[h]), scale[h], True) for h in range(len(vt))]


def _fma(a, b, c) -> np.ndarray:
    a, b, c = (np.ascontiguousarray(x, _F32) for x in np.broadcast_arrays(a, b, c))
    return fpmath.fma32_arrays(a, b, c)


def lane_max(x: np.ndarray) -> np.ndarray:
    """The max of each lane's keys [R, 4]: lane t of a quad holds keys j with (j mod 8) div 2 = t."""
    return x.reshape(x.shape[0], -1, 4, 2).max(axis=(1, 3))


def lane_sums(p: np.ndarray, d: np.ndarray, o_scale: np.ndarray, contract: bool) -> np.ndarray:
    """§16.5 each lane's d after a tile: d ⊗= o_scale, then per 16 keys fk, d ⊕= ((p₀ ⊕ p₁) ⊕ p₈) ⊕ p₉
    (the lane's keys 16fk + 2t, +1, +8, +9); with ``contract`` the first add is fma(d, o_scale, s₀)."""
    s = p.reshape(p.shape[0], -1, 2, 4, 2)  # [R, fk, half, lane, pair]
    parts = ((s[:, :, 0, :, 0] + s[:, :, 0, :, 1]) + s[:, :, 1, :, 0]) + s[:, :, 1, :, 1]  # [R, fk, 4]
    d = _fma(d, o_scale[:, None], parts[:, 0]) if contract else d * o_scale[:, None] + parts[:, 0]
    for fk in range(1, parts.shape[1]):
        d = d + parts[:, fk]
    return d


def scores(q_op: Operand, k_op: Operand) -> np.ndarray:
    """§16.5 the INT8 wgmma chain (k32 steps from scale-d = 0): exact integers, |S| ≤ 127²·128 < 2²⁴,
    so ``__int2float_rz`` is exact; with either operand unquantized, the exact model on the values."""
    if q_op.quantized and k_op.quantized:
        return (q_op.values.astype(np.int64) @ k_op.values.astype(np.int64).T).astype(_F32)  # ok: exact ints
    out = np.empty((len(q_op.values), len(k_op.values)), _F32)
    mma.mma_exact(q_op.values, k_op.values, np.zeros_like(out), out)
    return out


def softmax_tile(s: np.ndarray, sc: np.ndarray, m_prev: np.ndarray, tables):
    """§16.5 ``update_mdo`` (exp_offset): per lane, m_t = fma(max of its keys' s, sc_t, −8.807); m =
    max(m_prev, m₀..m₃); o_scale = ex2(m_prev ⊖ m); P̃ = ex2(fma(s, sc, −m)). ``sc`` [R, 128] is the
    per-key scale (constant over a lane's keys). Returns (P̃, m, o_scale)."""
    m_lane = _fma(lane_max(s), lane_max(sc), -S_FP8_OFFSET)
    m = np.fmax(m_prev, m_lane.max(axis=1))
    ex2 = "ex2.approx.ftz.f32"
    o_scale = sfu.unary_array(ex2, m_prev - m, tables)
    p = sfu.unary_array(ex2, _fma(s, sc, -m[:, None]), tables)
    return p, m, o_scale


def pv(p: np.ndarray, vt: Operand, c: np.ndarray, t: Toggles) -> np.ndarray:
    """§16.6–§16.7 c + P·V over one tile: FP8 P (e4m3, RN satfinite) and FP8 V by the Hopper FP8 wgmma
    chain (4 k32 steps); with either unquantized or ``fp8_mma="exact"``, the exact model."""
    pa = formats.e4m3_values(formats.e4m3_codes(p)) if t.quant_p else p
    out = np.empty(c.shape, _F32)
    c = np.ascontiguousarray(c, _F32)
    b = np.ascontiguousarray(vt.values)
    if t.quant_p and vt.quantized and t.fp8_mma == "hopper":
        mma.mma_sm90_e4m3(np.ascontiguousarray(pa, _F32), b, c, out)
    else:
        mma.mma_exact(np.ascontiguousarray(pa, _F32), b, c, out)
    return out


class _State(NamedTuple):
    ro: np.ndarray  # float32 [R, d]
    lanes: np.ndarray  # float32 [R, 4]: each lane's d
    m: np.ndarray  # float32 [R]


def step(st: _State, s, sc, vt: Operand, t: Toggles, tables) -> _State:
    """One key tile: softmax, the row sum of P̃ and the P·V merge of ``t.pv_accum`` (§16.5–§16.7)."""
    p, m, o_scale = softmax_tile(s, sc, st.m, tables)
    lanes = lane_sums(p, st.lanes, o_scale, t.contract_rescale)
    if t.pv_accum == "fp32":
        ro = pv(p, vt, st.ro * o_scale[:, None], t)
    else:
        tmp = pv(p, vt, np.zeros_like(st.ro), t)
        ro = _fma(st.ro, o_scale[:, None], tmp) if t.contract_rescale else st.ro * o_scale[:, None] + tmp
    return _State(ro, lanes, m)


def attend_block(q_op: Operand, k_op: Operand, v_op: Operand, bx: int, n: int, sm_l2, t: Toggles, tables):
    """§16.5 query block bx (64 rows) of one head: key tiles 0 .. last in order, the last (the one
    holding key 64bx + 63, or n − 1) dequantized before the max and masked. Returns the _State."""
    rows = bx * BLOCK_M + np.arange(BLOCK_M)
    last = (min(n, (bx + 1) * BLOCK_M) - 1) // BLOCK_N
    st = _State(np.zeros((BLOCK_M, v_op.values.shape[0]), _F32), np.ones((BLOCK_M, 4), _F32),
                np.full(BLOCK_M, MASK, _F32))
    for it in range(last + 1):
        keys = slice(it * BLOCK_N, (it + 1) * BLOCK_N)
        k_tile = Operand(k_op.values[keys], k_op.scales[keys], k_op.quantized)
        s = scores(q_op, k_tile)
        dequant = q_op.scales[:, None] * k_tile.scales[None, :]
        if it < last:
            sc = sm_l2 * dequant
        else:
            cols = np.arange(keys.start, keys.stop)
            s = np.where((cols[None, :] > rows[:, None]) | (cols[None, :] >= n), MASK, s * dequant)
            sc = np.full(s.shape, sm_l2, _F32)
        vt = Operand(v_op.values[:, keys], v_op.scales, v_op.quantized)
        st = step(st, s, sc, vt, t, tables)
    return st


def finalize(st: _State, v_scale: np.ndarray, tables) -> tuple[np.ndarray, np.ndarray]:
    """§16.8 ``normalize_d``: d = (d₀ ⊕ d₁) ⊕ (d₂ ⊕ d₃) (``__shfl_xor`` 1 then 2), O ⊗ rcp(d), then
    ⊗ the channel's V scale (``fuse_v_scale``), f16 RN. Returns (out, d)."""
    d = (st.lanes[:, 0] + st.lanes[:, 1]) + (st.lanes[:, 2] + st.lanes[:, 3])
    o = st.ro * sfu.unary_array("rcp.approx.ftz.f32", d, tables)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        return (o * v_scale[None, :]).astype(np.float16), d


def softmax_scale_log2(d: int) -> np.float32:
    """§16.5: the launcher's f32(d^−½) (``float sm_scale``) ⊗ f32(log2 e) in the kernel."""
    return _F32(d**-0.5) * LOG2E


def run(q, k, v, *, tables: sfu.Tables | None = None, **toggles) -> Sage2:
    """§16: ``sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, is_causal=True)`` for one batch element, with
    its intermediates; ``toggles`` are fields of ``Toggles``."""
    check_inputs(q, k, v)
    t = Toggles(**toggles)
    t.check()
    tables = tables or sfu.tables()
    n, h_q, d = q.shape
    group = h_q // k.shape[1]
    km = sageattn.k_mean(k) if t.smooth_k else np.zeros(k.shape[1:], np.float16)
    q_ops, k_ops = quantize_qk(q, k, km, t, tables)
    v_ops = quantize_v(v, t, tables)
    sm_l2 = softmax_scale_log2(d)
    nq = len(q_ops[0].values)
    out = np.empty((nq, h_q, d), np.float16)
    l_all, m_all = np.empty((nq, h_q), _F32), np.empty((nq, h_q), _F32)
    for h in range(h_q):
        for bx in range(nq // BLOCK_M):
            sl = slice(bx * BLOCK_M, (bx + 1) * BLOCK_M)
            q_blk = Operand(q_ops[h].values[sl], q_ops[h].scales[sl], q_ops[h].quantized)
            st = attend_block(q_blk, k_ops[h // group], v_ops[h // group], bx, n, sm_l2, t, tables)
            out[sl, h], l_all[sl, h] = finalize(st, v_ops[h // group].scales, tables)
            m_all[sl, h] = st.m
    return Sage2(out[:n], km, q_ops, k_ops, v_ops, l_all[:n], m_all[:n])


def attention(q, k, v, *, tables: sfu.Tables | None = None, **toggles) -> np.ndarray:
    """The FP16 output [n, h_q, d] of ``run`` (numerics.md §16)."""
    return run(q, k, v, tables=tables, **toggles).out


def tile(row: int, head: int, n: int, h_q: int, h_k: int, nan: bool = False) -> str:
    """The kernel's program that computed output (row, head): its 64-row query block and the key
    tiles it visits (the last one masked). ``nan`` adds nothing here."""
    bx = row // BLOCK_M
    lo, hi = bx * BLOCK_M, min(n, (bx + 1) * BLOCK_M) - 1
    last = hi // BLOCK_N
    return (f"query block {bx} (rows {lo}..{hi}, row {row - lo} of it) of query head {head} (kv head "
            f"{head // (h_q // h_k)}); key tiles 0..{last}, tile {last} masked")


def parse_toggles(text: str) -> dict:
    """``KEY=VAL,...`` of ``Toggles`` fields as keyword arguments of ``run`` (``qk_quant_gran``,
    ``pv_accum`` and ``fp8_mma`` as words, ``masked_load`` a number, the rest 0/1/true/false); a
    ValueError of one line for an unknown key or a bad value."""
    out = peers.parse_toggles("sageattention2", Toggles, text)
    Toggles(**out).check()
    return out
