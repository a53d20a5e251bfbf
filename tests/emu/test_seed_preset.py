"""The seed's toggles of numerics.md §12 (#5 sampled K statistics, #7 voting padding rows, #9 the per-lane
pass-2 shift, #11 the direct store): each one pinned by a probe whose expected value is worked out by
hand, and the seed's summation orders against independent re-implementations that follow the seed's
threads and shuffles (``../shared/research/apa_numerics.md`` §3.1 and §5.2) rather than the emulator's
vectorised forms."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from helpers import f32_exact_rne

from apa_emu import Config, attention
from apa_emu.merge import merge
from apa_emu.fpmath import ex2_tables
from apa_emu.pass1 import P1Mode, P1Out, P1State, p1_export
from apa_emu.prep import call_stats, kmean_exact, prep_stats, row_shift, sampled_stats

F32 = np.float32


def _seed_stats_block(k: np.ndarray, s0: int, s1: int) -> np.ndarray:
    """The seed's stats block for one chunk, thread by thread (d = 128, 256 threads): thread t sums the
    keys s0 + t div 8 + 32i of channels 16·(t mod 8) .. +15 from 0, then each warp adds lane xor 8, then
    lane xor 16; the block adds the 8 warps from 0."""
    acc = np.zeros((256, 16), F32)
    for t in range(256):
        g = t % 8
        s = s0 + t // 8
        while s < s1:
            acc[t] = acc[t] + k[s, 16 * g:16 * g + 16].astype(F32)
            s += 32
    for xor in (8, 16):
        acc = np.stack([acc[t] + acc[(t // 32) * 32 + ((t % 32) ^ xor)] for t in range(256)])
    out = np.zeros(128, F32)
    for w in range(8):
        for g in range(8):  # lane g of warp w holds channel group g (its lanes g + 8, 16, 24 the same sum)
            out[16 * g:16 * g + 16] = out[16 * g:16 * g + 16] + acc[32 * w + g]
    return out


def _seed_kmean(k: np.ndarray, stride: int) -> np.ndarray:
    """The seed's finalize: chunk sums in chunk order from 0, then ⊘ n."""
    S = k.shape[0]
    total, n = np.zeros(128, F32), 0
    for s0 in range(0, S, 1024 * stride):
        s1 = min(s0 + 1024, S)
        total = total + _seed_stats_block(k, s0, s1)
        n += s1 - s0
    return total / F32(n)


@pytest.mark.parametrize("S,stride", [(1000, 1), (3000, 1), (5000, 2)])
def test_sampled_kmean_follows_the_seeds_threads(S, stride):
    """§5.10 against the thread-by-thread seed: keys spanning 2⁻¹⁴ .. 2¹³ make binary32 sums round, so
    the order shows; the result must also differ from the exact mean of §5.1 somewhere."""
    rng = np.random.default_rng(S)
    k = (rng.standard_normal((S, 1, 128)) * 2.0 ** rng.integers(-14, 12, (S, 1, 128))).astype(np.float16)
    v = np.ones_like(k)
    kmean = sampled_stats(k, v, stride)[0][0]
    want = _seed_kmean(k[:, 0], stride)
    assert np.array_equal(kmean.view(np.uint32), want.view(np.uint32))
    assert (kmean != kmean_exact(k)[0]).any()


def test_sampled_kmean_rounds_where_the_exact_mean_does_not():
    """§5.10 by hand: 1024 keys, channel 0 holds 2048 at key 0 and 2⁻¹⁴ at keys 32, 64, …, 992 (key row
    0 of the seed's block, summed sequentially). Each 2⁻¹⁴ is below half an ulp of 2048 (2⁻¹³), so the
    binary32 sum stays 2048 and kmean = 2048 ⊘ 1024 = 2. The exact mean is 2 + 31·2⁻²⁴, which rounds to
    2 + 8·2⁻²² = 2 + 2⁻¹⁹ (31/4 = 7.75 ulps of 2⁻²²)."""
    k = np.zeros((1024, 1, 64), np.float16)
    k[0, 0, 0] = 2048
    k[32::32, 0, 0] = 2.0**-14
    v = np.ones_like(k)
    assert float(sampled_stats(k, v, 1)[0][0, 0]) == 2.0
    assert float(prep_stats(k, v)[0][0, 0]) == 2 + 2.0**-19


