"""Benchmark the APA kernel against cuDNN's fused attention called directly (cudnn-frontend
``pygraph.sdpa``, the yardstick) and torch SDPA on the GPU.

For each key count: prep time and attention time (pass 1 + pass 2 + merge) of the bit-exact
(``exp2=soft``) and fast (``exp2=fast``) builds, the hot share, cuDNN called directly with its
TFLOP/s, the ratios to it with prep included and to the (1 + hot share) × cuDNN floor, and torch SDPA
with the flash and cuDNN backends (lower-right causal, GQA) on the same inputs, all in one run. cuDNN
direct needs the ``nvidia-cudnn-frontend`` and ``apache-tvm-ffi`` wheels (``--no-cudnn`` skips it). Inputs are the
synthetic Llama-3.2-3B-shaped problems of ``apa_emu.study.synth`` (sink, RoPE locality, diffuse heads,
channel offsets, outliers), in the families of ``synth.FAMILIES`` (``--family``). Times are medians of
``--reps`` CUDA-event timings after warm-up, each preceded by an L2 flush. Prints a markdown table (and writes it to ``--out`` if given).

    python tools/bench_gpu.py                       # 2048 rows x 8192/32768/65536/122880 keys
    python tools/bench_gpu.py --keys 8192 --reps 5  # one size
    python tools/bench_gpu.py --keys 32768 65536 122880 --family real-like outlier-heavy --kernels   # per-kernel times
    python tools/bench_gpu.py --keys 122880 --window 4096 --no-sdpa   # also a sliding window, vs causal
    python tools/bench_gpu.py --keys --varlen 2048:122880 512:8192 64:1024   # a varlen batch only
    python tools/bench_gpu.py --keys 122880 --no-sdpa --no-cudnn --chunk 256   # a frozen chunk vs a fresh call
    python tools/bench_gpu.py --keys 122880 --no-sdpa --no-cudnn --bounded      # the bounded KV copy
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from apa_emu.config import Config
from apa_emu.study.synth import FAMILIES, synthetic_preset
from apa_gpu.plan import SEGMENT_TILES


L2_FLUSH_BYTES = 256 << 20  # more than the H200's 50 MB of L2


def _time(fn, reps, warmup=2):
    """Median ms of ``fn`` over ``reps`` CUDA-event timings on the current CuPy stream, each after
    overwriting a buffer larger than L2, so that no repetition finds the previous one's data there."""
    import cupy as cp

    flush = cp.empty(L2_FLUSH_BYTES, np.uint8)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.fill(0)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def _plan(q, k, v, q_offset, cfg, schedule="separate", window=None):
    """A Plan for one batch entry and its inputs on the device."""
    import cupy as cp

    from apa_emu.geometry import Shape
    from apa_gpu.plan import Plan

    n, H, d = q.shape
    S, Hkv, _ = k.shape
    plan = Plan(Shape(B=1, n=n, H=H, Hkv=Hkv, S=S, d=d, q_offset=q_offset, window=window), cfg, schedule=schedule)
    return plan, *(cp.asarray(x)[None] for x in (q, k, v))


def kernel_times(q, k, v, q_offset, cfg, reps):
    """Median ms of each launch of prep and of attention (separate launches), by kernel name."""
    plan, qd, kd, vd = _plan(q, k, v, q_offset, cfg)
    times = launch_times(plan, lambda: plan.prep(qd, kd, vd), reps)
    return times | launch_times(plan, lambda: plan.attend(qd), reps)


def bench_apa(q, k, v, q_offset, cfg, reps, schedule="separate", window=None):
    import cupy as cp

    plan, qd, kd, vd = _plan(q, k, v, q_offset, cfg, schedule, window)
    t_prep = _time(lambda: plan.prep(qd, kd, vd), reps)
    plan.prep(qd, kd, vd)
    t_attn = _time(lambda: plan.attend(qd), reps)
    cp.cuda.get_current_stream().synchronize()
    hot = plan.hot.get()
    share = int(np.unpackbits(hot.view(np.uint8)).sum()) / plan.shape.active_tiles()
    return t_prep, t_attn, share


