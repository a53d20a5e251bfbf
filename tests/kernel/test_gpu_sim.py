"""The kernel sources on the CPU simulator (cuda/sim) against the emulator, bitwise.

No GPU needed: g++ compiles cuda/apa.cu with the CUDA built-ins replaced by host code (warp
collectives through a per-warp exchange, mma.sync by a C++ port of the sm90 model), and apa_gpu
runs it through its simulator backend (APA_GPU_BACKEND=sim). This checks the kernel's indexing,
fragment layouts, control flow, parameter structs, trace layout and binary32/binary16 arithmetic on
every CI run; the tensor cores themselves are checked on the device (tests/kernel/test_gpu_mma.py). Runs in
a subprocess, whose backend setting leaves this process's alone. Skipped without g++.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]



@pytest.fixture(autouse=True)
def _needs_gxx():
    """Without g++ this, CI's only run of the kernel sources, would prove nothing: under CI it fails."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("g++ not found (.ci/run installs it)")


# The kernel-vs-emulator runs: `run` one problem, `run_varlen` one varlen launch (§6.6). Each case
# below is its own pytest item and subprocess (the simulator backend is chosen once per process), so a
# slow or failing case reports itself and the rest still run; the simulator build is shared.
PRELUDE = textwrap.dedent(
    """
    import numpy as np, apa_emu, apa_gpu
    from apa_emu import KVState
    from apa_emu.compare import first_divergence, describe
    from apa_emu.config import Config
    from apa_emu.strategies import make_inputs

    def run(seed, n, H, Hkv, S, d, off, cfg, batch=None, sink=False, schedule="separate", scale=1.0, window=None,
            page=None, inputs=None, segment=None):
        rng = np.random.default_rng(seed)
        lead = () if batch is None else (batch,)
        q = rng.standard_normal(lead + (n, H, d))
        k = rng.standard_normal(lead + (S, Hkv, d))
        v = rng.standard_normal(lead + (S, Hkv, d))
        if sink:
            k[..., 0, :, :] += 6 * q.mean(axis=(-3, -2))[..., None, :]
            v[..., 0, :, :] *= 0.05  # a sink with a small value, as in LLMs: the output test sees it (§7.7)
        q, k, v = inputs or ((x * scale).astype(np.float16) for x in (q, k, v))
        paging = {}
        if page:
            from apa_emu.strategies import paginate
            k, v, table = paginate(k, v, page, seed)
            paging = dict(block_table=table, seqlen_k=S)
        e = apa_emu.attention(q, k, v, off, cfg, window=window, trace="all", **paging)
        seg = {} if segment is None else dict(segment_tiles=segment)
        g = apa_gpu.attention(q, k, v, off, cfg, window=window, trace="all", schedule=schedule, **paging, **seg)
        div = first_divergence(e, g)
        tag = f"seed={seed} d={d} window={window} page={page} {cfg} {schedule} {segment or ''}"
        assert div is None, tag + ": " + describe(div)
        rows = g.rows
        big = np.maximum(rows["m1"], rows["m2"])
        # rows whose output merges a cold part in a lower frame with a hot part (§9)
        merged = int(((rows["l1"] > 0) & (rows["l2"] > 0) & (rows["m1"] < big)).sum())
        print("ok", tag, g.hot_tiles, "/", g.active_tiles, "hot merged", merged)

    def run_varlen(seed, lengths, H, Hkv, d, cfg, schedule="separate", window=None, segment=None):
        parts = [make_inputs(seed + i, 1, n, Hkv, H // Hkv, d, S, "sink", batched=False)
                 for i, (n, S) in enumerate(lengths)]
        q, k, v = (np.concatenate([p[j] for p in parts]) for j in range(3))
        cu = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)
        lens = dict(cu_seqlens_q=cu([n for n, _ in lengths]), cu_seqlens_k=cu([S for _, S in lengths]))
        e = apa_emu.attention(q, k, v, 0, cfg, window=window, trace="all", **lens)
        seg = {} if segment is None else dict(segment_tiles=segment)
        g = apa_gpu.attention(q, k, v, 0, cfg, window=window, trace="all", schedule=schedule, **lens, **seg)
        div = first_divergence(e, g)
        tag = f"varlen seed={seed} {lengths} window={window} {cfg} {schedule}"
        assert div is None, tag + ": " + describe(div)
        assert (g.active_tiles, g.hot_tiles) == (e.active_tiles, e.hot_tiles), tag
        print("ok", tag, g.hot_tiles, "/", g.active_tiles, "hot merged 0")

    def offset_keys(seed, n, G, d, S, cfg, schedule):
        # Keys offset by 8 make sh = q·k̄ as large as the scores, so that x = S ⊗ qmul ⊖ sh keeps every
        # bit of sh (with centred keys its rounding vanishes under x's: mutant K18 survived such cases).
        q, k, v = make_inputs(seed, 1, n, 1, G, d, S, "sink", batched=False)
        k = (k.astype(np.float32) + 8).astype(np.float16)
        run(seed, n, G, 1, S, d, S - n, cfg, inputs=(q, k, v), schedule=schedule)
    """
)

