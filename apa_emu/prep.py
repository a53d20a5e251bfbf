"""Prep: K mean, head and row scales, quantized Q, K and V (numerics.md §5).

Everything here is vectorised NumPy in binary32 elementwise operations (each one IEEE RNE), plus the
block quantizer from ``formats``. The results are laid out the way pass 1 and pass 2 consume them:
per (batch, KV head), packed rows for Q and 64-key tiles for K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import formats
from .config import Config
from .constants import EXACT, Q_FP8, Q_OFF, SM120, Flags, PrepFlags
from .fpmath import fma32_arrays, up2
from .geometry import TILE, cdiv
from .kvstate import Stats, overflows

F32 = np.float32
FOUR, QMAX, E4M3_MAX, TINY = F32(4), F32(2688), F32(448), F32(1e-20)
NRM_FLOOR, NRM_UP = F32(2.0**-126), F32(1 + 2.0**-10)  # §5.7
KV_STATS = ("kn", "ek", "k2n", "vn", "ev", "km", "ekm", "vm", "evm")  # §5.7: the columns of Prepared.kvstat, in order
# §5.10, the seed's prep_d: chunks of 16 tiles, at least 16 of them sampled, each summed by 32 key rows
# whose sums 8 warps reduce in pairs
CHUNK_KEYS, SAMPLED_CHUNKS, KEY_ROWS, WARP_ROWS = 1024, 16, 32, 4


@dataclass
class Prepared:
    """Prep output for one batch entry; arrays are indexed [hk, ...]."""

    d: int
    G: int
    n: int
    S: int
    q_offset: int
    qmul: np.float32
    kmean: np.ndarray  # [Hkv, d] f32
    kg: np.ndarray  # [Hkv] f32
    vg: np.ndarray  # [Hkv] f32
    q16: np.ndarray  # [Hkv, R, d] f32 holding the FP16 input rows
    qhat: np.ndarray  # [Hkv, R, d] f32 pass-1 operand (FP16 values under sm90)
    cq: np.ndarray  # [Hkv, R] f32
    sh: np.ndarray  # [Hkv, R] f32
    khat: np.ndarray  # [Hkv, T*64, d] f32
    vhat_t: np.ndarray  # [Hkv, T, d, 64] f32, keys in slot order
    k16: np.ndarray  # [Hkv, T*64, d] f32 FP16 input keys, zero padded
    v16_t: np.ndarray  # [Hkv, T, d, 64] f32 FP16 input values, natural key order
    qstat: np.ndarray  # [Hkv, R, 3] f32: qn, eq, q2n of §5.7
    kvstat: np.ndarray  # [Hkv, len(KV_STATS)] f32
    nu_t: np.ndarray | None = None  # [Hkv, T, 64] f32, §5.8 (output hot test only)
    # sm120 only: codes and UE4M3 scales
    q_codes: np.ndarray | None = None  # [terms, Hkv, R, d] u8
    q_scales: np.ndarray | None = None  # [terms, Hkv, R, d/16] u8
    k_codes: np.ndarray | None = None  # [Hkv, T*64, d]
    k_scales: np.ndarray | None = None  # [Hkv, T*64, d/16]
    v_codes_t: np.ndarray | None = None  # [Hkv, T, d, 64]
    v_scales_t: np.ndarray | None = None  # [Hkv, T, d, 4]


def slot_map(interleaved: bool) -> np.ndarray:
    """Key (within a tile) held by each of the 64 slots; group g is slots 16g..16g+15 (§7.3)."""
    t = np.arange(TILE)
    if not interleaved:
        return t
    g = 2 * (t // 32) + (t // 4) % 2
    return np.concatenate([t[g == i] for i in range(4)])


def slot_keys(p_groups: str) -> np.ndarray:
    """``slot_map`` of a config's ``p_groups`` by its name, as apa_emu.call exports it to a reader of
    the kernel's images."""
    return slot_map(p_groups == "interleaved")


def pack_rows(q: np.ndarray, Hkv: int) -> np.ndarray:
    """[n, H, d] -> [Hkv, n*G, d]: packed row r is position r // G of head hk*G + r % G (§6.1)."""
    n, H, d = q.shape
    G = H // Hkv
    return q.reshape(n, Hkv, G, d).transpose(1, 0, 2, 3).reshape(Hkv, n * G, d)