def launch_times(plan, call, reps):
    """Median ms of each kernel launch of ``call()`` (a Plan method), by kernel name, CUDA events around
    each launch."""
    import cupy as cp

    launch, runs = plan.launch, []

    def timed(name, *args):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        launch(name, *args)
        b.record()
        runs[-1].append((name, a, b))

    plan.launch = timed
    try:
        for _ in range(reps + 1):
            runs.append([])
            call()
        cp.cuda.get_current_stream().synchronize()
    finally:
        plan.launch = launch
    names = [name for name, _, _ in runs[-1]]
    return {n: float(np.median([cp.cuda.get_elapsed_time(a, b) for r in runs[1:] for m, a, b in r if m == n]))
            for n in names}


def plan_bytes(plan) -> tuple[int, int]:
    """Device bytes a Plan holds beyond the inputs, per (b, KV head): (pass 1's key images K̂, V̂ᵀ and ν;
    everything else: Q̂, row statistics, pass 1's partial results and carried state, hot masks, outputs)."""
    import cupy as cp

    images = {id(a): a.nbytes for a in (plan.khat, plan.vhat, plan.nu) if a is not None}
    every = {id(a): a.nbytes for a in vars(plan).values() if isinstance(a, cp.ndarray)}
    every.update(images)
    per = plan.shape.B * plan.shape.Hkv
    return sum(images.values()) // per, (sum(every.values()) - sum(images.values())) // per


def bench_bounded(q, k, v, q_offset, cfg, reps, segment):
    """The bounded schedule (numerics.md §6.7: pass 1's key images one segment at a time) against the
    separate launches, whole runs (prep + attention), outputs checked bitwise equal; with the device
    bytes each plan holds per KV head (plan_bytes). Returns (ms separate, ms bounded, bytes separate,
    bytes bounded)."""
    import cupy as cp

    from apa_emu.geometry import Shape
    from apa_gpu.plan import Plan

    qd, kd, vd = (cp.asarray(x)[None] for x in (q, k, v))
    n, H, d = q.shape
    S, Hkv, _ = k.shape
    shape = Shape(B=1, n=n, H=H, Hkv=Hkv, S=S, d=d, q_offset=q_offset)
    plans = [Plan(shape, cfg), Plan(shape, cfg, schedule="bounded", segment=segment)]
    times, outs = [], []
    for plan in plans:
        times.append(_time(lambda: plan.run(qd, kd, vd), reps))
        plan.run(qd, kd, vd)
        outs.append(plan.out.get())
    if outs[0].tobytes() != outs[1].tobytes():
        raise AssertionError("bounded schedule: the output differs from the separate launches'")
    return (*times, *(plan_bytes(p) for p in plans))


def bench_paged(q, k, v, q_offset, cfg, reps, page_size):
    """Prep and attention with K and V as a page pool (numerics.md §5.0: the sequence's pages shuffled,
    apa_emu.strategies.paginate) against the contiguous layout, in one run; the two outputs must be
    bitwise equal. Returns (prep, attn) ms for contiguous, then paged, and the prep kernels' ms of each."""
    import cupy as cp

    from apa_emu.geometry import Shape
    from apa_gpu.plan import Plan
    from apa_emu.strategies import paginate

    n, H, d = q.shape
    S, Hkv, _ = k.shape
    pool_k, pool_v, table = paginate(k, v, page_size, 0)  # seed 0: no hole
    shape = Shape(B=1, n=n, H=H, Hkv=Hkv, S=S, d=d, q_offset=q_offset)
    qd = cp.asarray(q)[None]
    runs = {"contiguous": ((cp.asarray(k)[None], cp.asarray(v)[None]), None),
            "paged": ((cp.asarray(pool_k), cp.asarray(pool_v)), (cp.asarray(table[None]), page_size))}
    times, outs, kernels = [], [], []
    for (kd, vd), pages in runs.values():
        plan = Plan(shape, cfg)
        times += [_time(lambda: plan.prep(qd, kd, vd, pages), reps)]
        kernels.append(launch_times(plan, lambda: plan.prep(qd, kd, vd, pages), reps))
        plan.prep(qd, kd, vd, pages)
        times += [_time(lambda: plan.attend(qd), reps)]
        outs.append(plan.out.get())
    if outs[0].tobytes() != outs[1].tobytes():
        raise AssertionError("paged KV: the output differs from the contiguous layout's")
    return times, kernels