CHUNKS = """
q, k, v = make_inputs(40, 1, 760, 1, 3, 64, 760, "sink", batched=False)
se, sg, start = KVState(), KVState(), 0
for end in (100, 110, 250, 270, 700, 720, 760):
    # the bounded schedule for two chunks: its own images under the state's statistics, and after it
    # the state's images formed anew
    seg = dict(schedule="bounded", segment_tiles=2) if end in (270, 700) else {}
    e = apa_emu.attention(q[start:end], k[:end], v[:end], start, Config(eps=0.05), kv_state=se, trace="all")
    g = apa_gpu.attention(q[start:end], k[:end], v[:end], start, Config(eps=0.05), kv_state=sg, trace="all", **seg)
    div = first_divergence(e, g)
    assert div is None and se.history == sg.history, f"chunk {start}..{end} {sg}: " + describe(div or {})
    start = end
assert [r for _, r in sg.history] == ["first", "", "growth", "", "growth", "", ""], sg.history
print("ok chunks", sg, g.hot_tiles, "/", g.active_tiles, "hot merged 0")
"""

MIXED, MERGED, NO_HOT = "mixed", "merged", "no hot tile"


def case(id_, code, *shows):
    """One simulator problem; ``shows``: what its run must exhibit (MIXED: hot and cold tiles both;
    MERGED: rows that merge a cold part in a lower frame with a hot part, §9; NO_HOT)."""
    return pytest.param(textwrap.dedent(code), shows, id=id_)