def unpack_rows(x: np.ndarray, n: int, G: int) -> np.ndarray:
    """Inverse of pack_rows: [Hkv, n*G, d] -> [n, H, d]."""
    Hkv, _, d = x.shape
    return x.reshape(Hkv, n, G, d).transpose(1, 0, 2, 3).reshape(n, Hkv * G, d)


def exact_mean(x16: np.ndarray, axis: int) -> np.ndarray:
    """§5.1's mean of FP16 values along ``axis``: the exact integer sum in units of 2^-24 (order-free),
    then one binary64 division and one rounding."""
    units = (x16.astype(np.float64) * 2.0**24).astype(np.int64)  # exact: FP16 values are k·2^-24
    total = units.sum(axis=axis)  # ok: int64, order-free
    return (total.astype(np.float64) / np.float64(max(x16.shape[axis], 1)) * 2.0**-24).astype(F32)


def kmean_exact(k16: np.ndarray) -> np.ndarray:
    """§5.1: the K mean per channel."""
    return exact_mean(k16, 0)


def norm_mean(norms: np.ndarray) -> np.ndarray:
    """§5.7's means [Hkv] of per-key norms [Hkv, n]: f16 of each, then ``exact_mean``."""
    return exact_mean(_f16(norms), 1)


def head_scale(amax: np.ndarray) -> np.ndarray:
    """§5.2: up2((4 ⊗ max(amax, 1e-20)) ⊘ 2688)."""
    x = (FOUR * np.maximum(amax.astype(F32), TINY)) / QMAX
    return np.array([up2(F32(v)) for v in np.atleast_1d(x)], dtype=F32).reshape(np.shape(x))


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(F32)


