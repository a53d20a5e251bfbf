"""The APA kernel (apa_gpu) against the emulator (apa_emu), bitwise, output and every trace field.

Hypothesis draws shapes (batch, GQA ratio, head dim, rows, keys, query offset), input structure
(normal, sink, diffuse, outliers, channel offsets, tiny/subnormal, FP16 range edges) and the config
toggles the kernel implements. On a mismatch the test names the first divergent record
(b, hk, warp, visit, field) or row (b, hk, row, field) with both values, and saves the example as a
reproducer: ``python -m apa_gpu.replay FILE.npz`` replays it. Marked ``gpu``; what the CPU simulator
cannot check or would take hours over is also marked ``hardware``.

Knobs: APA_GPU_EXAMPLES (Hypothesis examples per property, default 40), APA_GPU_REPRO_DIR.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import apa_emu
from apa_emu.config import Config

import apa_gpu
from apa_gpu import device
from apa_gpu.build import SUPPORTED_D
from apa_gpu.engine import GpuEngine
from apa_emu.compare import canon_nan, describe, first_divergence, save_reproducer
from apa_emu.strategies import STRUCTURES, configs, large_logits, make_inputs, paginate, problems
from apa_gpu.strategies import schedules
from hyp import Seen

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("APA_GPU_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_bitwise(q, k, v, q_offset, cfg, trace="all", window=None, sched=None, **paging):
    """Kernel against emulator; ``sched``: apa_gpu.attention's schedule keywords (strategies.schedules)."""
    sched = sched or {}
    assume(GpuEngine.lacks(cfg, q.shape[-1]) is None)  # the simulator has no fast exp2 (numerics.md §13)
    emu = apa_emu.attention(q, k, v, q_offset, cfg, window=window, trace=trace, **paging)
    gpu = apa_gpu.attention(q, k, v, q_offset, cfg, window=window, trace=trace, **sched, **paging)
    div = first_divergence(emu, gpu)
    if div is not None:
        path = save_reproducer(q, k, v, q_offset, cfg, trace, window=window, schedule=sched.get("schedule", "separate"),
                               segment_tiles=sched.get("segment_tiles"), **paging)
        raise AssertionError(
            f"kernel and emulator differ: {describe(div)}\n"
            f"shapes q {q.shape} k {k.shape}, q_offset {q_offset}, window {window}, {cfg}, {sched}\n"
            f"reproducer: python -m apa_gpu.replay {path}"
        )
    return emu, gpu


@SETTINGS
@given(problems(), configs())
@example(  # the default config on a GQA prefill with a sink
    (dict(seed=1, B=1, n=64, Hkv=2, G=3, d=128, S=300, structure="sink", batched=False), 236), Config())
@example(  # ε < 0: every active tile exact, no pass 1
    (dict(seed=2, B=2, n=40, Hkv=1, G=4, d=64, S=200, structure="normal", batched=True), 160), Config(eps=-1.0))
@example(  # single row, single key
    (dict(seed=3, B=1, n=1, Hkv=1, G=1, d=64, S=1, structure="normal", batched=False), 0), Config())
def test_kernel_matches_emulator(problem, cfg):
    shape, q_offset = problem
    q, k, v = make_inputs(**shape)
    check_bitwise(q, k, v, q_offset, cfg)



@SETTINGS
@given(large_logits())
def test_large_logits_match_emulator_and_stay_finite(problem):
    """numerics.md §9.1 on the kernel: where the float64 reference is finite inside §8.7's range, the
    output is finite (a massless pass-1 frame no longer sets the merge's), bitwise the emulator's."""
    q, k, v, q_offset, cfg = problem
    _, gpu = check_bitwise(q, k, v, q_offset, cfg)
    finite = np.isfinite(apa_emu.reference(q, k, v, q_offset, cfg)).all(axis=-1)
    assert np.isfinite(gpu.out[finite]).all()