def _one_spike(S: int, at: int, value: float) -> tuple[np.ndarray, np.ndarray]:
    k = np.zeros((1, S, 1, 64), np.float16)
    k[0, 0, 0, 0] = 1
    k[0, at, 0, 0] = value
    return k, np.ones_like(k)


@pytest.mark.parametrize("value,kg,why", [
    (3.0, 2.0**-9, "missed: 3 ⊗ 512 = 1536 fits under 2688, no redo"),
    (6.0, 2.0**-6, "missed, then 6 ⊗ 512 = 3072 overflows: the redo takes every key"),
])
def test_sampling_misses_a_key_and_the_redo_catches_an_overflow(value, kg, why):
    """§5.10 by hand at S = 32768: nchunk = 32, stride 2, so keys 1024..2047 are never sampled. Keys are
    0 except channel 0 of key 0 (1) and of key 1500 (``value``). Sampled: amaxK = 1, mk = 1 ⊘ 16384 =
    2⁻¹⁴, kg = up2(4·(1 + 2⁻¹⁴)/2688) = up2(0.00149) = 2⁻⁹. Redone over all keys: mk = 7 ⊘ 32768,
    kg = up2(4·(6 + mk)/2688) = up2(0.00893) = 2⁻⁶. (Exact statistics would give up2(4·3/2688) = 2⁻⁷ for
    the first.)"""
    k, v = _one_spike(32768, 1500, value)
    assert float(call_stats(k, v, False).kg[0, 0]) == kg, why


def test_the_redo_is_one_decision_for_the_call():
    """§5.10: one overflowing batch entry sends every (b, hk) back to stride 1, the quiet one included."""
    k, v = _one_spike(32768, 1500, 6.0)
    quiet, _ = _one_spike(32768, 1500, 3.0)
    kb, vb = np.concatenate([quiet, k]), np.concatenate([v, v])
    assert float(call_stats(quiet, v, False).kg[0, 0]) == 2.0**-9
    assert float(call_stats(kb, vb, False).kg[0, 0]) == 2.0**-7  # the quiet entry, now over all keys


def test_sampled_statistics_reach_the_call():
    """``k_stats="sampled"`` through ``attention``: the first case above, with one query row."""
    k, v = _one_spike(32768, 1500, 3.0)
    q = np.zeros((1, 1, 64), np.float16)
    q[0, 0, 0] = 1
    res = {s: attention(q, k[0], v[0], 32767, Config(k_stats=s)) for s in ("exact", "sampled")}
    assert [r.meta["head_scales"][0, 0][0] for r in res.values()] == [2.0**-7, 2.0**-9]


def _seed_lane_shift(q: np.ndarray, kmean: np.ndarray, fused: bool) -> np.float32:
    """The seed's pass-2 row shift for d = 128 (apa_numerics.md §5.2), lane by lane: channels
    c = 16k + 8h + 2·t0 for k = 0..7, h = 0..1; t = fma(q_c, k̄_c, q_{c+1}·k̄_{c+1}); then the xor-1 and
    xor-2 shuffles. The fma is exact rational arithmetic rounded once."""
    sh = [F32(0)] * 4
    for t0 in range(4):
        for k in range(8):
            for h in range(2):
                c = 16 * k + 8 * h + 2 * t0
                right = F32(q[c + 1]) * F32(kmean[c + 1])
                if fused:
                    t = f32_exact_rne(Fraction(float(q[c])) * Fraction(float(kmean[c])) + Fraction(float(right)))
                else:
                    t = F32(q[c]) * F32(kmean[c]) + right
                sh[t0] = sh[t0] + t
    after1 = [sh[t] + sh[t ^ 1] for t in range(4)]
    after2 = [after1[t] + after1[t ^ 2] for t in range(4)]
    assert len({float(x) for x in after2}) == 1  # every lane holds the same value
    return after2[0]