def _fold(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return formats.dequantize_blocks(codes, scales)


def operand(x: np.ndarray, model: int) -> np.ndarray:
    """§5.6: an unquantized pass-1 operand enters at FP16 under `sm90`/`sm120`, as binary32 under `exact`."""
    return x if model == EXACT else _f16(x)


def prep_stats(k: np.ndarray, v: np.ndarray):
    """§5.1–5.2 per KV head, from the FP16 keys and values [S, Hkv, d]: the exact K mean and the head
    scales kg, vg (maxima of FP16 magnitudes are exact in FP16)."""
    kmean = kmean_exact(k)  # [Hkv, d]
    amax = lambda x: np.abs(x).max(axis=(0, 2)).astype(F32)  # noqa: E731
    kg = head_scale(amax(k) + np.abs(kmean).max(axis=1))
    vg = head_scale(amax(v))
    return kmean, kg, vg


def chunk_sum(x: np.ndarray) -> np.ndarray:
    """§5.10: the binary32 sum of one chunk x [L ≤ 1024, ...] over its keys, in the seed's order: 32 key
    rows summed sequentially, each warp's 4 rows in pairs, the 8 warps in order from +0. Padding the
    chunk with +0 keys changes no partial sum (a sum from +0 is never −0)."""
    rows = np.zeros((cdiv(x.shape[0], KEY_ROWS) * KEY_ROWS, *x.shape[1:]), F32)
    rows[:x.shape[0]] = x
    rows = rows.reshape(-1, KEY_ROWS, *x.shape[1:])
    acc = np.zeros(rows.shape[1:], F32)
    for step in rows:
        acc = acc + step
    warps = (acc[0::WARP_ROWS] + acc[1::WARP_ROWS]) + (acc[2::WARP_ROWS] + acc[3::WARP_ROWS])
    total = np.zeros(x.shape[1:], F32)
    for w in warps:
        total = total + w
    return total


def sampled_stats(k: np.ndarray, v: np.ndarray, stride: int):
    """§5.10 of one batch entry (k, v [S, Hkv, d] FP16) over the chunks 0, stride, 2·stride, …: kmean
    (binary32 sums in the seed's order, ⊘ n), kg and vg from the maxima of the sampled keys."""
    S, Hkv, d = k.shape
    total, n = np.zeros((Hkv, d), F32), 0
    amax_k, amax_v = np.zeros(Hkv, F32), np.zeros(Hkv, F32)
    for s0 in range(0, S, CHUNK_KEYS * stride):
        kc, vc = k[s0:s0 + CHUNK_KEYS].astype(F32), v[s0:s0 + CHUNK_KEYS].astype(F32)
        total = total + chunk_sum(kc)
        n += kc.shape[0]
        amax_k = np.maximum(amax_k, np.abs(kc).max(axis=(0, 2)))
        amax_v = np.maximum(amax_v, np.abs(vc).max(axis=(0, 2)))
    kmean = total / F32(n)
    return kmean, head_scale(amax_k + np.abs(kmean).max(axis=1)), head_scale(amax_v)


def call_stats(k: np.ndarray, v: np.ndarray, v_f16: bool) -> Stats:
    """§5.10 of a whole call (k, v [B, S, Hkv, d]): the sampled statistics of every (b, hk), taken again
    over all keys when one of them overflows."""
    def every_entry(stride: int) -> Stats:
        return Stats(*(np.stack(x) for x in zip(*(sampled_stats(kb, vb, stride) for kb, vb in zip(k, v)))))

    stride = max(1, cdiv(k.shape[1], CHUNK_KEYS) // SAMPLED_CHUNKS)
    stats = every_entry(stride)
    if stride > 1 and overflows(k, v, 0, stats, np, v_f16):
        stats = every_entry(1)
    return stats


def nrm(a: np.ndarray) -> np.ndarray:
    """§5.7 nrm over the last axis: binary32 squares summed in channel order, then √(ss ⊕ 2⁻¹²⁶) ⊗ (1 + 2⁻¹⁰)."""
    a = np.asarray(a, F32)
    ss = np.zeros(a.shape[:-1], F32)
    for c in range(a.shape[-1]):
        ss = ss + a[..., c] * a[..., c]
    return np.sqrt(ss + NRM_FLOOR) * NRM_UP


def prep_q(q16: np.ndarray, kmean: np.ndarray, kg: np.ndarray, qmul: np.float32, flags: Flags, fp4: dict):
    """§5.3 per packed row: Q̂ (NVFP4 in one or two terms, FP8, or unquantized), c_q and the pass-2
    row shift sh = (q·k̄ summed sequentially over channels) ⊗ qmul; and §5.7's qn, eq, q2n."""
    f, model = flags.prep, flags.model.model
    x = q16 * qmul
    am = np.abs(x).max(axis=2, keepdims=True)
    if f.q_mode == Q_FP8:
        qr = np.maximum(am, TINY) / E4M3_MAX
        x = x / qr
        qhat = qeff = formats.e4m3_values(formats.e4m3_codes(x))
    else:
        qr = np.maximum(am, TINY) / QMAX
        x = x / qr
        if f.q_mode == Q_OFF:
            qhat = qeff = operand(x, model)
        else:
            c1, s1 = formats.quantize_blocks(x, f.lsq)
            q1 = _fold(c1, s1)
            if f.q_terms == 1:
                qhat = qeff = q1
                qc, qs = [c1], [s1]
            else:
                c2, s2 = formats.quantize_blocks(x - q1, f.lsq)
                qsum = q1 + _fold(c2, s2)  # exact in binary32 (§5.3)
                qhat, qc, qs = operand(qsum, model), [c1, c2], [s1, s2]
                qeff = qsum if model == SM120 else qhat  # what the score chain multiplies (§5.7)
            if model == SM120:
                fp4.update(q_codes=np.stack(qc), q_scales=np.stack(qs))
    qstat = np.stack([nrm(qeff), nrm(x - qeff), nrm(q16)], axis=-1)
    return qhat.astype(F32), qr[..., 0] * kg[:, None], row_shift(q16, kmean, f) * qmul, qstat


def row_shift(q16: np.ndarray, kmean: np.ndarray, flags: PrepFlags) -> np.ndarray:
    """§5.3's q·k̄ per packed row (before ⊗ qmul): sequential over channels, or under ``p2_shift="lanes"``
    the seed's four lane sums of channel pairs (each pair fused under ``fma``), added in pairs."""
    km = np.broadcast_to(kmean[:, None], q16.shape)
    if not flags.p2_lanes:
        sh = np.zeros(q16.shape[:2], F32)
        for c in range(q16.shape[2]):
            sh = sh + q16[:, :, c] * km[:, :, c]
        return sh
    lanes = np.zeros((4, *q16.shape[:2]), F32)
    for k16 in range(0, q16.shape[2], 16):
        for h in (0, 8):
            for t0 in range(4):
                c = k16 + h + 2 * t0
                right = q16[:, :, c + 1] * km[:, :, c + 1]
                if flags.fma:
                    pair = fma32_arrays(np.ascontiguousarray(q16[:, :, c]), np.ascontiguousarray(km[:, :, c]), right)
                else:
                    pair = q16[:, :, c] * km[:, :, c] + right
                lanes[t0] = lanes[t0] + pair
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])


