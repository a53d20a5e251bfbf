"""Plant realistic bugs one at a time and check that the CPU test suite kills each (no GPU needed).

    python tools/mutants.py                 # every mutant, its tests, a table at the end
    python tools/mutants.py M04 K2          # some of them
    python tools/mutants.py --list

Each mutant is one textual replacement in one source file (the replaced text must occur exactly once,
so a refactor that moves it fails loudly instead of testing nothing). The file is restored after each
run, also on Ctrl-C or SIGTERM. It edits the checkout it lives in: run it in a worktree of its own
(`git worktree add /tmp/mut HEAD`) when you keep working beside it. Emulator edits need no cache clearing: the Numba cache is keyed on the sources
(apa_emu/__init__.py), and kernel edits change the simulator build's key (apa_gpu/build.py).
The set is the test audit's (shared/research/reviews/test-audit.md §5): M01–M20 in the emulator,
K1–K6 in the kernel. (M14 is equivalent inside `attention`, which packs one KV head at a time; a
direct test of the packing kills it.) M42–M53 and K34–K36 are the survivors of
shared/research/reviews/mutants-2026-12b.md, each with a test written to kill it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
ALG = ("tests/emu/test_algorithm.py", "tests/kernel/test_gpu_sim.py", "tests/study/test_cli.py")
FMT = ("tests/emu/test_formats.py", "tests/emu/test_fpmath.py", "tests/kernel/test_thresholds.py")
SIM = ("tests/kernel/test_gpu_sim.py", "tests/kernel/test_thresholds.py")
# One rounding of the fma sites seldom reaches a whole problem's output bits: the probes on chosen operands.
FMA_PROBES = ("tests/kernel/test_gpu_sim.py::test_fma_site_probes_on_simulator",)
# The budget test's two sides are not traced: its vote and βr on operands at the edge.
BUDGET_PROBES = ("tests/kernel/test_gpu_sim.py::test_budget_probes_on_simulator",)


class Mutant(NamedTuple):
    id: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...] = ALG


MUTANTS = [
    Mutant("M01", "E2M1 RNE → round half up", "apa_emu/formats.py",
           "    if ax <= _T025:\n        m = 0", "    if ax < _T025:\n        m = 0", FMT + ALG),
    Mutant("M02", "quant16 search drops the last candidate", "apa_emu/formats.py",
           "        for k in range(8):\n            c = c0", "        for k in range(7):\n            c = c0", FMT + ALG),
    Mutant("M03", "τ vote uses τ + 1", "apa_emu/pass1.py",
           "mx[r] > m[r] + tau:", "mx[r] > m[r] + tau + np.float32(1):"),
    Mutant("M04", "hot test > → >=", "apa_emu/pass1.py",
           "if x > eps * (fma32(run, a, x) if mode.fma else run * a + x):",
           "if x >= eps * (fma32(run, a, x) if mode.fma else run * a + x):"),
    Mutant("M05", "δ with the wrong sign", "apa_emu/pass1.py", "c[r] - k.delta", "c[r] + k.delta"),
    Mutant("M06", "merge: cold part not rescaled (w1 = 1)", "apa_emu/merge.py",
           "w1, w2 = _weight(l1, m1, big, soft), _weight(l2, m2, big, soft)",
           "w1, w2 = np.where(l1 > 0, F32(1), F32(0)), _weight(l2, m2, big, soft)"),
    Mutant("M07", "UE4M3 P-scale mantissa floor instead of ceil", "apa_emu/pass1.py",
           "int(np.ceil((e - np.float32(1)) * np.float32(8)))", "int(np.floor((e - np.float32(1)) * np.float32(8)))"),
    Mutant("M08", "pass-2 l2 summed sequentially", "apa_emu/pass2.py",
           "(l4[r, 0] + l4[r, 1]) + (l4[r, 2] + l4[r, 3])", "((l4[r, 0] + l4[r, 1]) + l4[r, 2]) + l4[r, 3]"),
    Mutant("M09", "f16r flushes FP16 subnormals", "apa_emu/fpmath.py",
           "    if ax < _F16_MIN_NORMAL:\n        quantum = 2.0**-24",
           "    if ax < _F16_MIN_NORMAL:\n        return np.float32(math.copysign(0.0, xd))", FMT + ALG),
    Mutant("M10", "two-term Q: f16(Q1 + Q2) dropped", "apa_emu/prep.py",
           "qhat, qc, qs = operand(qsum, model), [c1, c2], [s1, s2]", "qhat, qc, qs = qsum, [c1, c2], [s1, s2]"),
    Mutant("M11", "exp2s C6 + 1 ulp", "apa_emu/fpmath.py", "0x39212C6C]", "0x39212C6D]", FMT + ALG),
    Mutant("M12", "diagonal order reversed", "apa_emu/geometry.py",
           "return np.array([*sink, *range(last_tile, max(first_tile, 1) - 1, -1)], dtype=np.int64)",
           "return np.arange(first_tile, last_tile + 1, dtype=np.int64)"),
    Mutant("M13", "GQA row position off by one", "apa_emu/geometry.py",
           "return np.minimum(self.q_offset + r // self.G, self.S - 1)",
           "return np.minimum(self.q_offset + (r + 1) // self.G, self.S - 1)"),
    Mutant("M14", "pack_rows head map g·Hkv + hk", "apa_emu/prep.py",
           "q.reshape(n, Hkv, G, d).transpose(1, 0, 2, 3)", "q.reshape(n, G, Hkv, d).transpose(2, 0, 1, 3)"),
    Mutant("M15", "pass-2 FP16 O rescaled by a, not f16(a)", "apa_emu/pass2.py", "ah = f16r(a)", "ah = a"),
    Mutant("M16", "K mean by a float32 mean", "apa_emu/prep.py",
           "    kmean = kmean_exact(k)  # [Hkv, d]", "    kmean = k.astype(F32).mean(axis=0)"),
    Mutant("M17", "interleaved P groups: t div 8", "apa_emu/prep.py",
           "g = 2 * (t // 32) + (t // 4) % 2", "g = 2 * (t // 32) + (t // 8) % 2"),
    Mutant("M18", "pow2 P scale: bias by floor(u)", "apa_emu/pass1.py",
           "kb, bias = 8 * (int(cu) + 7), (k.L - c) - cu", "kb, bias = 8 * (int(cu) + 7), (k.L - c) - fl"),
    Mutant("M19", "GQA: KV head hk gets query heads hk, hk + Hkv, …", "apa_emu/api.py",
           "heads = slice(hk * G, (hk + 1) * G)", "heads = slice(hk, None, shape.Hkv)"),
    Mutant("M20", "sm120 row-sum ones with scale 0x30", "apa_emu/pass1.py",
           "np.uint8(2), np.uint8(0x38)", "np.uint8(2), np.uint8(0x30)"),
    Mutant("M21", "certificate without the hidden E2M1 mass 4·AD", "apa_emu/merge.py",
           "(lcu * F32(0.25) + (ad * F32(4)) * (ONE + a1))", "(lcu * F32(0.25))", ("tests/emu/test_certificate.py",)),
    Mutant("M22", "certificate: pass 2's FP16 score chain bound (d/16)·2⁻²⁰", "apa_emu/constants.py",
           "cs = d // 16 * ((2.0**-11 if f16_scores else 0.0) + 2.0**-20)", "cs = d // 16 * 2.0**-20",
           ("tests/emu/test_certificate.py",)),
    Mutant("K1", "kernel P' threshold T3 + 1 ulp", "cuda/formats.cuh",
           "#define APA_E2M1_EXP2S_T3 0x3F4EAECEu", "#define APA_E2M1_EXP2S_T3 0x3F4EAECFu", SIM),
    Mutant("K2", "kernel hot test > → >=", "cuda/pass1.cuh",
           "wr.run_lo & (x_lo > fmul(", "wr.run_lo & (x_lo >= fmul(", SIM),
    Mutant("K3", "kernel merge denominator drops w2", "cuda/merge.cuh",
           "const float den = fadd(fmul(w1, l1), fmul(w2, l2));", "const float den = fmul(w1, l1);", SIM),
    Mutant("K4", "kernel pass-2 row sum (l4 + p0) + p1", "cuda/pass2.cuh",
           "st.l4_lo = fadd(st.l4_lo, fadd(p0, p1));", "st.l4_lo = fadd(fadd(st.l4_lo, p0), p1);", SIM),
    Mutant("K5", "kernel merge: cold part not rescaled (w1 = 1)", "cuda/merge.cuh",
           "(l1 > 0.0f) ? exp2x(fsub(m1, M)) : 0.0f", "(l1 > 0.0f) ? 1.0f : 0.0f", SIM),
    Mutant("K6", "kernel P-scale exponent fused (the seed's fmaf)", "cuda/pass1.cuh",
           "madd(gm[h], cq[h], fsub(a.A, c[h]), a.fma)", "madd(gm[h], cq[h], fsub(a.A, c[h]), true)",
           SIM),
    Mutant("K7", "kernel pass 1: ad not rescaled when the frame moves", "cuda/pass1.cuh",
           "        r.ad = fmul(r.ad, alpha);\n", "", SIM),
    Mutant("M23", "window: the first visible key one late in pass 2", "apa_emu/pass2.py",
           "if rows.lo[r] <= k0 + j <= rows.lim[r]:", "if rows.lo[r] < k0 + j <= rows.lim[r]:",
           ("tests/emu/test_window.py",)),
    Mutant("M24", "output hot test: lv not rescaled when the frame moves", "apa_emu/pass1.py",
           "            st.lv[r] = st.lv[r] * alpha\n", "", ("tests/emu/test_hot_test.py",)),
    Mutant("K9", "kernel output hot test: ν in the even columns of the row-sum MMA", "cuda/pass1_cta.cuh",
           "a.output && (wr.g & 1);", "a.output && !(wr.g & 1);", SIM),
    Mutant("M25", "paged KV: a hole reads its page-0 row instead of zeros", "apa_emu/paging.py",
           "    out[page < 0] = 0\n", "", ("tests/emu/test_paging.py",)),
    Mutant("K10", "kernel paged KV: a hole reads page 0", "cuda/common.cuh",
           "return page < 0 ? -1 : (((long long)page", "return page < 0 ? 0 : (((long long)page", SIM),
    Mutant("M26", "update: o rescaled without ⊕ +0 (an underflowed −0 stays)", "apa_emu/pass1.py",
           "st.o[r, ch] * alpha + np.float32(0)", "st.o[r, ch] * alpha"),
    Mutant("M27", "varlen: sequences top-left causal (q_offset 0)", "apa_emu/varlen.py",
           "q_offset=int(S - n), window=window)", "q_offset=0, window=window)", ("tests/emu/test_varlen.py",)),
    Mutant("K11", "kernel varlen: pass 1 strides part by the sequence's own rows, not the buffer's", "cuda/pass1.cuh",
           "        float* prow = a.part + (bh * geo.Rp_buf", "        float* prow = a.part + (bh * geo.Rp", SIM),
    Mutant("M28", "KV state: the growth restat at 8·S > 9·slen instead of ≥", "apa_emu/kvstate.py",
           "    elif 8 * S >= 9 * state.stats_length:", "    elif 8 * S > 9 * state.stats_length:",
           ("tests/emu/test_kvstate.py",)),
    Mutant("M29", "KV state: a frozen chunk computes its own statistics", "apa_emu/api.py",
           "stats=None if frozen is None else tuple(x[b, hk:hk + 1] for x in frozen))", "stats=None)",
           ("tests/emu/test_kvstate.py",)),
    Mutant("K12", "kernel launcher, KV state: a frozen chunk's statistics never reach the device", "apa_gpu/plan.py",
           "            self.kmean[...] = xp.asarray(stats.kmean)\n", "", SIM),
    Mutant("K13", "kernel launcher, KV state: a frozen chunk keeps the partial last tile instead of re-forming it",
           "apa_gpu/api.py", "min(images.held, state.length // TILE)", "min(images.held + 1, state.length // TILE + 1)",
           SIM),
    Mutant("M30", "v_f16: V ⊗ (1/vg) not rounded to FP16", "apa_emu/prep.py",
           "    if flags.prep.v_f16:\n        xv_t = _f16(xv_t)\n", "", ("tests/emu/test_algorithm.py",)),
    Mutant("K14", "kernel bounded schedule: a warp resumes a segment without its carried lc", "cuda/pass1_cta.cuh",
           "m = c[0], x.la = c[1], x.lc = c[2],", "m = c[0], x.la = c[1],", SIM),
    Mutant("K15", "kernel bounded schedule: the sink tile's step left out of the run that holds T_max",
           "cuda/common.cuh", "    if (F == 0 && lo <= Tmax && Tmax < hi) i0 = 0, i1 = max(i1, 1);\n", "", SIM),
    Mutant("M31", "fma: the P-scale exponent u unfused (the seed's fmaf dropped)", "apa_emu/pass1.py",
           "u0 = fma32(gm, cq, k.A - c) if mode.fma else", "u0 = gm * cq + (k.A - c) if mode.fma else",
           ("tests/emu/test_algorithm.py",)),
    Mutant("K16", "kernel fma: the P-scale exponent u unfused", "cuda/pass1.cuh",
           "madd(gm[h], cq[h], fsub(a.A, c[h]), a.fma)", "madd(gm[h], cq[h], fsub(a.A, c[h]), false)", FMA_PROBES),
    Mutant("K17", "kernel fma: the merge numerator unfused", "cuda/merge.cuh",
           "fmul(madd(mw.w1, part.x, fmul(mw.w2, o2a), fused), mw.inv)",
           "fmul(madd(mw.w1, part.x, fmul(mw.w2, o2a), false), mw.inv)", FMA_PROBES),
    Mutant("K18", "kernel p2_shift lanes: the four lane sums added in a chain, not in pairs", "cuda/prep.cuh",
           "s = fadd(fadd(ls[0], ls[1]), fadd(ls[2], ls[3]));", "s = fadd(fadd(fadd(ls[0], ls[1]), ls[2]), ls[3]);",
           SIM),
    Mutant("K19", "kernel pad_vote: padding rows get their key ranges but no vote", "cuda/pass1_cta.cuh",
           "        wr.run_lo = wr.run_hi = true;\n", "", SIM),
    Mutant("K20", "kernel direct_store: a warp stores directly whatever its hot mask", "cuda/pass1.cuh",
           "direct = any == 0;", "direct = true;", SIM),
    Mutant("K21", "kernel E2M1 grid rounding in binary16: C at least 2^8, not 2^9", "cuda/formats.cuh",
           "0x24002400u, 0x60006000u)", "0x24002400u, 0x5C005C00u)",
           ("tests/kernel/test_gpu_sim.py::test_quant16_probe_on_simulator",)),
    Mutant("K22", "kernel prep_v stages each key's raw channels at half their offset", "cuda/prep.cuh",
           "raw_s + (16 * grp + i) * V_ROW + c0);", "raw_s + (16 * grp + i) * V_ROW + c0 / 2);", SIM),
    Mutant("K23", "kernel cold branch: the lo row rescaled by the hi row's a from the hot test", "cuda/pass1.cuh",
           "p1_cold_branch(v.c[0], v.a[0], v.tl[0]", "p1_cold_branch(v.c[0], v.a[1], v.tl[0]", SIM),
    Mutant("K24", "kernel output test: ν never loaded into the row-sum MMA's odd columns", "cuda/pass1.cuh",
           "if (nu_lane) {", "if (false && nu_lane) {", SIM),
    Mutant("K25", "kernel §7.4 a_g: exp2s(u0) as exp2s(x0)·2^floor(u0) at odd-floor ties too", "cuda/pass1.cuh",
           "u0[h] < 127.0f && !(x0 == 0.5f && ((int)f0 & 1));", "u0[h] < 127.0f;", FMA_PROBES),
    Mutant("K26", "kernel pass 2: the §8.1 mask skipped unless the tile passes both rows' limits", "cuda/pass2.cuh",
           "if (t * TILE + TILE - 1 > min(wr.lim_lo, wr.lim_hi) || t * TILE < max(wr.lo_lo, wr.lo_hi)) {\n#pragma unroll\n"
           "        for (int nt = 0; nt < 8; ++nt) {\n#pragma unroll\n            for (int e = 0; e < 2; ++e) {\n"
           "                const int key = t * TILE + 8 * nt + 2 * t0 + e;",
           "if (t * TILE + TILE - 1 > max(wr.lim_lo, wr.lim_hi) || t * TILE < min(wr.lo_lo, wr.lo_hi)) {\n#pragma unroll\n"
           "        for (int nt = 0; nt < 8; ++nt) {\n#pragma unroll\n            for (int e = 0; e < 2; ++e) {\n"
           "                const int key = t * TILE + 8 * nt + 2 * t0 + e;", SIM),
    Mutant("K27", "kernel exp2s_nonpos: x clamped to -126, not -127 (x < -126 gives 2^-126, not +0)", "cuda/fpmath.cuh",
           "exp2s_poly(fmaxf(x, -127.0f), ji);", "exp2s_poly(fmaxf(x, -126.0f), ji);", SIM),
    Mutant("K28", "kernel §7.4 dec(kb) from bits: mi one mantissa bit too low", "cuda/pass1.cuh",
           "+ ((uint32_t)mi << 20));", "+ ((uint32_t)mi << 19));", FMA_PROBES),
    Mutant("K29", "kernel pass 1 mask: the warp's loosest key limit, not its tightest", "cuda/pass1_cta.cuh",
           "const int lim_w = __reduce_min_sync(", "const int lim_w = __reduce_max_sync(", SIM),
    Mutant("K30", "kernel prep_k: ek from each odd channel's even neighbour in the image", "cuda/prep.cuh",
           "const float kh = f32h(i % 2 ? h2_hi(out[i / 2]) : h2_lo(out[i / 2]));",
           "const float kh = f32h(h2_lo(out[i / 2]));", SIM),
    Mutant("M32", "p2_shift lanes: the lane sums added in a chain", "apa_emu/prep.py",
           "return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])", "return ((lanes[0] + lanes[1]) + lanes[2]) + lanes[3]",
           ("tests/emu/test_seed_preset.py",)),
    Mutant("K8", "kernel window: the CTA order without its sink rule", "cuda/common.cuh",
           "    if (F == 0) return i == 0 ? 0 : Tmax + 1 - i;\n", "", SIM),
    Mutant("M33", "merge frame: a massless pass-1 state sets M (the seed's max(m1, m2))", "apa_emu/merge.py",
           "np.maximum(np.where(l1 > 0, m1, -np.inf), np.where(l2 > 0, m2, -np.inf))", "np.maximum(m1, m2)",
           ("tests/emu/test_merge_frame.py",)),
    Mutant("K31", "kernel merge frame: a massless pass-1 state sets M", "cuda/merge.cuh",
           "fmaxf(l1 > 0.0f ? m1 : neg_inf(), l2 > 0.0f ? m2 : neg_inf())", "fmaxf(m1, m2)", SIM),
    # mutants-2026-12's survivors: N7, F4 and S2 there.
    Mutant("M34", "§5.2 kg without its K-mean term", "apa_emu/prep.py",
           "kg = head_scale(amax(k) + np.abs(kmean).max(axis=1))", "kg = head_scale(amax(k))",
           ("tests/emu/test_spec_constants.py",)),
    Mutant("M35", "§9.7 C2 of an FP16 and a binary32 pass-2 output swapped", "apa_emu/constants.py",
           '{"f16": 2.0**-7, "f32": 2.0**-9,', '{"f16": 2.0**-9, "f32": 2.0**-7,',
           ("tests/emu/test_spec_constants.py",)),
    # err_est (§9.8)
    Mutant("M36", "§7.9 ws rescaled by α once, not α²", "apa_emu/pass1.py",
           "st.ws[r] = (st.ws[r] * alpha) * alpha", "st.ws[r] = st.ws[r] * alpha",
           ("tests/emu/test_err_est.py",) + SIM),
    Mutant("M37", "§7.8 ws also sums the hot tiles' P̂²", "apa_emu/pass1.py",
           "    else:\n        if not mode.budget:\n            p1_self_sums(mode.model, phat, rows.runs, t2)\n",
           "        p1_self_sums(mode.model, phat, rows.runs, t2)\n"
           "        for r in range(ROWS):\n            st.ws[r] = st.ws[r] + t2[r]\n    else:\n"
           "        if not mode.budget:\n            p1_self_sums(mode.model, phat, rows.runs, t2)\n",
           ("tests/emu/test_err_est.py",)),
    Mutant("M38", "§8.2 p4 not rescaled at a frame move", "apa_emu/pass2.py",
           "            p4[r, t0] = (p4[r, t0] * a) * a\n", "", ("tests/emu/test_err_est.py",)),
    Mutant("K33", "kernel §8.4: the pair's p² fmas in the other order", "cuda/pass2.cuh",
           "st.p4_lo = fma_sq(p1, fma_sq(p0, st.p4_lo));", "st.p4_lo = fma_sq(p0, fma_sq(p1, st.p4_lo));", SIM),
    Mutant("M39", "§5.7 means of binary32 norms summed in key order", "apa_emu/prep.py",
           "    return exact_mean(_f16(norms), 1)",
           "    total = np.zeros(norms.shape[0], F32)\n    for s in range(norms.shape[1]):\n"
           "        total = total + norms[:, s]\n    return total / F32(norms.shape[1])",
           ("tests/emu/test_err_est.py",)),
    Mutant("M40", "§9.8 the final rounding's error F2 left out", "apa_emu/merge.py",
           "        est = k.z * np.sqrt((vc + vh) / (dn * dn) + f2)", "        est = k.z * np.sqrt((vc + vh) / (dn * dn))",
           ("tests/emu/test_err_est.py",)),
    # the budget hot test (§7.7)
    Mutant("M41", "§7.7 budget test: ws compared in frame m, not rescaled to c", "apa_emu/pass1.py",
           "if (st.ws[r] * a) * a + t2[r] > rows.beta[r] * (big * big):",
           "if st.ws[r] + t2[r] > rows.beta[r] * (big * big):",
           ("tests/emu/test_hot_test.py",)),
    Mutant("K32", "kernel budget test: ws compared in frame m, not rescaled to c", "cuda/pass1.cuh",
           "fadd(fmul(fmul(st.r[h].ws, v.a[h]), v.a[h]), v.t2[h])", "fadd(st.r[h].ws, v.t2[h])",
           tuple(f"tests/kernel/test_gpu_sim.py::test_kernel_sources_on_simulator_match_emulator[{c}]"
                 for c in ("80-budget", "81-budget-bounded", "82-budget-fused-pad-vote"))),
    # mutants-2026-12b's survivors, each naming its id there
    Mutant("K34", "kernel budget test: L = (la ⊗ a) ⊕ tl fused (mutants-2026-12b K03)", "cuda/pass1.cuh",
           "const float L = fadd(fmul(st.r[h].la, v.a[h]), v.tl[h]);", "const float L = madd(st.r[h].la, v.a[h], v.tl[h], true);",
           BUDGET_PROBES),
    Mutant("K35", "kernel budget test > → >= (mutants-2026-12b K04)", "cuda/pass1.cuh",
           "v.t2[h]) > fmul(w.beta[h], fmul(L, L));", "v.t2[h]) >= fmul(w.beta[h], fmul(L, L));", BUDGET_PROBES),
    Mutant("K36", "kernel βr as (ε² ⊗ X) ⊘ κ (mutants-2026-12b K05)", "cuda/pass1.cuh",
           "fmul(ee, fdiv(x, kappa))", "fdiv(fmul(ee, x), kappa)", BUDGET_PROBES),
    # E04 (+inf only where no channel is finite) is equivalent since step 7 maps a NaN estimate to +inf: a
    # non-finite channel makes F2, and so the estimate, non-finite whatever the test on out says.
    Mutant("M42", "§9.8 step 7: a computed row's NaN estimate left NaN", "apa_emu/merge.py",
           "np.where(np.isfinite(out).all(axis=1) & ~np.isnan(est), est, F32(np.inf))",
           "np.where(np.isfinite(out).all(axis=1), est, F32(np.inf))", ("tests/emu/test_err_est_past_range.py",)),
    Mutant("M43", "§7.6 t2 under sm120 by the exact chain (mutants-2026-12b E09)", "apa_emu/pass1.py",
           "            if model == EXACT:\n                mma_exact(row, row, zero, one)",
           "            if model >= SM120:\n                mma_exact(row, row, zero, one)", ("tests/emu/test_err_est_rules.py",)),
    Mutant("M44", "§9.8 C_A of a binary32 pass-2 output 2⁻²¹ (mutants-2026-12b N01)", "apa_emu/constants.py",
           'F32(2.0**(-21 if p2_out == "f16" else -47))', 'F32(2.0**(-21 if p2_out != "exact" else -47))',
           ("tests/emu/test_spec_constants.py",)),
    Mutant("M45", "§7.7 budget test > → >= (mutants-2026-12b E07)", "apa_emu/pass1.py",
           "if (st.ws[r] * a) * a + t2[r] > rows.beta[r] * (big * big):",
           "if (st.ws[r] * a) * a + t2[r] >= rows.beta[r] * (big * big):", ("tests/emu/test_budget_vote.py",)),
    Mutant("M46", "§7.7 a voting padding row's βr from row R − 1's qstat, not +0 (mutants-2026-12b E15)",
           "apa_emu/api.py", "qstat = self._rows(p.qstat, wr, 0)", "qstat = self._p1_rows(p.qstat, wr, 0)",
           ("tests/emu/test_budget_vote.py",)),
    # binary32 pass-2 scores (§8.1 p2_scores)
    Mutant("M57", "§8.1 p2_scores f32: the chain still accumulated in FP16", "apa_emu/pass2.py",
           "    elif mode.f32_scores:\n        mma_sm90_f32(", "    elif mode.f32_scores:\n        mma_sm90_f16(",
           ("tests/emu/test_algorithm.py",)),
    Mutant("K37", "kernel §8.1 binary32 scores: the fragment read as lo = c0, c1 and hi = c2, c3 by pairs",
           "cuda/pass2.cuh",
           "madd(s[nt][e], qmul, -sh_lo, FUSED);\n            x[nt][2 + e] = madd(s[nt][2 + e],",
           "madd(s[nt][2 * e], qmul, -sh_lo, FUSED);\n            x[nt][2 + e] = madd(s[nt][2 * e + 1],",
           tuple(f"tests/kernel/test_gpu_sim.py::test_kernel_sources_on_simulator_match_emulator[{c}]"
                 for c in ("3s-scores-f32", "3t-scores-f32-d256"))),
    Mutant("M47", "§6.1 window reach: a row whose window starts one past the last key accepted (mutants-2026-12b C05)",
           "apa_emu/call.py", "if last - window + 1 > S - 1:", "if last - window > S - 1:", ("tests/emu/test_call_edges.py",)),
    Mutant("M48", "varlen warps=: sequence b gets the warps of sequences ≤ b (mutants-2026-12b C07)", "apa_emu/call.py",
           "in triples if bb == b)", "in triples if bb <= b)", ("tests/emu/test_call_edges.py",)),
    Mutant("M49", "call_arguments: an unbatched paged call's table passed as [1, pages] (mutants-2026-12b G01)",
           "apa_emu/engines.py", "block_table=call.pages.table[0] if call.squeeze else call.pages.table,",
           "block_table=call.pages.table,", ("tests/emu/test_engines_edges.py",)),
    Mutant("M50", "Seen counts cold tiles on an all-hot run (mutants-2026-12b G02)", "apa_emu/testing.py",
           '("cold tiles", emu.hot_tiles < emu.active_tiles)', '("cold tiles", emu.hot_tiles <= emu.active_tiles)',
           ("tests/emu/test_engines_edges.py",)),
    Mutant("M51", "assert_matches_emulator ignores the engine's claimed config (mutants-2026-12b G03)", "apa_emu/testing.py",
           "cfg = claimed_config(chosen) if config is None", "cfg = Config() if config is None",
           ("tests/emu/test_engines_edges.py",)),
    Mutant("M52", "scan ranking: pairs with no estimate first among the finite (mutants-2026-12b S03)",
           "apa_emu/study/scan.py", "np.where(np.isnan(rel), np.inf, -rel)", "np.where(np.isnan(rel), -np.inf, -rel)",
           ("tests/study/test_scan_ranking.py",)),
    Mutant("M53", "scan ranking: predicted error over ‖out‖², not ‖out‖ (mutants-2026-12b S04)", "apa_emu/study/scan.py",
           "return score / np.sqrt(self.sums.out_sq)", "return score / self.sums.out_sq", ("tests/study/test_scan_ranking.py",)),
    Mutant("M54", "§13.2 MUFU.EX2: |x| rounded to the 2⁻²³ grid instead of truncated", "apa_emu/sfu.py",
           "fx = int(math.floor(abs(np.float64(x)) * _TWO23))", "fx = int(round(abs(np.float64(x)) * _TWO23))",
           ("tests/emu/test_sfu.py",)),
    Mutant("M55", "§13.1 div.full: a scaled by 0.5 where b is scaled by 0.25", "apa_emu/sfu.py",
           "a, b = a * _QUARTER, b * _QUARTER", "a, b = a * _HALF, b * _QUARTER", ("tests/emu/test_sfu.py",)),
    Mutant("M56", "§13.2 MUFU.EX2: a negative x read from the positive table at 1 − f (one table)", "apa_emu/sfu.py",
           "np.float64(ex2[_NEG + f]) * math.ldexp(1.0, -n)",
           "(np.float64(ex2[(_NEG - f) % _NEG]) * math.ldexp(1.0, -n - (f > 0)))", ("tests/emu/test_sfu.py",)),
    Mutant("S1", "attribute: the seed's toggles applied over the variant's change", "apa_emu/study/commands/attribute.py",
           "cfg.replace(**{**SEED_TOGGLES, **change})", "cfg.replace(**{**change, **SEED_TOGGLES})",
           ("tests/study/test_attribute_configs.py",)),
]


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a rename: an interrupt leaves the old or the new file, never
    a truncated one (a source emptied mid-write would be lost work)."""
    tmp = path.with_name(path.name + ".mutant-tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run(m: Mutant) -> tuple[str, float, str]:
    path = ROOT / m.file
    original = path.read_text()
    if original.count(m.old) != 1:
        return "STALE", 0.0, f"the text to replace occurs {original.count(m.old)} times in {m.file}"
    _replace(path, original.replace(m.old, m.new))
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                           cwd=ROOT, capture_output=True, text=True)
    finally:
        _replace(path, original)
    failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in r.stdout.splitlines()
              if line.startswith("FAILED")]
    verdict = "killed" if r.returncode != 0 else "SURVIVED"
    return verdict, time.time() - t0, ", ".join(failed) or r.stdout.strip().splitlines()[-1]


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally above restores the file
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ids", nargs="*", help="mutant ids (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.ids or m.id in args.ids]
    unknown = set(args.ids) - {m.id for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.id:4s} {m.file:22s} {m.what}")
        return 0
    rows = []
    for m in chosen:
        verdict, secs, detail = run(m)
        rows.append((m, verdict, secs, detail))
        print(f"{m.id:4s} {verdict:10s} {secs:5.0f} s  {m.what}: {detail}", flush=True)
    print("\n| mutant | what | file | verdict | tests that failed |\n|---|---|---|---|---|")
    for m, verdict, _, detail in rows:
        print(f"| {m.id} | {m.what} | {m.file} | {verdict} | {detail if verdict == 'killed' else ''} |")
    bad = [m.id for m, v, _, _ in rows if v in ("SURVIVED", "STALE")]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} killed" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