CASES = [
    case("1-sink", "run(1, 21, 3, 1, 150, 64, 129, Config(), sink=True)"),
    case("2-ascending-pure-fp4", "run(2, 9, 4, 2, 100, 64, 91, Config(eps=1e9, tile_order='ascending'))", NO_HOT),
    case("3-all-exact-f32", "run(3, 12, 2, 1, 140, 64, 200, Config(eps=-1.0, p2_accum='f32'))"),
    # binary32 scores (§8.1) at raw scores of tens, where FP16 steps round: alone, and with binary32 O at d = 256
    case("3s-scores-f32", "run(103, 21, 3, 1, 400, 64, 379, Config(eps=0.1, p2_scores='f32'), sink=True, scale=2.0)",
         MIXED),
    case("3t-scores-f32-d256", "run(104, 12, 2, 1, 140, 256, 200, Config(eps=-1.0, p2_scores='f32', p2_accum='f32',"
                               " fma=True), scale=2.0)"),
    case("4-batch-toggles", "run(4, 10, 2, 2, 90, 64, 80, Config(p_groups='interleaved', p_scale='pow2', q_format='fp8',"
                            " tau=0, delta=0.0, block_scale='nearest'), batch=2)"),
    case("5-d128-q-only", "run(5, 16, 3, 1, 130, 128, 114, Config(q_terms=1, quant_k=False, quant_p=False, eps=0.02),"
                          " sink=True)"),
    case("6-fused", "run(6, 20, 3, 1, 150, 64, 130, Config(eps=0.01), sink=True, schedule='fused')"),
    # More tiles than ring stages (pipeline.cuh reloads), two CTA items (fused: a reused ring).
    case("7-ring-reloads", "run(7, 70, 3, 1, 700, 64, 640, Config(eps=0.002), sink=True)"),
    case("8-fused-two-items", "run(8, 70, 3, 1, 700, 64, 640, Config(eps=0.01, tile_order='ascending'), sink=True,"
                              " schedule='fused')"),
    # Hot and cold tiles mixed, so rows merge a rescaled cold part (§9); ε = 1 where no tile can be hot
    # and a >= in the hot test would fire at the first visit; d = 128 fully quantized; FP16 subnormals.
    case("9-mixed", "run(9, 70, 3, 1, 700, 64, 640, Config(eps=0.3), sink=True)", MIXED, MERGED),
    case("10-eps-1", "run(10, 21, 3, 1, 150, 64, 129, Config(eps=1.0), sink=True)", NO_HOT),
    case("11-d128-mixed", "run(11, 24, 2, 1, 260, 128, 236, Config(eps=0.3), sink=True)", MIXED, MERGED),
    case("12-subnormals", "run(12, 16, 2, 1, 140, 64, 124, Config(eps=0.05), sink=True, scale=2.0**-12)"),
    # Sliding windows (§6.1): warps that start past tile 0, rows blind to their first visited tile,
    # every tile exact (the ε < 0 hot words start at F_w), the ascending order.
    case("13-window", "run(13, 70, 3, 1, 700, 64, 640, Config(eps=0.3), sink=True, window=200)", MIXED, MERGED),
    case("14-window-exact-fused", "run(14, 70, 3, 1, 700, 64, 640, Config(eps=-1.0), window=100, schedule='fused')"),
    case("15-window-ascending-d128", "run(15, 40, 2, 1, 500, 128, 460, Config(eps=0.01, tile_order='ascending'),"
                                     " window=64)"),
    # The output hot test (§7.7): ν in the odd columns of the row-sum MMA, lv and the trace's tv, lv;
    # interleaved slots (ν in slot order), a window (ν of keys below it +0), d = 128.
    case("16-output-test", "run(16, 70, 3, 1, 700, 64, 640, Config(eps=0.2, hot_test='output'), sink=True)",
         MIXED, MERGED),
    case("17-output-test-window-fused", "run(17, 40, 2, 1, 500, 128, 460, Config(eps=0.25, hot_test='output',"
                                        " p_groups='interleaved'), sink=True, window=300, schedule='fused')",
         MIXED, MERGED),
    # Paged KV (§5.0): shuffled pages, a hole (odd seeds), page sizes that do not divide S, a batch.
    case("19-paged", "run(19, 70, 3, 1, 700, 64, 640, Config(eps=0.3), sink=True, page=48)", MIXED, MERGED),
    case("21-paged-batch", "run(21, 30, 4, 2, 260, 128, 236, Config(eps=0.05, hot_test='output'), sink=True, batch=2,"
                           " page=5, schedule='fused')"),
    # A frame move by δ that underflows o to −0 before a hot tile (§7.9: update adds +0).
    case("0-minus-zero", """
        q, k, v = make_inputs(0, 1, 56, 1, 1, 64, 183, "channel", batched=False)
        k[119] = v[119] = 0
        v[:, 0, 0] = -np.abs(v[:, 0, 0])  # then the zero-P̂ MMA of the hot tile alone would keep a −0
        run(0, 56, 1, 1, 183, 64, 127, Config(eps=0.3, quant_k=False, quant_p=False, quant_v=False, tau=0),
            inputs=(q, k, v))
        """, MIXED, MERGED),
    # One varlen launch (§6.6) against the emulator's sequences alone; sequences of one and of two
    # CTAs, so that a short one's extra CTAs and fused items are empty.
    case("30-varlen", "run_varlen(30, [(9, 150), (70, 700), (1, 64), (33, 40)], 3, 1, 64, Config(eps=0.05))", MIXED),
    case("31-varlen-window-fused", "run_varlen(31, [(70, 520), (4, 90)], 4, 2, 128, Config(eps=0.02,"
                                   " hot_test='output'), schedule='fused', window=300)", MIXED),
    # Chunked prefill (§5.9): frozen chunks (the state's statistics; prep forms only the tiles from the
    # last complete one on), growth restats, one of them past the key images' room; both sides keep
    # their own KV state.
    case("40-chunks", CHUNKS, MIXED),
    # Head dim 256: CTAs of one warpgroup, 3-stage rings, the P·V wgmma as two 128-channel halves.
    case("50-d256", "run(50, 70, 3, 1, 700, 256, 640, Config(eps=0.05, p2_accum='f32'), sink=True)"),
    case("51-d256-fused", "run(51, 40, 2, 1, 300, 256, 260, Config(eps=0.02, hot_test='output',"
                          " p_groups='interleaved'), sink=True, schedule='fused')"),
    # The seed's f16(v/vg) (§5.5 v_f16) through the parameter struct: one large value sets vg = 128 and
    # the other channels' v/vg fall among FP16 subnormals. On sm90 the rounding cannot move V̂ (an
    # unquantized operand is f16 anyway; NVFP4 rounds such values to 0 in either form, numerics.md §12
    # #6), so this checks the plumbing; the emulator's test_v_f16_rounds_the_scaled_value_to_fp16 pins
    # the effect where it exists (mma="exact").
    case("53-v-f16", """
        q, k, v = make_inputs(53, 1, 40, 1, 2, 64, 300, "sink", batched=False)
        v[:, 0, 1:] *= np.float16(2.0**-15)
        v[3, 0, 0] = 60000
        run(53, 40, 2, 1, 300, 64, 260, Config(eps=0.3, v_f16=True), inputs=(q, k, v))
        """, MIXED, MERGED),
    # The bounded schedule (§6.7): pass 1 over segments of a few tiles, its warps' state carried between
    # launches; hot and cold tiles mixed; both tile orders, a window (CTAs past tile 0), paging and
    # the output test (ν in the segment's slots), ε < 0 (no pass 1), a varlen batch, d = 128.
    case("60-bounded", "run(60, 70, 3, 1, 700, 64, 640, Config(eps=0.3), sink=True, schedule='bounded', segment=3)",
         MIXED, MERGED),
    case("61-bounded-output-paged", "run(61, 70, 3, 1, 700, 64, 640, Config(eps=0.2, hot_test='output',"
                                    " tile_order='ascending'), sink=True, schedule='bounded', segment=4, page=48)",
         MIXED, MERGED),
    case("62-bounded-window", "run(62, 70, 3, 1, 700, 64, 640, Config(eps=0.3), sink=True, window=200,"
                              " schedule='bounded', segment=2)", MIXED, MERGED),
    case("63-bounded-all-exact", "run(63, 12, 2, 1, 140, 64, 200, Config(eps=-1.0, p2_accum='f32'),"
                                 " schedule='bounded', segment=1)"),
    case("64-bounded-d128", "run(64, 24, 2, 1, 260, 128, 236, Config(eps=0.3), sink=True, schedule='bounded',"
                            " segment=1)", MIXED, MERGED),
    case("65-bounded-varlen", "run_varlen(65, [(9, 150), (70, 700), (1, 64)], 3, 1, 64, Config(eps=0.05),"
                              " schedule='bounded', segment=3)", MIXED),
    # The seed's FMA sites (§1.8, config fma) on both sides: §7.4's u, §7.5's y, the hot test and hot
    # branch (mass and output tests), pass 2's x and the merge; P' unquantized, pow2 scales.
    case("70-fma-output-test", "run(70, 70, 3, 1, 700, 64, 640, Config(eps=0.2, fma=True, hot_test='output'),"
                               " sink=True)", MIXED, MERGED),
    case("71-fma-bounded-d128", "run(71, 40, 2, 1, 300, 128, 260, Config(eps=0.05, fma=True, p2_accum='f32'),"
                                " sink=True, schedule='bounded', segment=2)"),
    case("72-fma-pow2", "run(72, 16, 3, 1, 130, 64, 114, Config(eps=0.02, fma=True, quant_p=False,"
                        " p_scale='pow2'), sink=True)"),
    # Cold sink visits whose row-maximum group gets the lifted scale 18 fused (16 unfused; §7.4,
    # tests/emu/test_algorithm.py), so an unfused §7.4 site shows (mutant K16).
    case("9-fma-bounded", "run(9, 70, 3, 1, 700, 64, 640, Config(eps=0.3, fma=True), sink=True, schedule='bounded',"
                          " segment=3)", MIXED, MERGED),
    # The seed's per-lane pass-2 row shift (§5.3 p2_shift), its channel pairs fused and not.
    case("73-lanes-shift-fma", "offset_keys(73, 16, 3, 64, 130, Config(eps=0.02, p2_shift='lanes', fma=True),"
                               " 'separate')", MIXED, MERGED),
    case("74-lanes-shift-d128", "offset_keys(74, 24, 2, 128, 260, Config(eps=0.05, p2_shift='lanes'), 'fused')"),
    # Padding rows voting (§6.2 pad_vote), where they see keys the last row does not: the hand problem
    # of tests/emu/test_seed_preset.py (its tile 2 hot only through their votes), and a random one in
    # segments (their state carried too).
    case("75-pad-vote", """
        q, k, v = np.zeros((1, 1, 64), np.float16), np.zeros((256, 1, 64), np.float16), np.zeros((256, 1, 64), np.float16)
        q[0, 0, 0], k[64:128, 0, 0], k[129:144, 0, 0] = 4, -16, 16
        v[:] = np.random.default_rng(0).standard_normal((256, 1, 64))
        run(75, 1, 1, 1, 256, 64, 128, Config(eps=0.05, pad_vote=True), inputs=(q, k, v))
        """, MIXED, MERGED),
    case("76-pad-vote-bounded", "run(76, 5, 3, 1, 400, 64, 150, Config(eps=0.05, pad_vote=True), sink=True,"
                                " schedule='bounded', segment=2)"),
    # The direct store (§9.5 direct_store): pure FP4, where no warp has a hot tile; and ε = 0.3 in
    # segments, where every warp has one (its first tile), set by an earlier launch than the export's.
    case("77-direct-store", "run(77, 24, 2, 1, 260, 64, 236, Config(eps=1e9, direct_store=True), sink=True)", NO_HOT),
    case("78-direct-store-bounded", "run(78, 70, 3, 1, 700, 64, 640, Config(eps=0.3, direct_store=True), sink=True,"
                                    " schedule='bounded', segment=3)", MIXED, MERGED),
    # The budget hot test (§7.7): t2 before the vote, βr from prep's statistics and means; the bounded
    # schedule forms every segment's sums first (the means), and carries ws; padding rows vote with βr
    # from qstat's +0, d = 128, a window, fused.
    case("80-budget", "run(80, 70, 3, 1, 700, 64, 640, Config(eps=0.02, hot_test='budget'), sink=True)", MIXED, MERGED),
    case("81-budget-bounded", "run(81, 70, 3, 1, 700, 64, 640, Config(eps=0.02, hot_test='budget',"
                              " tile_order='ascending'), sink=True, schedule='bounded', segment=3)", MIXED, MERGED),
    case("82-budget-fused-pad-vote", "run(82, 37, 2, 1, 500, 128, 460, Config(eps=0.01, hot_test='budget',"
                                     " pad_vote=True), sink=True, window=300, schedule='fused')", MIXED, MERGED),
    # §9.1: rows whose pass 1 holds no mass (every visited tile hot) while its FP4 frame sits far above
    # pass 2's exact maximum (fuzz-2026-12 S1: q and k x20); such a frame must not set the merge's.
    case("79-massless-frame", """
        q, k, v = make_inputs(79, 1, 64, 1, 2, 64, 128, "normal", batched=False)
        q, k = ((x.astype(np.float32) * 20).astype(np.float16) for x in (q, k))
        run(79, 64, 2, 1, 128, 64, 64, Config(), inputs=(q, k, v))
        """),
]