def _pass1_operand(x: np.ndarray, quant: bool, flags: Flags, fp4: dict, codes_name: str, scales_name: str):
    """A pass-1 K or V image: quant16 per 16 values of the last axis, folded to values (§4.4–4.5; `sm120`
    keeps the codes and scales too), or the unquantized operand (§5.6)."""
    if not quant:
        return np.ascontiguousarray(operand(x, flags.model.model), dtype=F32)
    codes, scales = formats.quantize_blocks(x, flags.prep.lsq)
    if flags.model.model == SM120:
        fp4.update({codes_name: codes, scales_name: scales})
    return _fold(codes, scales)


def prep_k(k16: np.ndarray, S: int, first_key: int, kmean: np.ndarray, kg: np.ndarray, flags: Flags, fp4: dict):
    """§5.4: K̂ [Hkv, T*64, d] of (K ⊖ kmean) ⊗ (1/kg), keys ≥ S zero; and §5.7's kn, ek, km, ekm [Hkv, 4]
    over the keys first_key .. S − 1."""
    xk = k16 - kmean[:, None]
    xk *= (F32(1) / kg)[:, None, None]
    xk[:, S:] = 0
    khat = _pass1_operand(xk, flags.prep.quant_k, flags, fp4, "k_codes", "k_scales")
    seen = slice(first_key, S)
    n0, n1 = nrm(khat[:, seen]), nrm(xk[:, seen] - khat[:, seen])
    return khat, np.stack([n0.max(axis=1), n1.max(axis=1), norm_mean(n0), norm_mean(n1)], axis=-1)


def prep_v(v16_t: np.ndarray, vg: np.ndarray, flags: Flags, fp4: dict) -> np.ndarray:
    """§5.5: V̂ᵀ [Hkv, T, d, 64] of V ⊗ (1/vg) per tile (rounded to FP16 under ``v_f16``), keys in
    slot order (§7.3)."""
    xv_t = v16_t[..., slot_map(flags.prep.interleaved)]
    xv_t *= (F32(1) / vg)[:, None, None, None]
    if flags.prep.v_f16:
        xv_t = _f16(xv_t)
    return _pass1_operand(xv_t, flags.prep.quant_v, flags, fp4, "v_codes_t", "v_scales_t")


def v_stats(v: np.ndarray, vhat_t: np.ndarray, vg: np.ndarray, interleaved: bool, first_key: int) -> np.ndarray:
    """§5.7's vn, ev, vm, evm [Hkv, 4] over the keys first_key .. S − 1, from the FP16 values v [S, Hkv, d]
    and V̂ᵀ in slot order (the means of the norms over vg, ⊗ vg: exact, vg being a power of two)."""
    S, Hkv, d = v.shape
    Hk, T = vhat_t.shape[:2]
    vhat = np.empty_like(vhat_t)
    vhat[..., slot_map(interleaved)] = vhat_t  # back to key order
    vh = (vhat.transpose(0, 1, 3, 2).reshape(Hk, T * TILE, d)[:, first_key:S] * vg[:, None, None])  # exact: 2^k
    v32 = v[first_key:].astype(F32).transpose(1, 0, 2)
    n3, n4 = nrm(v32), nrm(v32 - vh)
    inv = (F32(1) / vg)[:, None]
    return np.stack([n3.max(axis=1), n4.max(axis=1), norm_mean(n3 * inv) * vg, norm_mean(n4 * inv) * vg], axis=-1)