def test_seed_preset_matches_emulator():
    """Config.seed() as far as sm_90 runs it (numerics.md §12): sm90 MMA and exact K statistics, every
    other seed toggle on, against the emulator; it must meet warps that store directly (§9.5), warps
    that merge, and warps with padding rows (§6.2)."""
    seen = Seen()

    @SETTINGS
    @given(problems(), st.sampled_from([0.005, 0.02, 0.3, 1e9]), schedules())
    @example((dict(seed=1, B=1, n=37, Hkv=2, G=3, d=64, S=300, structure="sink", batched=False), 263), 0.02, {})
    @example(  # direct stores with lc = 0 (scores past the FP16 range): vg ⊘ lc = +inf on both sides
        (dict(seed=79512769, B=2, n=33, Hkv=1, G=3, d=128, S=183, structure="extreme", batched=True), 150), 0.005, {})
    def prop(problem, eps, sched):
        shape, q_offset = problem
        q, k, v = make_inputs(**shape)
        emu, _ = check_bitwise(q, k, v, q_offset, Config.seed(mma="sm90", k_stats="exact", eps=eps), sched=sched)
        vis = emu.visits
        warp = np.stack([vis["b"], vis["hk"], vis["warp"]], axis=1)
        if len(warp):
            _, inv = np.unique(warp, axis=0, return_inverse=True)
            hot_warps = np.bincount(inv.ravel(), weights=vis["hot"] == 1) > 0
            seen.update(direct=int((~hot_warps).sum()), merged=int(hot_warps.sum()))
        seen.update(padding=int(emu.meta["R"] % 16 != 0))

    prop()
    seen.require("direct", "merged", "padding")


@SETTINGS
@given(problems(), configs(), st.integers(0, 2**20), schedules())
@example(  # warps whose first visited tile leaves their other rows blind (c = −inf, §7.4); two CTAs
    (dict(seed=4, B=1, n=200, Hkv=1, G=1, d=64, S=700, structure="sink", batched=False), 500), Config(eps=0.3),
    199, {})
def test_window_matches_emulator(problem, cfg, raw, sched):
    """A sliding window (§6.1, §6.3, §6.4) of any width that leaves every row a key (raw picks it from
    the least such width, q_offset + n − S + 1 or 1, up to S + 70): bitwise, trace too."""
    shape, q_offset = problem
    q, k, v = make_inputs(**shape)
    least = max(1, q_offset + shape["n"] - shape["S"] + 1)
    check_bitwise(q, k, v, q_offset, cfg, window=least + raw % max(shape["S"] + 71 - least, 1), sched=sched)


@SETTINGS
@given(problems(), configs(), st.sampled_from([1, 16, 48, 64, 256, 5]), st.integers(0, 2**20), schedules())
def test_paged_kv_matches_emulator(problem, cfg, page_size, raw, sched):
    """Paged KV (§5.0): the problem's keys cut into pages of any size, shuffled into a pool with
    spare pages, one page sometimes a hole: the kernel reads through the table, bitwise the emulator."""
    shape, q_offset = problem
    q, k, v = make_inputs(**shape)
    k, v, table = paginate(k, v, page_size, raw)
    check_bitwise(q, k, v, q_offset, cfg, sched=sched, block_table=table, seqlen_k=shape["S"])


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 200)), min_size=1, max_size=4), configs(),
       st.sampled_from(SUPPORTED_D), st.sampled_from(STRUCTURES), st.integers(0, 2**31 - 1), schedules())