@pytest.fixture(scope="module")
def sim_cache(tmp_path_factory):
    """One simulator build for every case of this module (keyed on the sources, so a planted bug in
    cuda/ builds its own)."""
    return tmp_path_factory.mktemp("sim-cache")


@pytest.mark.parametrize("code, shows", CASES)
def test_kernel_sources_on_simulator_match_emulator(sim_cache, code, shows):
    env = dict(os.environ, APA_GPU_BACKEND="sim", APA_GPU_CACHE=str(sim_cache))
    r = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    line = r.stdout.strip().splitlines()[-1]
    hot, active, merged = (int(x) for x in re.search(r" (\d+) / (\d+) hot merged (\d+)$", line).groups())
    if MIXED in shows:
        assert 0 < hot < active, f"hot and cold tiles did not mix: {line}"
    if MERGED in shows:
        assert merged > 0, f"no row merged a cold part with a hot one: {line}"
    if NO_HOT in shows:
        assert hot == 0, f"a tile went hot: {line}"


def test_the_cases_cover_what_the_kernel_has():
    """The simulator cases together reach every schedule, head dim, hot test and input layout."""
    codes = " ".join(p.values[0] for p in CASES)
    for feature in ("'fused'", "'bounded'", "window=", "page=", "run_varlen", "KVState", "hot_test='output'",
                    "hot_test='budget'", "fma=True", "direct_store=True", "pad_vote=True", "p2_shift='lanes'",
                    "p2_scores='f32'", ", 128,", ", 256,"):
        assert feature in codes, feature
    bounded = [p for p in CASES if "'bounded'" in p.values[0]]
    assert len(bounded) == 11 and sum(MIXED in p.values[1] for p in bounded) >= 4