def value_weights(v: np.ndarray, vg: np.ndarray, interleaved: bool, first_key: int, T: int) -> np.ndarray:
    """§5.8's ν [Hkv, T, 64] in slot order: f16(nrm(v) ⊗ (1 ⊘ vg)) for the keys first_key .. S − 1, else
    +0 (the output hot test's weights)."""
    S, Hkv, _ = v.shape
    nu = np.zeros((Hkv, T * TILE), F32)
    nu[:, first_key:S] = _f16(nrm(v[first_key:].astype(F32).transpose(1, 0, 2)) * (F32(1) / vg)[:, None])
    return np.ascontiguousarray(nu.reshape(Hkv, T, TILE)[..., slot_map(interleaved)])


def prep_bytes(S: int, d: int) -> int:
    """Bytes prep holds for one KV head of S keys: K and Vᵀ widened to binary32 for pass 2, the two
    pass-1 images, and the codes of the operand being quantized (measured peak: about 15 per key
    and channel, against 4 for the FP16 K and V themselves)."""
    return cdiv(S, TILE) * TILE * d * (4 * 4 + 1)


def prepare(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_offset: int, cfg: Config, first_key: int = 0,
            stats=None) -> Prepared:
    """``prepare_lowered`` under ``cfg``, its flags and qmul taken here: for a caller that holds a
    Config (a run lowers it once for all its heads)."""
    return prepare_lowered(q, k, v, q_offset, cfg.flags(), cfg.qmul(q.shape[2]), first_key, stats)


def prepare_lowered(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_offset: int, flags: Flags, qmul: np.float32,
                    first_key: int = 0, stats=None) -> Prepared:
    """Prep (§5) for one batch entry under a Config's lowered ``flags`` (Config.flags) and §5.3's
    ``qmul`` (Config.qmul), as the kernel's prep takes them. q [n, H, d], k and v [S, Hkv, d], all
    float16, already validated. ``first_key``: lo₀, the first key any row sees (§5.5; 0 without a
    window): the key statistics of §5.7 start there. (The images below its tile are formed here all
    the same: nothing reads them.) ``stats``: (kmean [Hkv, d], kg [Hkv], vg [Hkv]) of a frozen chunk
    (§5.9) instead of §5.1–5.2's."""
    n, H, d = q.shape
    S, Hkv, _ = k.shape
    T = cdiv(S, TILE)
    kmean, kg, vg = prep_stats(k, v) if stats is None else stats
    # pass 2's operands, built straight in their layouts: K [Hkv, T*64, d], Vᵀ per tile [Hkv, T, d, 64]
    k16 = np.zeros((Hkv, T * TILE, d), F32)
    k16[:, :S] = k.transpose(1, 0, 2)
    v16_t = np.zeros((Hkv, T, d, TILE), F32)
    for t in range(T):  # tile by tile, so no full-size temporary of V
        keys = v[TILE * t:TILE * (t + 1)]
        v16_t[:, t, :, :keys.shape[0]] = keys.transpose(1, 2, 0)
    fp4 = {}  # sm120 only: the codes and scales its MMA multiplies (§3.2)
    q16 = pack_rows(q.astype(F32), Hkv)  # [Hkv, R, d]
    qhat, cq, sh, qstat = prep_q(q16, kmean, kg, qmul, flags, fp4)
    khat, ks = prep_k(k16, S, first_key, kmean, kg, flags, fp4)
    vhat_t = prep_v(v16_t, vg, flags, fp4)
    vs = v_stats(v, vhat_t, vg, flags.prep.interleaved, first_key)
    kvstat = np.concatenate([ks[:, :2], nrm(k16[:, first_key:S]).max(axis=1)[:, None], vs[:, :2], ks[:, 2:],
                             vs[:, 2:]], axis=-1).astype(F32)
    return Prepared(
        d=d, G=H // Hkv, n=n, S=S, q_offset=q_offset, qmul=qmul, kmean=kmean, kg=kg, vg=vg,
        q16=q16, qhat=qhat, cq=cq, sh=sh, khat=khat, vhat_t=vhat_t,
        k16=k16, v16_t=v16_t, qstat=qstat, kvstat=kvstat,
        nu_t=value_weights(v, vg, flags.prep.interleaved, first_key, T) if flags.pass1.output else None, **fp4,
    )