def bench_varlen(spec, cfg, reps, seed, cudnn_too):
    """A varlen batch (numerics.md §6.6) of synthetic sequences ``spec`` = [(rows, keys), ...]: one
    launch (prep included) against the same sequences launched one after another, outputs checked
    bitwise equal, and cuDNN's ragged (THD) fused attention on the same batch. Returns a table row."""
    import cupy as cp

    from apa_emu.varlen import Seqs
    from apa_gpu.plan import Plan

    dumps = [synthetic_preset("llama-3.2-3b", n, S, seed=seed + i) for i, (n, S) in enumerate(spec)]
    if any(dp.q_offset != S - n for dp, (n, S) in zip(dumps, spec)):
        raise AssertionError("varlen: the synthetic sequences are not bottom-right causal")
    q, k, v = (np.ascontiguousarray(np.concatenate([getattr(dp, x) for dp in dumps])) for x in "qkv")
    cu = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int64)  # noqa: E731
    seqs = Seqs(cu([n for n, _ in spec]), cu([S for _, S in spec]))
    _, H, d = q.shape
    Hkv = k.shape[1]
    qd, kd, vd = (cp.asarray(x)[None] for x in (q, k, v))
    each_shape, longest = seqs.shapes(H, Hkv, d, None)
    one = Plan(longest, cfg, seqs=seqs)
    t_one = _time(lambda: (one.prep(qd, kd, vd), one.attend(qd)), reps)
    one.run(qd, kd, vd)
    share = int(np.unpackbits(one.hot.get().view(np.uint8)).sum()) / one.active_tiles()
    alone = []
    for e, (q0, q1), (k0, k1) in zip(each_shape, zip(seqs.cq, seqs.cq[1:]), zip(seqs.ck, seqs.ck[1:])):
        alone.append((Plan(e, cfg), *(cp.ascontiguousarray(x) for x in (qd[:, q0:q1], kd[:, k0:k1], vd[:, k0:k1]))))

    def each():
        for plan, qs, ks, vs in alone:
            plan.run(qs, ks, vs)

    t_each = _time(each, reps)
    each()
    if one.out.get().tobytes() != np.concatenate([p.out.get()[0] for p, *_ in alone]).tobytes():
        raise AssertionError("varlen: one launch differs from the sequences launched alone")
    flops = sum(causal_flops(n, S, H, d, S - n) for n, S in spec) / 1e9
    t_cu, detail = bench_cudnn_varlen(q, k, v, seqs, cfg.softmax_scale(d), reps) if cudnn_too else (float("nan"), "")
    return (f"| {len(spec)} | {sum(n for n, _ in spec)} | {sum(S for _, S in spec)} | {share:.4f} | {t_one:.3f} | "
            f"{t_each:.3f} | {t_each / t_one:.2f} | {flops / t_one:.0f} | {t_cu:.3f} | {flops / t_cu:.0f} | "
            f"{t_one / t_cu:.2f} |"), detail