def _gpu_file_passes_on_simulator(tmp_path, path: str, tests: int) -> None:
    """A test file marked gpu, run whole on the simulator: every one of its ``tests`` passes."""
    env = dict(os.environ, APA_GPU_BACKEND="sim", APA_GPU_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and re.search(rf"^{tests} passed", r.stdout, re.M), r.stdout + r.stderr


def test_fma_site_probes_on_simulator(tmp_path):
    """tests/kernel/test_gpu_fma_sites.py (marked gpu) on the simulator: the probes of §7.4's and §9.3–9.4's FMA
    sites, which whole problems seldom expose, run in CI too."""
    _gpu_file_passes_on_simulator(tmp_path, "tests/kernel/test_gpu_fma_sites.py", 3)


def test_budget_probes_on_simulator(tmp_path):
    """tests/kernel/test_gpu_budget.py (marked gpu) on the simulator: §7.7's budget vote and βr on operands
    at the edge of the vote, whose last bits no traced field shows, run in CI too."""
    _gpu_file_passes_on_simulator(tmp_path, "tests/kernel/test_gpu_budget.py", 2)


def test_quant16_probe_on_simulator(tmp_path):
    """tests/kernel/test_gpu_formats.py's quant16 check (§4.4: the packed binary16 search, ties, one-hot and
    sparse blocks) on the simulator with 4000 blocks per mode, so that CI runs cuda/formats.cuh's block
    quantizer, not only the device."""
    env = dict(os.environ, APA_GPU_BACKEND="sim", APA_GPU_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    code = "from helpers import check_quant16\nfor lsq in (True, False): check_quant16(4000, lsq)\nprint('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory):
    from apa_emu.study.dump import write_dump
    from apa_emu.study.synth import synthetic

    d = synthetic(48, 320, 6, 2, 64, seed=4)
    return write_dump(tmp_path_factory.mktemp("check") / "small.apadump", d.q, d.k, d.v, d.q_offset)


@pytest.mark.parametrize("mutant, stage, where", [
    ("K4", "pass 2 (FP16 scores q·k, row max and sum)", "field='l2'"),  # one addition's rounding order
    ("K6", "pass 1 (visit records", "where='visits'"),  # the seed's fmaf: one rounding fewer
])
def test_apa_check_names_the_stage_of_a_planted_kernel_bug(tmp_path, small_dump, mutant, stage, where):
    """`apa check` on kernels built from cuda/ with one rounding changed: it exits 1 and names the
    stage that wrote the first differing value; on the sources as they are, it exits 0."""
    from planted import apa_check, planted_sources

    args = [small_dump, "--warps", "0", "--schedule", "separate"]
    kw = dict(backend="sim", cache=tmp_path / "cache", repro=tmp_path / "repro")
    r = apa_check(args, sources=planted_sources(tmp_path, mutant), **kw)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("apa check: the kernel differs from the emulator in small.apadump (KV head 0, "
                               f"separate schedule), stage {stage}"), r.stdout
    assert where in lines[1] and len(list((tmp_path / "repro").glob("*.npz"))) == 1
    clean = apa_check(args, **kw)
    assert clean.returncode == 0 and "bitwise" in clean.stdout, clean.stdout + clean.stderr
