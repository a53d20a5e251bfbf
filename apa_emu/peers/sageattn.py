"""SageAttention 1.0.6, ``sageattn(..., is_causal=True)`` on FP16 inputs of head dim 64 or 128, as
Triton 3.6 compiles it for sm_90, bit for bit (numerics.md §14).

The wrapper's torch steps (the K mean and its subtraction, §14.2) and the two Triton kernels
(per-block INT8 quantization, §14.3; the causal attention kernel, §14.4–§14.9) are each one function
here. Every binary32 operation is the one the PTX shows: ``mul.f32``/``add.f32``/``sub.f32`` are
NumPy float32 operations (RNE), ``fma.rn.f32`` is ``fpmath.fma32``, ``div.full.f32`` and
``ex2.approx.ftz.f32`` are the SFU models of ``sfu`` (numerics.md §13), the FP16 P·V ``wgmma`` is
``mma.mma_sm90_f16`` (numerics.md §3.1) and the INT8 ``wgmma`` is an exact integer product.

Shapes: q [n, h_q, d], k and v [n, h_k, d] (one batch element in the "NHD" layout; the layout only
moves addresses), h_q a multiple of h_k (GQA: query head h reads kv head h // (h_q / h_k)).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from apa_emu import fpmath, mma, sfu

BLOCK_M = 128  # Q rows per quantization block and per attention program (BLKQ, BLOCK_M)
BLOCK_N = 64  # K rows per quantization block and per attention step (BLKK, BLOCK_N)
HEAD_DIMS = (64, 128)
LOG2E = 1.44269504  # the wrapper's literal, multiplied in binary64 before the launcher's cast (§14.3)
RCP_127 = np.uint32(0x3C010204).view(np.float32)  # f32(1/127): ptxas folds div.full(·, 127) into ⊗ this (§14.3)
MASK = np.float32(-1.0e6)  # the causal mask's additive value (§14.6)
OUT_OF_RANGE_K_SCALE = np.float32(0.0)  # stands for the scale read past the K scales (§14.10)
_F32 = np.float32
_HALF = np.float32(0.5)


class Sage(NamedTuple):
    """The output and the intermediates that localise a mismatch, each as the device holds it."""

    out: np.ndarray  # float16 [n, h_q, d]
    km: np.ndarray  # float16 [h_k, d]: the K mean subtracted (§14.2)
    k_smooth: np.ndarray  # float16 [n, h_k, d]: k after ``k -= km`` (the wrapper's in-place edit)
    q_int8: np.ndarray  # int8 [n, h_q, d] (§14.3)
    q_scale: np.ndarray  # float32 [h_q, ceil(n/128)]
    k_int8: np.ndarray  # int8 [n, h_k, d]
    k_scale: np.ndarray  # float32 [h_k, ceil(n/64)]
    row_sum: np.ndarray  # float32 [n, h_q]: l_i before the final division (§14.9)
    row_max: np.ndarray  # float32 [n, h_q]: the last m_i (§14.8)
    q_sm_scale: np.float32  # the Q quantization kernel's sm_scale argument (§14.3)


class _State(NamedTuple):
    acc: np.ndarray  # float32 [R, d]
    l: np.ndarray  # float32 [R]
    m: np.ndarray  # float32 [R]


def check_inputs(q, k, v) -> None:
    """§14.1: what this recipe covers; anything else is one ValueError line naming what is missing."""
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError("sageattn: q must be [n, h_q, d] and k, v one shape [n, h_k, d]")
    if any(np.asarray(a).dtype != np.float16 for a in (q, k, v)):
        raise ValueError("sageattn: only float16 q, k, v are emulated (no bfloat16/float32 path)")
    if q.shape[2] not in HEAD_DIMS or k.shape[2] != q.shape[2]:
        raise ValueError(f"sageattn: head dim {q.shape[2]} not emulated (only 64 and 128; no hd96 kernel)")
    if q.shape[0] != k.shape[0] or q.shape[0] == 0:
        raise ValueError("sageattn: only causal attention with equal, non-zero q and kv lengths is emulated")
    if q.shape[1] % k.shape[1]:
        raise ValueError("sageattn: the query heads must be a multiple of the kv heads")


def k_mean(k: np.ndarray) -> np.ndarray:
    """§14.2 default K mean: f16(f32(Σ k) ⊗ f32(1/n)), the sum exact in binary64 and rounded once.
    torch sums in binary32 in its own order, so pass the device's ``km`` for a bitwise check."""
    total = k.astype(np.float64).sum(axis=0).astype(_F32)
    return (total * _F32(1.0 / k.shape[0])).astype(np.float16)