def bench_cudnn_varlen(q, k, v, seqs, scale, reps):
    """cuDNN's fused attention on a packed (THD) varlen batch through cudnn-frontend: ragged offsets,
    per-sequence lengths, bottom-right causal, GQA. Its output is checked against torch SDPA per
    sequence. Returns (ms, detail)."""
    import cudnn
    import cupy as cp
    import torch
    from torch.nn.attention.bias import causal_lower_right

    B = len(seqs.n)
    _, H, d = q.shape
    Hkv = k.shape[1]
    sq, sk = int(seqs.n.max()), int(seqs.S.max())

    def padded(x, s, h):
        """The packed rows at the start of room for B·s rows, seen as the logical (B, h, s, d)."""
        buf = torch.zeros(B * s * h * d, dtype=torch.float16, device="cuda")
        buf[: x.size].copy_(torch.from_numpy(x.reshape(-1)).cuda())
        return buf.as_strided((B, h, s, d), (s * h * d, d, h * d, 1))

    def cuda_ints(x, dtype):
        return torch.from_numpy(np.asarray(x)).to(dtype).cuda().reshape(-1, 1, 1, 1)

    qg, kg, vg = padded(q, sq, H), padded(k, sk, Hkv), padded(v, sk, Hkv)
    og = padded(np.zeros_like(q), sq, H)
    lq, lk = cuda_ints(seqs.n, torch.int32), cuda_ints(seqs.S, torch.int32)
    offs = [cuda_ints(c * h * d, torch.int64) for c, h in ((seqs.cq, H), (seqs.ck, Hkv), (seqs.ck, Hkv), (seqs.cq, H))]
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    qt, kt, vt, lqt, lkt = (graph.tensor_like(x) for x in (qg, kg, vg, lq, lk))
    ot = [graph.tensor_like(x) for x in offs]
    for t, off in zip((qt, kt, vt), ot):
        t.set_ragged_offset(off)
    o, _ = graph.sdpa(name="sdpa", q=qt, k=kt, v=vt, generate_stats=False, attn_scale=float(scale),
                      use_padding_mask=True, seq_len_q=lqt, seq_len_kv=lkt, diagonal_band_right_bound=0,
                      diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT)
    o.set_output(True).set_dim(og.size()).set_stride(og.stride())
    o.set_ragged_offset(ot[3])
    run = _cudnn_runner(graph, {qt: qg, kt: kg, vt: vg, lqt: lq, lkt: lk, o: og, **dict(zip(ot, offs))})
    run()
    torch.cuda.synchronize()
    flat = og.as_strided((q.size,), (1,)).view(q.shape)
    worst = 0.0
    for b in range(B):
        rows, keys = slice(int(seqs.cq[b]), int(seqs.cq[b + 1])), slice(int(seqs.ck[b]), int(seqs.ck[b + 1]))
        tq, tk, tv = (torch.from_numpy(x[s]).cuda().transpose(0, 1)[None] for x, s in ((q, rows), (k, keys), (v, keys)))
        ref = torch.nn.functional.scaled_dot_product_attention(
            tq, tk.repeat_interleave(H // Hkv, 1), tv.repeat_interleave(H // Hkv, 1),
            attn_mask=causal_lower_right(tq.shape[2], tk.shape[2]), scale=float(scale))
        worst = max(worst, float((flat[rows].transpose(0, 1)[None].float() - ref.float()).abs().max()))
    detail = f"cuDNN ragged, max |cuDNN - SDPA per sequence| {worst:.1e}"
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        return _time(run, reps), detail


def bench_chunked(q, k, v, q_offset, cfg, reps, chunk):
    """The last ``chunk`` query rows as a frozen chunk (numerics.md §5.9) of a KV state made by the rows
    before them, against the same rows as a fresh call, in one run: whole ``apa_gpu.attention`` calls
    (host work included). The frozen chunk's prep forms only the tiles from the state's last complete
    one on and skips the statistics. Returns (frozen ms, fresh ms)."""
    import cupy as cp

    import apa_gpu
    from apa_emu import KVState

    a = q.shape[0] - chunk
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    state = KVState()
    apa_gpu.attention(qd[:a], kd[:q_offset + a], vd[:q_offset + a], q_offset, cfg, kv_state=state)
    saved = dict(vars(state), history=list(state.history))
    held = state.cache.held

    def frozen():  # the same chunk again on the same state: restore what the last call advanced
        vars(state).update(saved, history=list(saved["history"]))
        state.cache.held = held
        apa_gpu.attention(qd[a:], kd, vd, q_offset + a, cfg, kv_state=state)

    frozen()
    if state.last:
        raise AssertionError(f"chunked: the chunk restatted ({state.last}); take a smaller --chunk")
    return _time(frozen, reps), _time(lambda: apa_gpu.attention(qd[a:], kd, vd, q_offset + a, cfg), reps)


def bench_sdpa(q, k, v, reps):
    """torch SDPA, lower-right causal, flash and cuDNN backends; GQA via enable_gqa when the backend
    takes it, else K/V expanded to every query head outside the timing."""
    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    n, H, d = q.shape
    S, Hkv, _ = k.shape
    tq = torch.from_numpy(np.ascontiguousarray(q)).cuda().transpose(0, 1)[None]  # [1, H, n, d]
    tk = torch.from_numpy(np.ascontiguousarray(k)).cuda().transpose(0, 1)[None]
    tv = torch.from_numpy(np.ascontiguousarray(v)).cuda().transpose(0, 1)[None]
    mask = causal_lower_right(n, S)
    res = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        t = None
        for gqa in (True, False):
            kk, vv = (tk, tv) if gqa else (tk.repeat_interleave(H // Hkv, 1), tv.repeat_interleave(H // Hkv, 1))
            kw = {"enable_gqa": True} if gqa else {}

            def run(kk=kk, vv=vv, kw=kw):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(tq, kk, vv, attn_mask=mask, **kw)

            try:
                run()
                torch.cuda.synchronize()
                # the events and the L2 flush on torch's stream
                with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    t = (_time(run, reps), "gqa" if gqa else "expanded")
                break
            except Exception as e:  # backend refuses this form: try the other
                err = str(e).splitlines()[0][:80]
        res[name] = t if t is not None else (float("nan"), f"unavailable: {err}")
    return res


def _cudnn_runner(graph, pack):
    """Build the plans of a cudnn-frontend graph whose output is set; a call that runs it on ``pack``
    on torch's current stream."""
    import cudnn
    import torch

    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    return lambda: graph.execute(pack, workspace, handle=handle)


def bench_cudnn(q, k, v, scale, reps, window=None):
    """cuDNN's fused attention called directly through cudnn-frontend (`pygraph.sdpa`): bottom-right
    causal, GQA, FP16 in and out, binary32 softmax; the speed yardstick. Returns (ms, detail);
    its output is checked against torch SDPA (cuDNN backend) on the same inputs before timing."""
    import cudnn
    import cupy as cp
    import torch

    n, H, d = q.shape
    S, Hkv, _ = k.shape
    # (1, S, H, D) storage seen as the logical (1, H, S, D) the graph takes
    qg, kg, vg = (torch.from_numpy(np.ascontiguousarray(x)).cuda()[None].transpose(1, 2) for x in (q, k, v))
    og = torch.empty(1, n, H, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    qt, kt, vt = (graph.tensor_like(x) for x in (qg, kg, vg))
    kw = dict(name="sdpa", q=qt, k=kt, v=vt, generate_stats=False, attn_scale=float(scale),
              diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT)
    if window is not None:
        kw["diagonal_band_left_bound"] = window
    o, _ = graph.sdpa(**kw)
    o.set_output(True).set_dim(og.size()).set_stride(og.stride())
    run = _cudnn_runner(graph, {qt: qg, kt: kg, vt: vg, o: og})
    run()
    torch.cuda.synchronize()
    detail = f"cudnn-frontend {cudnn.__version__}, backend {cudnn.backend_version()}"
    if window is None:  # the same semantics as torch's lower-right causal SDPA: compare
        from torch.nn.attention.bias import causal_lower_right

        ref = torch.nn.functional.scaled_dot_product_attention(
            qg, kg.repeat_interleave(H // Hkv, 1), vg.repeat_interleave(H // Hkv, 1),
            attn_mask=causal_lower_right(n, S), scale=float(scale))
        detail += f", max |cuDNN - SDPA| {float((og.float() - ref.float()).abs().max()):.1e}"
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        return _time(run, reps), detail


def causal_flops(n, S, H, d, q_offset, window=None) -> float:
    """Exact attention's FLOPs (two matmuls, 2·d each per visible (row, key) pair) of one batch entry."""
    pos = q_offset + np.arange(n, dtype=np.float64)
    seen = np.minimum(pos, S - 1) + 1 - (0 if window is None else np.maximum(pos - window + 1, 0))
    return 4.0 * d * H * float(seen.sum())


def _arguments(argv) -> tuple[argparse.Namespace, Config]:
    """The options, and the Config of every APA column (``--eps`` and ``--config``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--keys", type=int, nargs="*", default=[8192, 32768, 65536, 122880])
    ap.add_argument("--eps", type=float, default=0.005)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-cudnn", action="store_true", help="skip cuDNN called directly (cudnn-frontend)")
    ap.add_argument("--window", type=int, help="also time a sliding window of this many keys (numerics.md §6.1)")
    ap.add_argument("--page-size", type=int, help="also time prep and attention with K and V as a shuffled page "
                    "pool of this page size (numerics.md §5.0), against the contiguous layout")
    ap.add_argument("--varlen", nargs="*", metavar="ROWS:KEYS", help="also time one varlen batch of these "
                    "sequences (numerics.md §6.6) in one launch, against launching them one by one and cuDNN ragged")
    ap.add_argument("--chunk", type=int, help="also time the last CHUNK rows as a frozen chunk of a KV state "
                    "(numerics.md §5.9) against the same rows as a fresh call")
    ap.add_argument("--bounded", type=int, nargs="*", metavar="TILES", help="also time the bounded schedule "
                    "(numerics.md §6.7) with segments of each TILES tiles (default apa_gpu.plan.SEGMENT_TILES) "
                    "against the separate launches, and report the device bytes per KV head of each")
    ap.add_argument("--kernels", action="store_true", help="also time each kernel launch of prep and attention "
                    "(separate launches), bit-exact and fast")
    ap.add_argument("--family", nargs="+", default=[next(iter(FAMILIES))], choices=list(FAMILIES),
                    help="synthetic input families (apa_emu.study.synth.FAMILIES), default the first")
    ap.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Config toggles for every APA column, e.g. hot_test=output (the fast columns add exp2=fast)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        return args, Config.from_overrides(args.config, Config(eps=args.eps))
    except ValueError as e:
        ap.error(str(e))


def _header(args) -> list[str]:
    return [
        f"APA kernel vs torch SDPA: {args.rows} query rows, GQA 24/8, d = 128, eps = {args.eps}"
        f"{''.join(', ' + c for c in args.config)}, "
        f"synthetic llama-3.2-3b inputs (seed {args.seed}); medians of {args.reps} runs, ms",
        "",
        "attn = pass 1 + pass 2 + merge after prep; 'sep' three launches, 'fused' one persistent launch.",
        "",
        "| family | keys | hot share | prep | attn exact sep | attn exact fused | attn fast sep | attn fast fused "
        "| SDPA flash | SDPA cuDNN | exact/flash | fast/flash | cuDNN direct | cuDNN TFLOP/s | exact+prep / cuDNN "
        "| fast+prep / cuDNN | APA fast+prep TFLOP/s | fast+prep / ((1+h)·cuDNN) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]


class Problem(NamedTuple):
    """One synthetic input of the main table, with the configs of its exact and fast columns."""

    family: str
    S: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    q_offset: int
    exact_cfg: Config
    fast_cfg: Config


def _main_row(args, p: Problem, t0: float) -> tuple[str, dict]:
    """The main table's row of one problem, printed with its details and the seconds since ``t0`` as a
    comment; and the times the comparisons of the first family divide by."""
    q, k, v, reps = p.q, p.k, p.v, args.reps
    prep, exact, share = bench_apa(q, k, v, p.q_offset, p.exact_cfg, reps)
    _, exact_f, _ = bench_apa(q, k, v, p.q_offset, p.exact_cfg, reps, "fused")
    _, fast, _ = bench_apa(q, k, v, p.q_offset, p.fast_cfg, reps)
    _, fast_f, _ = bench_apa(q, k, v, p.q_offset, p.fast_cfg, reps, "fused")
    sd = {"flash": (float("nan"), "skipped"), "cudnn": (float("nan"), "skipped")}
    if not args.no_sdpa:
        sd = bench_sdpa(q, k, v, reps)
    fl = sd["flash"][0]
    best_exact, best_fast = min(exact, exact_f), min(fast, fast_f)
    scale = p.exact_cfg.softmax_scale(q.shape[2])
    cu, cu_detail = (float("nan"), "skipped") if args.no_cudnn else bench_cudnn(q, k, v, scale, reps)
    tf = causal_flops(q.shape[0], p.S, q.shape[1], q.shape[2], p.q_offset) / 1e9  # GFLOP: / ms = TFLOP/s
    line = (f"| {p.family} | {p.S} | {share:.4f} | {prep:.3f} | {exact:.3f} | {exact_f:.3f} | {fast:.3f} | "
            f"{fast_f:.3f} | {fl:.3f} | {sd['cudnn'][0]:.3f} | {best_exact / fl:.2f} | {best_fast / fl:.2f} | "
            f"{cu:.3f} | {tf / cu:.0f} | {(prep + best_exact) / cu:.2f} | {(prep + best_fast) / cu:.2f} | "
            f"{tf / (prep + best_fast):.0f} | {(prep + best_fast) / ((1 + share) * cu):.2f} |")
    print(line + f"   <!-- {time.time() - t0:.0f}s; sdpa {sd['flash'][1]}, {sd['cudnn'][1]}; {cu_detail} -->",
          flush=True)
    return line, dict(share=share, exact=exact, fast=fast, cu=cu, scale=scale)


def _kernel_rows(args, p: Problem) -> list[str]:
    """Each kernel launch's time, bit-exact and fast, one printed row each."""
    rows = []
    for build, cfg in (("exact", p.exact_cfg), ("fast", p.fast_cfg)):
        kt = kernel_times(p.q, p.k, p.v, p.q_offset, cfg, args.reps)
        rows.append(f"| {p.family} | {p.S} | {build} | {sum(kt.values()):.3f} | "
                    + ", ".join(f"{n.removeprefix('apa_')} {t:.3f}" for n, t in kt.items()) + " |")
        print(rows[-1], flush=True)
    return rows


def _window_row(args, p: Problem, base: dict) -> str:
    """The sliding window against full causal (``base``: _main_row's times), APA and cuDNN."""
    w_prep, w_exact, w_share = bench_apa(p.q, p.k, p.v, p.q_offset, p.exact_cfg, args.reps, window=args.window)
    _, w_fast, _ = bench_apa(p.q, p.k, p.v, p.q_offset, p.fast_cfg, args.reps, window=args.window)
    w_cu = float("nan") if args.no_cudnn else bench_cudnn(p.q, p.k, p.v, base["scale"], args.reps,
                                                          window=args.window)[0]
    exact, fast, cu = base["exact"], base["fast"], base["cu"]
    return (f"| {p.S} | {args.window} | {w_share:.4f} | {w_prep:.3f} | {w_exact:.3f} | {w_fast:.3f} | "
            f"{exact:.3f} | {fast:.3f} | {w_exact / exact:.3f} | {w_fast / fast:.3f} | {w_cu:.3f} | "
            f"{cu:.3f} | {w_cu / cu:.3f} | {(w_prep + w_fast) / w_cu:.2f} |")


def _comparisons(args, p: Problem, base: dict, tables: dict) -> None:
    """The first family's rows of the optional tables (window, bounded, chunked, paged), each printed and
    added to its list in ``tables``."""
    def add(name, row):
        tables[name].append(row)
        print(row, flush=True)

    if args.window:
        add("windows", _window_row(args, p, base))
    for seg in ([SEGMENT_TILES] if args.bounded == [] else args.bounded or []):
        t_sep, t_b, (img_sep, rest_sep), (img_b, rest_b) = bench_bounded(p.q, p.k, p.v, p.q_offset, p.exact_cfg,
                                                                      args.reps, seg)
        mb = 1 << 20
        add("bounded", f"| {p.S} | {seg} | {base['share']:.4f} | {t_sep:.3f} | {t_b:.3f} | {t_b / t_sep:.3f} | "
                       f"{img_sep / mb:.2f} | {img_b / mb:.2f} | {rest_sep / mb:.2f} | {rest_b / mb:.2f} | "
                       f"{2 * p.S * p.q.shape[2] * 2 / mb:.2f} |")
    if args.chunk:
        t_frozen, t_fresh = bench_chunked(p.q, p.k, p.v, p.q_offset, p.exact_cfg, args.reps, args.chunk)
        add("chunked", f"| {p.S} | {args.chunk} | {t_frozen:.3f} | {t_fresh:.3f} | {t_fresh / t_frozen:.2f} |")
    if args.page_size:
        (c_prep, c_attn, p_prep, p_attn), (kc, kp) = bench_paged(p.q, p.k, p.v, p.q_offset, p.exact_cfg, args.reps,
                                                                 args.page_size)
        per_kernel = ", ".join(f"{n.removeprefix('apa_prep_')} {kc[n]:.3f}/{kp[n]:.3f}" for n in kc)
        add("paged", f"| {p.S} | {args.page_size} | {c_prep:.3f} | {p_prep:.3f} | {c_attn:.3f} | {p_attn:.3f} | "
                     f"{(p_prep + p_attn) / (c_prep + c_attn):.3f} | {per_kernel} |")


def _varlen_lines(args, base_cfg: Config) -> list[str]:
    """The varlen batch's table, printed."""
    spec = [tuple(int(x) for x in item.split(":")) for item in args.varlen]
    row, detail = bench_varlen(spec, base_cfg, args.reps, args.seed, not args.no_cudnn)
    lines = ["", "A varlen batch (bit-exact build, prep included, bitwise equal to its sequences launched "
             f"alone): {', '.join(args.varlen)} (rows:keys); {detail}", "",
             "| sequences | rows | keys | hot share | one launch | one by one | one by one / one launch "
             "| TFLOP/s | cuDNN ragged | cuDNN TFLOP/s | APA / cuDNN |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", row]
    print("\n".join(lines[-3:]), flush=True)
    return lines


def _sections(tables: dict) -> list[str]:
    """The optional tables that have rows, each with its title and head."""
    lines = []
    if tables["kernels"]:
        lines += ["", "Each kernel launch of prep and attention (separate launches), ms:", "",
                  "| family | keys | build | sum | launches |", "|---|---:|---|---:|---|", *tables["kernels"]]
    if tables["bounded"]:
        lines += ["", "The bounded schedule (numerics.md §6.7) against the separate launches, bit-exact build, whole "
                  "runs (prep + attention), outputs bitwise equal; device memory the plan holds beyond the inputs, "
                  "MiB per KV head:", "",
                  "| keys | segment tiles | hot share | separate | bounded | bounded / separate | images separate "
                  "| images bounded | other separate | other bounded | K+V inputs |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *tables["bounded"]]
    if tables["chunked"]:
        lines += ["", "Chunked prefill (bit-exact build): the last rows as a frozen chunk of a KV state against the "
                  "same rows as a fresh call, whole apa_gpu.attention calls (host work, prep and attention):", "",
                  "| keys | chunk rows | frozen chunk | fresh call | fresh / frozen |", "|---:|---:|---:|---:|---:|",
                  *tables["chunked"]]
    if tables["paged"]:
        lines += ["", "Paged KV (shuffled pages) against the contiguous layout, bit-exact build, outputs bitwise "
                  "equal:", "", "| keys | page size | prep contiguous | prep paged | attn contiguous | attn paged "
                  "| (prep + attn) paged / contiguous | prep kernels, ms contiguous/paged |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|", *tables["paged"]]
    if tables["windows"]:
        lines += ["", "Sliding window against full causal, the same inputs (separate launches; attn after prep):", "",
                  "| keys | window | hot share | prep | attn exact | attn fast | causal exact | causal fast "
                  "| exact ratio | fast ratio | cuDNN window | cuDNN causal | cuDNN ratio | fast+prep / cuDNN window |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *tables["windows"]]
    return lines


def main(argv=None) -> int:
    args, base_cfg = _arguments(argv)
    lines = _header(args)
    print("\n".join(lines), flush=True)
    tables = {name: [] for name in ("windows", "paged", "chunked", "bounded", "kernels")}
    for family, S in itertools.product(args.family, args.keys):
        t0 = time.time()
        dump = synthetic_preset("llama-3.2-3b", args.rows, S, seed=args.seed, **FAMILIES[family])
        q, k, v = (np.ascontiguousarray(x) for x in (dump.q, dump.k, dump.v))
        p = Problem(family, S, q, k, v, dump.q_offset, base_cfg, base_cfg.replace(exp2="fast"))
        line, base = _main_row(args, p, t0)
        lines.append(line)
        if args.kernels:
            tables["kernels"] += _kernel_rows(args, p)
        if family == args.family[0]:  # the comparisons run on the first family
            _comparisons(args, p, base, tables)
    if args.varlen:
        lines += _varlen_lines(args, base_cfg)
    lines += _sections(tables)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0

if __name__ == "__main__":
    sys.exit(main())