def test_varlen_matches_emulator(lengths, cfg, d, structure, seed, sched):
    """A varlen batch (§6.6): sequences of different query and key lengths packed in one launch, bitwise,
    trace records (b = the sequence) and padded hot masks too."""
    n = [a for a, _ in lengths]
    S = [a + extra for a, extra in lengths]
    parts = [make_inputs(seed + i, 1, ni, 1, 2, d, Si, structure, batched=False)
             for i, (ni, Si) in enumerate(zip(n, S))]
    q, k, v = (np.concatenate([p[j] for p in parts]) for j in range(3))
    cu = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    emu = apa_emu.attention(q, k, v, 0, cfg, cu_seqlens_q=cu(n), cu_seqlens_k=cu(S), trace="all")
    gpu = apa_gpu.attention(q, k, v, 0, cfg, cu_seqlens_q=cu(n), cu_seqlens_k=cu(S), trace="all", **sched)
    div = first_divergence(emu, gpu)
    assert div is None, f"varlen: kernel and emulator differ: {describe(div)}; lengths {lengths}, {cfg}, {sched}"
    assert (gpu.active_tiles, gpu.hot_tiles) == (emu.active_tiles, emu.hot_tiles)


@SETTINGS
@given(st.integers(16, 400), st.lists(st.integers(1, 60), min_size=1, max_size=4), configs(), st.sampled_from(SUPPORTED_D),
       st.sampled_from(STRUCTURES), st.integers(0, 2**31 - 1), schedules())
def test_chunked_prefill_matches_emulator(first, chunks, cfg, d, structure, seed, sched):
    """Chunked prefill (§5.9): the same chunks through a KV state on each side, bitwise (trace too),
    with the same restat decisions; frozen chunks (below 1.125× the statistics' keys) among them. The
    bounded schedule forms every chunk's images anew under the state's statistics."""
    S = first + sum(chunks)
    q, k, v = make_inputs(seed, 1, S, 1, 2, d, S, structure, batched=False)
    se, sg, start = apa_emu.KVState(), apa_emu.KVState(), 0
    for end in np.cumsum([first, *chunks]):
        emu = apa_emu.attention(q[start:end], k[:end], v[:end], start, cfg, kv_state=se, trace="all")
        gpu = apa_gpu.attention(q[start:end], k[:end], v[:end], start, cfg, kv_state=sg, trace="all", **sched)
        div = first_divergence(emu, gpu)
        assert div is None, f"chunk {start}..{end} ({sg.last or 'frozen'}): {describe(div)}; {cfg}, {sched}"
        assert se.history == sg.history
        start = int(end)


@SETTINGS
@given(problems(), st.sampled_from([0.005, 0.05, -1.0]))
def test_partial_trace_and_plain_mode(problem, eps):
    """Tracing a subset of warps, and the plain (no-trace) build: same hot masks and output."""
    shape, q_offset = problem
    q, k, v = make_inputs(**shape)
    cfg = Config(eps=eps)
    G, n, Hkv = shape["G"], shape["n"], shape["Hkv"]
    nw = -(-(n * G) // 16)
    want = [(0, Hkv - 1, nw - 1), (0, 0, 0)]
    emu, gpu = check_bitwise(q, k, v, q_offset, cfg, trace=want)
    plain = apa_gpu.attention(q, k, v, q_offset, cfg)
    assert plain.visits is None and plain.rows is None
    assert np.array_equal(plain.hot, emu.hot)
    assert canon_nan(plain.out).tobytes() == canon_nan(emu.out).tobytes()


@SETTINGS
@given(problems(), configs(), st.sampled_from(["fused", "bounded"]), st.integers(1, 4))
def test_schedules_match(problem, cfg, schedule, segment):
    """The fused persistent launch (pass-1 items, then pass-2 items behind ready flags), and the
    bounded schedule (pass 1 over one segment of 1-4 tiles at a time, its warps' state carried
    between the launches, §6.7), give the separate launches' bits: output, hot masks, every trace
    record. The problems have up to 6 tiles, so the bounded schedule runs several segments."""
    shape, q_offset = problem
    q, k, v = make_inputs(**shape)
    sep = apa_gpu.attention(q, k, v, q_offset, cfg, trace="all", schedule="separate")
    kw = dict(segment_tiles=segment) if schedule == "bounded" else {}
    other = apa_gpu.attention(q, k, v, q_offset, cfg, trace="all", schedule=schedule, **kw)
    div = first_divergence(sep, other)
    if div is not None:
        path = save_reproducer(q, k, v, q_offset, cfg, "all", note=f"{schedule} vs separate", schedule=schedule,
                               segment_tiles=kw.get("segment_tiles"))
        raise AssertionError(f"{schedule} differs from separate (emulator=separate, gpu={schedule}): "
                             f"{describe(div)}\nreproducer: {path}")


def test_device_inputs_and_errors():
    xp = device.backend().xp
    q, k, v = make_inputs(7, 1, 33, 2, 2, 64, 150, "normal", batched=False)
    cfg = Config()
    ref = apa_gpu.attention(q, k, v, 117, cfg)
    dev = apa_gpu.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), 117, cfg)
    assert ref.out.tobytes() == dev.out.tobytes()
    bad = q.copy()
    bad[3, 1, 5] = np.inf
    for args in ((bad, k, v, 117), (q.astype(np.float32), k, v, 117), (q, k[:, :1], v, 117), (q, k, v, -1)):
        with pytest.raises(ValueError) as e_emu:
            apa_emu.attention(*args, cfg)
        with pytest.raises(ValueError) as e_gpu:
            apa_gpu.attention(*args, cfg)
        assert str(e_emu.value) == str(e_gpu.value)
        with pytest.raises(ValueError) as e_dev:
            apa_gpu.attention(*(xp.asarray(a) if isinstance(a, np.ndarray) else a for a in args), cfg)
        assert str(e_dev.value) == str(e_emu.value)
    with pytest.raises(NotImplementedError):
        apa_gpu.attention(q, k, v, 117, Config(mma="exact"))