def smooth_k(k: np.ndarray, km: np.ndarray) -> np.ndarray:
    """§14.2 ``k -= km``: torch's FP16 subtraction, f16(f32(k) ⊖ f32(km))."""
    return (k.astype(_F32) - km.astype(_F32)[None]).astype(np.float16)


def q_scale_arg(head_dim: int, sm_scale: float | None) -> np.float32:
    """§14.3: ``sm_scale * 1.44269504`` in binary64 (default sm_scale = head_dim**-0.5), cast to
    binary32 (RNE) by Triton's launcher."""
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    return _F32(scale * LOG2E)


def to_int8(v: np.ndarray) -> np.ndarray:
    """§14.3 ``.to(tl.int8)``: ``cvt.rzi.s16.f32`` (toward zero, saturated to int16, NaN → 0), then
    the low byte (``prmt``)."""
    t = np.where(np.isnan(v), _F32(0), np.clip(np.trunc(v), -32768, 32767))
    return (t.astype(np.int64) & 0xFF).astype(np.uint8).view(np.int8)


def quantize(x: np.ndarray, scale_arg: np.float32, block: int, tables: sfu.Tables):
    """§14.3 ``quant_per_block_int8_kernel`` over every (head, block of ``block`` rows): x ⊗ sm_scale,
    scale = max |·| ⊗ f32(1/127), q = div.full(x, scale) ⊕ ±0.5, to_int8. Rows past n load as 0.
    Returns (int8 [n, h, d], scale float32 [h, nb])."""
    n, h, d = x.shape
    nb = -(-n // block)
    xs = np.zeros((nb * block, h, d), _F32)
    xs[:n] = x.astype(_F32) * scale_arg
    xs = xs.reshape(nb, block, h, d)
    amax = np.fmax.reduce(np.abs(xs), axis=(1, 3))  # max.f32 ignores NaN, as fmax does
    scale = amax * RCP_127
    qf = sfu.div_array(xs, scale[:, None, :, None], tables)
    qf = qf + np.where(qf >= 0, _HALF, -_HALF)
    return to_int8(qf).reshape(nb * block, h, d)[:n], np.ascontiguousarray(scale.T)


def _fma(a, b, c) -> np.ndarray:
    """``fma.rn.f32`` elementwise, operands broadcast to one shape."""
    a, b, c = (np.ascontiguousarray(t, _F32) for t in np.broadcast_arrays(a, b, c))
    return fpmath.fma32_arrays(a, b, c)


def scores(q_blk: np.ndarray, k_blk: np.ndarray, q_scale: np.float32) -> np.ndarray:
    """§14.4: the INT8 wgmma sum (exact, |Σ| < 2²⁴ so ``cvt.rn.f32.s32`` is exact) ⊗ q_scale."""
    qk = q_blk.astype(np.int64) @ k_blk.astype(np.int64).T  # ok: int64 sums are exact in any order
    return qk.astype(_F32) * q_scale


def off_diagonal(s: np.ndarray, k_scale: np.float32, m_old: np.ndarray):
    """§14.5 (STAGE 1, key blocks left of the diagonal): m = max(m_old, rowmax(s ⊗ k_scale));
    x = fma(k_scale, s, −m): the exponent's argument keeps the product unrounded."""
    m_new = np.fmax(m_old, np.fmax.reduce(s * k_scale, axis=1))
    return _fma(k_scale, s, -m_new[:, None]), m_new


def diagonal(s: np.ndarray, k_scale: np.float32, m_old: np.ndarray, rows: np.ndarray, cols: np.ndarray):
    """§14.6 (STAGE 2, the two key blocks on the diagonal): t = fma(k_scale, s, 0 or −10⁶) by
    row ≥ col; m = max(m_old, rowmax(t)); x = t ⊖ m."""
    t = _fma(k_scale, s, np.where(rows[:, None] >= cols[None, :], _F32(0), MASK))
    m_new = np.fmax(m_old, np.fmax.reduce(t, axis=1))
    return t - m_new[:, None], m_new


@njit(cache=True)
def row_sum(p):
    """§14.7 ``tl.sum(p, 1)`` over 64 columns: lane i of a quad adds its 16 columns 8j + 2i, 8j + 2i + 1
    (j = 0..7) left to right; the butterfly then gives (S₀ ⊕ S₂) ⊕ (S₁ ⊕ S₃)."""
    out = np.empty(p.shape[0], np.float32)
    part = np.empty(4, np.float32)
    for r in range(p.shape[0]):
        for i in range(4):
            s = p[r, 2 * i]
            s = s + p[r, 2 * i + 1]
            for j in range(1, BLOCK_N // 8):
                s = s + p[r, 8 * j + 2 * i]
                s = s + p[r, 8 * j + 2 * i + 1]
            part[i] = s
        out[r] = (part[0] + part[2]) + (part[1] + part[3])
    return out


def pv_mma(p: np.ndarray, v_blk: np.ndarray) -> np.ndarray:
    """§14.8: f16(P) (``cvt.rn.f16x2.f32``) times the V block, the wgmma m64nNk16 FP16-accumulating
    chain of 4 k16 steps from C = +0 (scale-d = 0), numerics.md §3.1. FP16 values as float32."""
    a = p.astype(np.float16).astype(_F32)
    b = np.ascontiguousarray(v_blk.T, _F32)
    out = np.zeros((a.shape[0], b.shape[0]), _F32)
    mma.mma_sm90_f16(a, b, out, out)
    return out


def fold(st: _State, x: np.ndarray, m_new: np.ndarray, v_blk: np.ndarray, tables: sfu.Tables) -> _State:
    """§14.8 one key block into the running state: p = ex2(x); α = ex2(m_old ⊖ m_new);
    l = fma(l, α, Σp); acc = fma(acc, α, f32(P·V))."""
    p = sfu.unary_array("ex2.approx.ftz.f32", x, tables)
    alpha = sfu.unary_array("ex2.approx.ftz.f32", st.m - m_new, tables)
    l_new = _fma(st.l, alpha, row_sum(p))
    acc = _fma(st.acc, alpha[:, None], pv_mma(p, v_blk))
    return _State(acc, l_new, m_new)


def _rows(a: np.ndarray, start: int, count: int) -> np.ndarray:
    """Rows start .. start + count − 1 of a, those past its end zero (the masked loads' zero fill)."""
    out = np.zeros((count,) + a.shape[1:], a.dtype)
    part = a[start:start + count]
    out[:len(part)] = part
    return out


def attend(q_blk, q_scale, k_head, k_scales, v_head, start_m: int, tables: sfu.Tables):
    """§14.4–§14.9 one program (query head, block start_m): key blocks 0 .. 2·start_m − 1 by §14.5,
    then the two diagonal blocks by §14.6; out = f16(div.full(acc, l)). Returns (out, l, m)."""
    rows = start_m * BLOCK_M + np.arange(q_blk.shape[0])
    st = _State(np.zeros((q_blk.shape[0], k_head.shape[1]), _F32),
                np.ones(q_blk.shape[0], _F32), np.full(q_blk.shape[0], -np.inf, _F32))
    for kb in range(2 * start_m + 2):
        start_n = kb * BLOCK_N
        ks = k_scales[kb] if kb < len(k_scales) else OUT_OF_RANGE_K_SCALE
        s = scores(q_blk, _rows(k_head, start_n, BLOCK_N), q_scale)
        if kb < 2 * start_m:
            x, m_new = off_diagonal(s, ks, st.m)
        else:
            x, m_new = diagonal(s, ks, st.m, rows, start_n + np.arange(BLOCK_N))
        st = fold(st, x, m_new, _rows(v_head, start_n, BLOCK_N), tables)
    out = sfu.div_array(st.acc, st.l[:, None], tables).astype(np.float16)
    return out, st.l, st.m


def run(q, k, v, *, km=None, sm_scale=None, tables: sfu.Tables | None = None) -> Sage:
    """§14: ``sageattn(q, k, v, tensor_layout="NHD", is_causal=True, sm_scale=sm_scale)`` for one batch
    element, with its intermediates. km: the FP16 K mean [h_k, d] the wrapper subtracted (default
    ``k_mean(k)``, §14.2)."""
    check_inputs(q, k, v)
    tables = tables or sfu.tables()
    n, h_q, d = q.shape
    group = h_q // k.shape[1]
    km = k_mean(k) if km is None else np.asarray(km, np.float16).reshape(k.shape[1], d)
    ks = smooth_k(k, km)
    arg = q_scale_arg(d, sm_scale)
    q8, qs = quantize(q, arg, BLOCK_M, tables)
    k8, kss = quantize(ks, _F32(1.0), BLOCK_N, tables)
    out = np.empty(q.shape, np.float16)
    l_all, m_all = np.empty((n, h_q), _F32), np.empty((n, h_q), _F32)
    for h in range(h_q):
        for bm in range(qs.shape[1]):
            sl = slice(bm * BLOCK_M, min(n, (bm + 1) * BLOCK_M))
            out[sl, h], l_all[sl, h], m_all[sl, h] = attend(
                q8[sl, h], qs[h, bm], k8[:, h // group], kss[h // group], v[:, h // group], bm, tables)
    return Sage(out, km, ks, q8, qs, k8, kss, l_all, m_all, arg)


def attention(q, k, v, *, km=None, sm_scale=None, tables: sfu.Tables | None = None) -> np.ndarray:
    """The FP16 output [n, h_q, d] of ``run`` (numerics.md §14)."""
    return run(q, k, v, km=km, sm_scale=sm_scale, tables=tables).out


def tile(row: int, head: int, n: int, h_q: int, h_k: int, nan: bool = False) -> str:
    """The program that computed output (row, head) (§14.4): its query block of 128 rows and the key
    blocks of 64 it read, the two on the diagonal last (§14.5, §14.6). ``nan``: the engine's value is
    NaN where the recipe's is not, which §14.10's unmasked scale read explains in the last block."""
    bm = row // BLOCK_M
    if nan and bm == (n - 1) // BLOCK_M and 1 <= n % BLOCK_M <= BLOCK_N:
        return tile(row, head, n, h_q, h_k) + "; NaN here may be the k_scale read past the scales (§14.10)"
    lo, hi = bm * BLOCK_M, min(n, (bm + 1) * BLOCK_M) - 1
    off = f"0..{2 * bm - 1} off the diagonal, then " if bm else ""
    return (f"query block {bm} (rows {lo}..{hi}, row {row - lo} of it) of query head {head} (kv head "
            f"{head // (h_q // h_k)}); key blocks {off}{2 * bm} and {2 * bm + 1} on the diagonal (keys "
            f"{lo}..{(bm + 1) * BLOCK_M - 1})")
