"""APA against its peers on the same inputs (``apa compare``): APA at any config and other attention
kernels, each run on every (row, head) pair of a dump and measured against float64 attention.

An engine of the comparison is named by a spec (``SPECS``):

- ``apa:KEY=VAL,...``: APA under those Config toggles (``apa`` alone: the default config), on the
  study's engine (the emulator, or the GPU kernel);
- ``sageattention``: SageAttention 1.0.6's real kernels, the engine registered under that name (on a
  CUDA device only); ``sageattention-emu``: its bit-exact recipe (apa_emu.peers.sageattn) on the CPU;
- ``sageattention3-emu``: SageAttention3's NVFP4 recipe as published, emulated on the CPU (apa_emu.peers.sage3;
  it needs sm_120 to run for real); ``sageattention3-emu:causal_dropped_tile=0`` the corrected causal path,
  and any other of its toggles the same way;
- ``sageattention2-emu``: SageAttention2's sm_90 recipe (INT8 Q·K, FP8 P·V), emulated on the CPU
  (apa_emu.peers.sage2), e.g. ``sageattention2-emu:qk_quant_gran=per_warp``;
- ``sdpa-fp16``: torch's FP16 ``scaled_dot_product_attention`` on a CUDA device (its own choice of
  backend), where torch has none an FP16-input, float32 NumPy attention on the CPU, named so;
  ``sdpa:flash``, ``sdpa:efficient``, ``sdpa:cudnn``, ``sdpa:math``: one backend, on CUDA only;
- ``fp16-exact``: float64 attention rounded to FP16, the floor of any kernel with an FP16 output.

A peer kernel that is causal with equal lengths gets the dump padded in front (apa_emu.study.peer_check)
and only the dump's own rows are compared. Each engine's wall time covers its call from inputs already
where it computes to the FP16 output on the host, prep included (the fastest of ``repeat`` runs).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass

import numpy as np

from .. import engines, peers, sfu
from ..call import resolve_call
from ..config import Config
from ..peers import sage2, sage3
from . import fp64
from .engine import reference
from .peer_check import padded

PURE_FP4 = Config(eps=1e9)  # no tile is hot: the gap recovered is measured from this engine's error
PURE_FP4_SPEC = "apa:eps=1e9"
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
SPECS = ("apa:KEY=VAL,...", "sageattention", "sageattention-emu", "sdpa-fp16",
         *(f"sdpa:{b}" for b in SDPA_BACKENDS), "fp16-exact", "sageattention3-emu[:KEY=VAL,...]",
         "sageattention2-emu[:KEY=VAL,...]")
SAGE = "sageattention"
CPU_ROWS = 256  # query rows of one head at a time in the CPU float32 attention


class Unavailable(ValueError):
    """An engine that cannot run here (its words say what is missing): left out, the others run."""


class Contender:
    """One engine of the comparison: ``prepare(dump, ref)`` puts a dump's inputs where it computes
    (untimed), ``call(prepared)`` computes the FP16 output [n, nh, d] of the dump's rows on the host
    (timed). ``hot``: (hot tiles, tiles) of the last call, for APA."""

    timed = True
    hot = None

    def __init__(self, spec: str, label: str, device: str):
        self.spec, self.label, self.device = spec, label, device

    def lacks(self, dump) -> str | None:
        return None

    def scale(self, d: int) -> float:
        return float(Config().softmax_scale(d))


class Apa(Contender):
    def __init__(self, spec: str, cfg: Config, baseline: bool = False):
        super().__init__(spec, "pure FP4, the baseline of the gap recovered" * baseline, "")
        self.cfg, self.engine, self.baseline = cfg, None, baseline

    def attach(self, engine) -> None:
        self.engine = engine
        self.device = "cpu emulator" if engine.name == "cpu" else engine.name

    def scale(self, d: int) -> float:
        return float(self.cfg.softmax_scale(d))

    def prepare(self, dump, ref):
        return tuple(self.engine.put(x) for x in (dump.q, dump.k, dump.v)) + (dump.q_offset,)

    def call(self, prepared):
        q, k, v, q_offset = prepared
        call = resolve_call(q, k, v, q_offset)
        with engines.guarded(f"engine {self.engine.name} raised", errors=False):
            res = engines.as_result(self.engine.name, self.engine.run(call, self.cfg), call, self.cfg)
        self.hot = (res.hot_tiles, res.active_tiles) if res.hot_tiles is not None else None
        return res.out


class Padded(Contender):
    """A peer kernel that is causal with equal lengths: the dump padded in front, its rows compared."""

    def prepare(self, dump, ref):
        q, k, v, first = padded(dump)
        return self.put(q, k, v), first

    def put(self, q, k, v):
        return q, k, v


class SageEmu(Padded):
    """A peer recipe run on the CPU: SageAttention 1.0.6's (default) or another of ``peers.RECIPES``
    with its keyword toggles."""

    def __init__(self, spec: str = "sageattention-emu", recipe: str = SAGE, toggles: dict | None = None):
        self.recipe, self.toggles = peers.recipe(recipe), toggles or {}
        label = "SageAttention 1.0.6's bit-exact recipe (numerics.md §14)" if recipe == SAGE else \
            f"{self.recipe.title}" + "".join(f", {k}={v}" for k, v in self.toggles.items())
        super().__init__(spec, label, "cpu recipe")
        try:
            self.tables = sfu.tables()
        except (OSError, ValueError) as e:
            raise Unavailable(f"the special-function tables cannot be read: {e}") from None

    def lacks(self, dump) -> str | None:
        return _sage_lacks(self.recipe, dump)

    def call(self, prepared):
        (q, k, v), first = prepared
        return self.recipe.load().run(q, k, v, tables=self.tables, **self.toggles).out[first:]


def _sage_lacks(recipe, dump) -> str | None:
    if dump.hd not in recipe.head_dims:
        return f"head dim {dump.hd} (SageAttention runs {', '.join(map(str, recipe.head_dims))})"
    return None


def _cuda_torch(what: str):
    """torch, when it sees a CUDA device; else Unavailable naming what ``what`` lacks."""
    if importlib.util.find_spec("torch") is None:
        raise Unavailable(f"{what} needs torch, which is not installed")
    import torch

    if not torch.cuda.is_available():
        raise Unavailable(f"{what} needs a CUDA device, and torch sees none")
    return torch


def _torch_nhd(torch, *arrays):
    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to("cuda") for x in arrays)


class SageReal(Padded):
    """SageAttention's real kernels through the engine registered as "sageattention" (apa_gpu), found
    by name as ``apa check --engine sageattention`` finds it."""

    def __init__(self):
        try:
            cls = engines.load(SAGE)
        except (KeyError, ValueError) as e:
            raise Unavailable(e.args[0] if e.args else str(e)) from None
        with engines.guarded(f"engine {SAGE} raised"):
            why = cls.missing()
        if why:
            raise Unavailable(why)
        self.torch = _cuda_torch(SAGE)
        super().__init__(SAGE, "SageAttention 1.0.6's kernels (INT8 Q·K, FP16 P·V)",
                         self.torch.cuda.get_device_name())
        self.engine, self.recipe = cls(), peers.recipe(SAGE)

    def lacks(self, dump) -> str | None:
        return _sage_lacks(self.recipe, dump)

    def put(self, q, k, v):
        return _torch_nhd(self.torch, q, k, v)

    def call(self, prepared):
        (q, k, v), first = prepared
        with engines.guarded(f"engine {SAGE} raised"):
            out = self.engine.run_peer(q, k, v).out
        out = np.asarray(out.cpu() if hasattr(out, "cpu") else out)
        if out.shape != tuple(q.shape) or out.dtype != np.float16:
            raise engines.EngineError(f"engine {SAGE} returned an output of shape {out.shape} and dtype "
                                      f"{out.dtype}, expected q's {tuple(q.shape)} float16")
        return out[first:]


class Sdpa(Padded):
    """torch's FP16 scaled_dot_product_attention, causal (top-left aligned, hence the padding), the
    KV heads repeated for the query heads they serve before the timed call."""

    def __init__(self, backend: str | None):
        spec = f"sdpa:{backend}" if backend else "sdpa-fp16"
        self.torch = _cuda_torch(spec)
        super().__init__(spec, f"torch {self.torch.__version__} scaled_dot_product_attention in FP16, "
                               f"{backend or 'its default backend'}", self.torch.cuda.get_device_name())
        self.backend = backend

    def put(self, q, k, v):
        group = q.shape[1] // k.shape[1]
        q, k, v = _torch_nhd(self.torch, q, k, v)
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        return tuple(x.transpose(0, 1)[None].contiguous() for x in (q, k, v))

    def call(self, prepared):
        (q, k, v), first = prepared
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
        backends = [which[self.backend]] if self.backend else list(which.values())
        with sdpa_kernel(backends):
            out = sdpa(q, k, v, is_causal=True, scale=self.scale(q.shape[-1]))
        return out[0].transpose(0, 1).cpu().numpy()[first:]


class CpuF32(Contender):
    """sdpa-fp16 where torch has no CUDA device: FP16 inputs, binary32 scores, softmax and P·V in
    NumPy, the output rounded to FP16. A stand-in for an FP16 kernel's accuracy, not for its time."""

    def __init__(self, why: str):
        super().__init__("sdpa-fp16", f"not torch's SDPA ({why}): FP16 inputs and output, float32 scores, "
                                      "softmax and P·V in NumPy on the CPU", "cpu numpy")

    def prepare(self, dump, ref):
        return dump

    def call(self, dump):
        out = np.empty(dump.q.shape, np.float16)
        scale = np.float32(self.scale(dump.hd))
        keys = np.arange(dump.kv)
        for h in range(dump.nh):
            k, v = (x[:, h // dump.group].astype(np.float32) for x in (dump.k, dump.v))
            for r0 in range(0, dump.n, CPU_ROWS):
                q = dump.q[r0:r0 + CPU_ROWS, h].astype(np.float32)
                s = (q @ k.T) * scale  # ok: float32 FP16-kernel stand-in
                s[keys[None, :] > dump.q_offset + np.arange(r0, r0 + len(q))[:, None]] = -np.inf
                p = np.exp(s - s.max(axis=1, keepdims=True))
                out[r0:r0 + len(q), h] = ((p @ v) / p.sum(axis=1, keepdims=True)).astype(np.float16)  # ok: float32
        return out


class Exact(Contender):
    """float64 attention rounded to FP16: what the FP16 output alone costs. Not a kernel: no time."""

    timed = False

    def __init__(self):
        super().__init__("fp16-exact", "float64 attention rounded to FP16 (not a kernel: no time)", "-")

    def prepare(self, dump, ref):
        return ref

    def call(self, ref):
        return ref.astype(np.float16)


def _sdpa_fp16():
    try:
        return Sdpa(None)
    except Unavailable as e:
        return CpuF32(str(e))


def parse_spec(text: str, base: Config | None = None):
    """What builds the engine a spec names (nothing is built yet), an ``apa:`` spec's toggles on top of
    ``base``; a ValueError of one line listing the valid specs when there is none."""
    name, sep, rest = text.partition(":")
    if name == "apa":
        try:
            cfg = Config.from_overrides([x for x in rest.split(",") if x.strip()] if sep else [], base=base)
        except ValueError as e:
            raise ValueError(f"engine {text!r}: {e}") from None
        return lambda: Apa(text, cfg)
    if name in _EMULATED:
        return _emulated(text, name, rest)
    if name == "sdpa" and sep and rest in SDPA_BACKENDS:
        return lambda: Sdpa(rest)
    known = {SAGE: SageReal, "sageattention-emu": SageEmu, "sdpa-fp16": _sdpa_fp16, "fp16-exact": Exact}
    if text not in known:
        raise ValueError(f"engine {text!r}: expected one of {', '.join(SPECS)}")
    return known[text]


_EMULATED = {"sageattention3-emu": ("sageattention3", sage3), "sageattention2-emu": ("sageattention2", sage2)}


def _emulated(text: str, name: str, rest: str):
    """An emulated peer recipe under the spec's toggles, e.g. ``sageattention3-emu:causal_dropped_tile=0``
    (numerics.md §15) for the corrected causal path, ``sageattention2-emu:pv_accum=fp32`` (§16)."""
    recipe, module = _EMULATED[name]
    try:
        toggles = module.parse_toggles(rest)
    except ValueError as e:
        raise ValueError(f"engine {text!r}: {e}") from None
    return lambda: SageEmu(text, recipe, toggles)


def contenders(specs, note, base: Config | None = None) -> list[Contender]:
    """The engines of ``specs`` (each checked by ``parse_spec`` first, so a bad one is refused before
    any is built) that can run here, APA's toggles on top of ``base``; ``note(line)`` names each one
    left out and why. Pure FP4 (``PURE_FP4_SPEC`` on ``base``) is added last, as the baseline, unless
    a spec names it."""
    base = base or Config()
    fp4 = base.replace(eps=PURE_FP4.eps)
    makers = {spec: parse_spec(spec, base) for spec in dict.fromkeys(specs)}
    chosen = []
    for spec, make in makers.items():
        try:
            chosen.append(make())
        except Unavailable as e:
            note(f"{spec} left out: {e}")
    listed = next((c for c in chosen if isinstance(c, Apa) and c.cfg == fp4), None)
    if listed:
        listed.baseline = True
    else:
        chosen.append(Apa(PURE_FP4_SPEC, fp4, baseline=True))
    return chosen


def float64_reference(engine, dump, scale: float) -> np.ndarray:
    """Float64 attention of every (row, head) of the dump [n, nh, d], on the host; computed one KV head
    at a time where ``engine`` keeps its arrays (apa_emu.study.fp64)."""
    G = dump.group
    rows, heads = np.repeat(np.arange(dump.n), G), np.tile(np.arange(G), dump.n)
    out = np.empty((dump.n, dump.nh, dump.hd))
    for hk in range(dump.nkv):
        q, k, v = (engine.put(np.ascontiguousarray(x)) for x in
                   (dump.q[:, hk * G:(hk + 1) * G], dump.k[:, hk:hk + 1], dump.v[:, hk:hk + 1]))
        ref = reference(engine, q, k, v, dump.q_offset, rows, heads, scale)
        out[:, hk * G:(hk + 1) * G] = fp64.host(ref.out).reshape(dump.n, G, dump.hd)
    return out


@dataclass
class Measure:
    """One engine on a set of pairs: cosine and relative L2 of each pair against float64 attention,
    whether its output is finite, pure FP4's relative L2 on the same pairs (``fp4_rel``), the wall
    time (None: not a kernel) and, for APA, (hot tiles, tiles)."""

    spec: str
    label: str
    device: str
    cos: np.ndarray
    rel: np.ndarray
    finite: np.ndarray
    seconds: float | None
    hot: tuple | None
    fp4_rel: np.ndarray | None = None

    @classmethod
    def pooled(cls, parts: list["Measure"]) -> "Measure":
        cat = lambda name: np.concatenate([getattr(m, name) for m in parts])  # noqa: E731
        seconds = None if any(m.seconds is None for m in parts) else sum(m.seconds for m in parts)
        hot = None if any(m.hot is None for m in parts) else tuple(map(sum, zip(*(m.hot for m in parts))))
        return cls(parts[0].spec, parts[0].label, parts[0].device, cat("cos"), cat("rel"), cat("finite"), seconds,
                   hot, cat("fp4_rel"))

    def stats(self) -> dict:
        """The table's numbers; the cosines and relative L2 over the finite pairs, the gap recovered over
        the pairs finite under both this engine and pure FP4: 1 − mean(rel L2) / mean(pure FP4's)."""
        f = self.finite
        cos, rel = self.cos[f], self.rel[f]
        both = f & np.isfinite(self.fp4_rel)
        fp4 = float(self.fp4_rel[both].mean()) if both.any() else np.nan
        some = cos.size > 0
        return dict(engine=self.spec, device=self.device, pairs=int(f.size),
                    worst_cos=float(cos.min()) if some else np.nan, below_0_999=int((cos < 0.999).sum()),
                    below_0_99=int((cos < 0.99).sum()), mean_cos=float(cos.mean()) if some else np.nan,
                    rel_l2_median=float(np.median(rel)) if some else np.nan,
                    rel_l2_p99=float(np.quantile(rel, 0.99)) if some else np.nan,
                    rel_l2_max=float(rel.max()) if some else np.nan,
                    gap_recovered=1.0 - float(self.rel[both].mean()) / fp4 if fp4 > 0 else np.nan,
                    seconds=self.seconds, hot_share=self.hot[0] / self.hot[1] if self.hot and self.hot[1] else None,
                    nonfinite=int((~f).sum()), label=self.label)


def _timed(c: Contender, dump, ref, repeat: int, step):
    """The engine's output on the dump and its fastest wall time of ``repeat`` calls (None: untimed)."""
    prepared = c.prepare(dump, ref)
    best = np.inf
    for _ in range(repeat):
        start = time.perf_counter()
        out = c.call(prepared)
        best = min(best, time.perf_counter() - start)
        step()
    return np.asarray(out), best if c.timed else None


def _measure(c: Contender, dump, ref, repeat: int, step) -> Measure:
    out, seconds = _timed(c, dump, ref, repeat, step)
    sums = fp64.pair_sums(np, out.reshape(-1, dump.hd), ref.reshape(-1, dump.hd))
    cos, rel = fp64.cos_rel(sums)
    return Measure(c.spec, c.label, c.device, cos, rel, np.isfinite(out).reshape(-1, dump.hd).all(axis=1), seconds,
                   c.hot)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def measure_dump(dump, name: str, chosen: list[Contender], engine, *, repeat: int, note, step) -> list[Measure]:
    """Every engine that can run the dump, measured on its every (row, head) pair, pure FP4's relative
    L2 attached to each; an engine that lacks the dump, or a peer that fails on it, is named in one
    ``note`` line and left out. APA's own failures are the command's."""
    refs, done = {}, []
    for c in chosen:
        why = c.lacks(dump)
        if why:
            note(f"{c.spec} left out of {name}: it does not run {why}")
            step(repeat)
            continue
        scale = c.scale(dump.hd)
        if scale not in refs:
            refs[scale] = float64_reference(engine, dump, scale)
        try:
            done.append(_measure(c, dump, refs[scale], repeat, lambda: step(1)))
        except Exception as e:
            if isinstance(c, Apa):
                raise
            note(f"{c.spec} left out of {name}: {_first_line(e)}")
    fp4 = next(m for m in done if m.spec == baseline(chosen).spec)
    for m in done:
        m.fp4_rel = fp4.rel
    return done


def baseline(chosen: list[Contender]) -> "Apa":
    """The pure FP4 engine among ``contenders``'s."""
    return next(c for c in chosen if isinstance(c, Apa) and c.baseline)


def compare(dumps, names, chosen: list[Contender], engine, *, repeat: int = 1, note=print, progress=None):
    """Each dump's measures ([dump][engine that ran it]); ``engine`` runs the APA specs and the float64
    reference (on its device); ``progress(done, total)`` counts the engines' calls."""
    for c in chosen:
        if isinstance(c, Apa):
            c.attach(engine)
    total, done = len(dumps) * len(chosen) * repeat, [0]

    def step(n: int = 1):
        done[0] += n
        if progress:
            progress(done[0], total)

    results = []
    with engine.context():
        for dump, name in zip(dumps, names):
            results.append(measure_dump(dump, name, chosen, engine, repeat=repeat, note=note, step=step))
            engine.release()
    return results


def pooled(results) -> list[Measure]:
    """Each engine's pairs of every dump it ran, as one Measure, in the order the engines first ran."""
    by_spec = {}
    for measures in results:
        for m in measures:
            by_spec.setdefault(m.spec, []).append(m)
    return [Measure.pooled(parts) for parts in by_spec.values()]