@pytest.mark.parametrize("schedule", ["separate", "fused", "bounded"])
def test_overflow_report_matches_emulator(schedule):
    """``Result.overflow`` from the kernel is the emulator's, pair by pair and stage by stage: head 0
    overflows pass 2's FP16 output (q = 0, v = 1000 over 600 keys), head 1 its scores; the second
    chunk of a KV state is diagnosed from the state as it was, and both states end alike."""
    q = np.zeros((32, 2, 64), np.float16)
    k = np.random.default_rng(0).standard_normal((600, 1, 64)).astype(np.float16)
    v = np.ones((600, 1, 64), np.float16)
    v[:, 0, 0] = 1000
    q[:, 1] = (k[:32, 0].astype(np.float32) * 2000).astype(np.float16)
    with pytest.warns(apa_emu.NonFiniteOutput):
        e = apa_emu.attention(q, k, v, 568, Config(eps=0.01))
    with pytest.warns(apa_emu.NonFiniteOutput):
        g = apa_gpu.attention(q, k, v, 568, Config(eps=0.01), schedule=schedule)
    assert g.overflow == e.overflow and {o.index[1] for o in e.overflow} == {0, 1}
    states, last = (apa_emu.KVState(), apa_emu.KVState()), []
    for attend, state in zip((apa_emu.attention, lambda *a, **kw: apa_gpu.attention(*a, schedule=schedule, **kw)),
                             states):
        with pytest.warns(apa_emu.NonFiniteOutput):
            attend(q[:16], k[:584], v[:584], 568, Config(eps=0.01), kv_state=state)
        with pytest.warns(apa_emu.NonFiniteOutput):
            last.append(attend(q[16:], k, v, 584, Config(eps=0.01), kv_state=state))
    assert last[0].overflow == last[1].overflow != []
    assert states[0].history == states[1].history and len(states[0].history) == 2

@pytest.mark.hardware  # the simulator runs CTAs one after another: determinism is by construction
@pytest.mark.parametrize("schedule", ["separate", "fused", "bounded"])
def test_deterministic_reruns(schedule):
    q, k, v = make_inputs(11, 1, 512, 2, 4, 128, 4096, "sink", batched=False)
    runs = [apa_gpu.attention(q, k, v, 4096 - 512, Config(), schedule=schedule) for _ in range(5)]
    assert len({r.out.tobytes() for r in runs}) == 1
    assert len({r.hot.tobytes() for r in runs}) == 1