@pytest.mark.parametrize("fma", [False, True])
def test_lane_shift_follows_the_seeds_lanes(fma):
    """§5.3 ``p2_shift="lanes"`` against the lane-by-lane seed on rows whose products round, and it must
    differ from the sequential shift on some row."""
    rng = np.random.default_rng(7)
    q16 = (rng.standard_normal((1, 40, 128)) * 4).astype(np.float16).astype(F32)
    kmean = (rng.standard_normal((1, 128)) * 2.0 ** rng.integers(-8, 8, (1, 128))).astype(F32)
    cfg = Config(p2_shift="lanes", fma=fma)
    got = row_shift(q16, kmean, cfg.prep_flags())[0]
    want = np.array([_seed_lane_shift(q16[0, r], kmean[0], fma) for r in range(40)], F32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert (got != row_shift(q16, kmean, Config().prep_flags())[0]).any()


def test_lane_shift_by_hand():
    """§5.3 with q = 1 everywhere: kmean₀ = 2²⁴ (lane 0), kmean₄ = kmean₆ = 1 (lanes 2 and 3).
    Sequential: 2²⁴ ⊕ 1 is a tie and stays 2²⁴ (even), twice: sh = 2²⁴. Lanes: (2²⁴ ⊕ 0) ⊕ (1 ⊕ 1) = 2²⁴ + 2.
    Fused pair, with q₀ = 1 + 2⁻¹⁰, kmean₀ = 1 + 2⁻¹⁴, kmean₁ = 2⁻²⁴: the product 1 + 2⁻¹⁰ + 2⁻¹⁴ + 2⁻²⁴
    rounds (a tie, to even) to 1 + 2⁻¹⁰ + 2⁻¹⁴, and adding 2⁻²⁴ ties again: 1 + 2⁻¹⁰ + 2⁻¹⁴ unfused;
    fused, 1 + 2⁻¹⁰ + 2⁻¹⁴ + 2⁻²³ is exact."""
    q = np.ones((1, 1, 64), F32)
    km = np.zeros((1, 64), F32)
    km[0, 0], km[0, 4], km[0, 6] = 2.0**24, 1, 1
    assert float(row_shift(q, km, Config().prep_flags())[0, 0]) == 2.0**24
    assert float(row_shift(q, km, Config(p2_shift="lanes").prep_flags())[0, 0]) == 2.0**24 + 2
    q[0, 0, 0] = 1 + 2.0**-10
    km[:] = 0
    km[0, 0], km[0, 1] = 1 + 2.0**-14, 2.0**-24
    for fma, want in ((False, 1 + 2.0**-10 + 2.0**-14), (True, 1 + 2.0**-10 + 2.0**-14 + 2.0**-23)):
        assert float(row_shift(q, km, Config(p2_shift="lanes", fma=fma).prep_flags())[0, 0]) == want


def _pad_vote_problem():
    """One query row at position 128 of 256 keys (G = 1): its warp has 15 padding rows, and padding row r
    would see keys 0 .. 128 + r. q = 4 in channel 0 and the softmax scale 1/8, so k₀ = 16 scores +8 and
    k₀ = −16 scores −8 (natural-log units): keys 0..63 and 128 score 0, keys 64..127 score −8, keys
    129..143 score +8."""
    q = np.zeros((1, 1, 64), np.float16)
    q[0, 0, 0] = 4
    k = np.zeros((256, 1, 64), np.float16)
    k[64:128, 0, 0] = -16
    k[129:144, 0, 0] = 16
    v = np.random.default_rng(0).standard_normal((256, 1, 64)).astype(np.float16)
    return q, k, v, 128


def test_padding_rows_vote_a_tile_hot():
    """§6.2 ``pad_vote`` by hand at ε = 0.05, visiting tiles 0, 2, 1 (§6.4). Tile 0 is hot (the first
    tile always is). Row 0 alone: tile 2 holds one visible key of score 0 against la ≈ 64 such keys,
    a share of 1/65 < ε, so it is cold; tile 1's keys sit e⁻⁸ below: cold. With the padding rows voting,
    their keys 129..143 in tile 2 carry e⁸ times the mass of tile 0's: hot. Only the mask moves; row 0's
    own key ranges are the same."""
    q, k, v, off = _pad_vote_problem()
    masks = {}
    for vote in (False, True):
        res = attention(q, k, v, off, Config(eps=0.05, pad_vote=vote))
        masks[vote] = int(res.hot[0, 0, 0, 0])
    assert masks == {False: 0b001, True: 0b101}


def test_padding_rows_change_nothing_bottom_right():
    """§6.2: with q_offset = S − n every padding row sees what row R − 1 sees (lim = S − 1) with its Q, so
    its votes repeat that row's: ``pad_vote`` changes no bit (the seed's bench and our dumps are all
    bottom-right)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((m, 2, 64)).astype(np.float16) for m in (5, 300, 300))
    a, b = (attention(q, k, v, 295, Config(eps=0.02, pad_vote=x), trace="all") for x in (False, True))
    assert np.array_equal(a.out.view(np.uint16), b.out.view(np.uint16)) and np.array_equal(a.hot, b.hot)
    assert a.visits.tobytes() == b.visits.tobytes()


def test_direct_store_by_hand():
    """§9.5 ``direct_store`` in the export (part, stored as f16(part)): lc = 7, vg = 1 and
    o = 7·(1 + 2⁻¹¹) + 2⁻²¹ (one ulp above).
    vg ⊘ 7 = RN(1/7) = (1/7)(1 + 2⁻²⁴·…); o ⊗ RN(1/7) = 1 + 2⁻¹¹ + 2⁻²³, just above the FP16 tie
    1 + 2⁻¹¹, so the store is 1 + 2⁻¹⁰. The merge forms part = o ⊗ (vg ⊗ Kf) and 1 ⊘ (lc ⊗ Kf) and lands
    on the tie itself, 1 + 2⁻¹¹, which rounds to the even 1."""
    d = 1
    o = F32(7 * (1 + 2.0**-11) + 2.0**-21)
    assert np.nextafter(F32(7 * (1 + 2.0**-11)), F32(8)) == o
    Kf = Config().pass1_consts().Kf
    st = P1State(np.zeros(16, F32), np.zeros(16, F32), np.full(16, F32(7)), np.zeros(16, F32),
                 np.full((16, d), o), np.zeros(16, F32), np.zeros(16, F32))
    exported = {}
    for direct in (True, False):
        out = P1Out.new(d, 1)
        mode = P1Mode(0, *ex2_tables(True), False, True, np.arange(64), F32(1) * Kf, False, False, direct, F32(1))
        p1_export(st, np.ones(16, bool), mode, Kf, out)
        exported[direct] = out
    assert float(exported[True].part[0, 0]) == 1 + 2.0**-11 + 2.0**-23
    assert float(np.float16(exported[True].part[0, 0])) == 1 + 2.0**-10
    out = exported[False]
    merged = merge(out.m1, out.l1, out.part, np.full(16, -np.inf, F32), np.zeros(16, F32), np.zeros((16, d), F32),
                   True)
    assert float(merged[0, 0]) == 1.0


def test_direct_store_of_a_zero_cold_sum_is_ieee():
    """lc = +0 (every cold P̂ of the row rounded to zero: scores past the FP16 range) under the direct store:
    vg ⊘ lc = +inf, so o = 0 exports NaN and o = −3 exports −inf, as the kernel's division does; the
    emulator once raised ZeroDivisionError here (found by the preset's gpu property on the H200)."""
    Kf = Config().pass1_consts().Kf
    st = P1State(np.zeros(16, F32), np.zeros(16, F32), np.zeros(16, F32), np.zeros(16, F32),
                 np.zeros((16, 2), F32), np.zeros(16, F32), np.zeros(16, F32))
    st.o[:, 1] = -3
    out = P1Out.new(2, 1)
    p1_export(st, np.ones(16, bool), P1Mode(0, *ex2_tables(True), False, True, np.arange(64), F32(1) * Kf, False, False, True,
                                            F32(1)), Kf, out)
    assert np.isnan(out.part[:, 0]).all() and (out.part[:, 1] == -np.inf).all() and (out.l1 == 0).all()


def test_direct_store_only_without_hot_tiles():
    """``direct_store`` end to end: under pure FP4 (no tile hot) it moves some outputs by one FP16 ulp
    (the merge's extra rounding, §9.5); with hot tiles (ε = 0.05: tile 0 is hot in every warp) it
    changes no bit."""
    from apa_emu.strategies import make_inputs

    q, k, v = make_inputs(3, 1, 64, 2, 3, 64, 900, "sink", batched=False)
    for eps, moved in ((1e9, True), (0.05, False)):
        a, b = (attention(q, k, v, 900 - 64, Config(eps=eps, direct_store=x)) for x in (False, True))
        diff = np.abs(a.out.view(np.int16).astype(np.int32) - b.out.view(np.int16).astype(np.int32))
        assert bool(diff.any()) == moved and diff.max() <= 1


def test_seed_toggles_refused_by_the_kernel():
    """The kernel does not implement §12 #5: the launcher names it instead of running something else
    (checked without a GPU: ``check_config`` is host code). #7, #9 and #11 it runs."""
    from apa_gpu.plan import check_config

    with pytest.raises(NotImplementedError, match="k_stats='sampled'"):
        check_config(Config(k_stats="sampled"), 64)
    check_config(Config.seed(mma="sm90", k_stats="exact"), 64)