def _warp_rows(hk, w, n, G):
    r = np.arange(16 * w, min(16 * w + 16, n * G))
    return r // G, hk * G + r % G


@pytest.mark.hardware  # passes on the simulator too, in about 20 minutes
def test_builtin_smollm2_dump():
    """The shipped SmolLM2 dump (d = 64, 9/3 heads), whole, output and trace."""
    from apa_emu.study.dump import builtin_dump_path, read_dump

    dump = read_dump(builtin_dump_path())
    q, k, v = (np.ascontiguousarray(x) for x in (dump.q, dump.k, dump.v))
    emu = apa_emu.attention(q, k, v, dump.q_offset, Config(), trace="all", workers=os.cpu_count() or 1)
    gpu = apa_gpu.attention(q, k, v, dump.q_offset, Config(), trace="all")
    div = first_divergence(emu, gpu)
    assert div is None, describe(div)


@pytest.mark.hardware  # hours on the simulator
def test_synthetic_llama_32k():
    """A synthetic Llama-3.2-3B-shaped problem (24/8 heads, d = 128) at 32768 keys: the whole
    output on the GPU, the emulator on a sample of warps (every KV head, rows across the block),
    compared on those warps' rows and traces."""
    from apa_emu.study.synth import synthetic_preset

    n, S = 512, 32768
    dump = synthetic_preset("llama-3.2-3b", n, S, seed=3)
    q, k, v = (np.ascontiguousarray(x) for x in (dump.q, dump.k, dump.v))
    G, nw = 3, -(-(n * 3) // 16)
    warps = [(0, hk, w) for hk in range(8) for w in (0, nw // 2, nw - 1)]
    cfg = Config()
    emu = apa_emu.attention(q, k, v, dump.q_offset, cfg, trace=warps, warps=warps,
                            workers=os.cpu_count() or 1)
    gpu = apa_gpu.attention(q, k, v, dump.q_offset, cfg, trace=warps)
    for (b, hk, w) in warps:
        i, h = _warp_rows(hk, w, n, G)
        a, g = emu.out[i, h], gpu.out[i, h]
        assert a.tobytes() == g.tobytes(), f"warp {(b, hk, w)}: outputs differ"
        assert emu.err_bound[i, h].tobytes() == gpu.err_bound[i, h].tobytes(), f"warp {(b, hk, w)}: bounds differ"
        assert emu.err_est[i, h].tobytes() == gpu.err_est[i, h].tobytes(), f"warp {(b, hk, w)}: estimates differ"
        assert np.array_equal(emu.hot[b, hk, w], gpu.hot[b, hk, w]), f"warp {(b, hk, w)}: hot masks differ"
    # compared above on the emulated warps only
    emu.hot, emu.out, emu.err_bound, emu.err_est = gpu.hot, gpu.out, gpu.err_bound, gpu.err_est
    div = first_divergence(emu, gpu)
    assert div is None, describe(div)


@pytest.mark.hardware  # MUFU.EX2 and MUFU.EX2.F16: the simulator has no special-function unit
@pytest.mark.parametrize("d", SUPPORTED_D)
@pytest.mark.parametrize("hot_test", ["mass", "output", "budget"])
def test_fast_mode_matches_emulator(d, hot_test):
    """exp2 'fast' (the hardware's ex2.approx, numerics.md §2 and §13) bit for bit, output, bounds,
    estimates, hot masks and trace, under each hot test; and the mode really is another exp2: the
    emulator's exact mode gives other tile row sums on the same problem."""
    q, k, v = make_inputs(21, 1, 256, 2, 3, d, 2048, "sink", batched=False)
    cfg = Config(exp2="fast", hot_test=hot_test, eps=0.01 if hot_test == "budget" else 0.005)
    emu, _ = check_bitwise(q, k, v, 2048 - 256, cfg)
    soft = apa_emu.attention(q, k, v, 2048 - 256, dataclasses.replace(cfg, exp2="soft"), trace="all")
    assert (soft.visits["tl"] != emu.visits["tl"]).any()
