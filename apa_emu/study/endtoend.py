"""The model end to end (``apa model``): a model run teacher-forced over a text with the attention of
its layers computed by an engine of ``apa compare`` (apa_emu.study.versus), measured against the same
model with its own float32 attention.

Only attention changes: the model state around it stays float32, so every difference is the
engine's. An engine sees each layer's Q, K and V rounded to FP16 (as a dump holds them) and returns
its FP16 output, which the model takes back as float32. The measures are computed in float64 from the
two runs' logits, position by position (``Positions``), then pooled per context-length bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import fp64, versus
from .dump import Dump
from .lm import F16_MAX

# Context-length buckets (first, last tokens of context, label); a bucket is reported when it holds a
# position.
BUCKETS = ((1, 2048, "<= 2k"), (2049, 8192, "2k-8k"), (8193, 32768, "8k-32k"), (32769, math.inf, "> 32k"))
# float64 logits held at once while the measures are computed: rows x vocabulary
_LOGIT_ELEMENTS = 1 << 23


def full_layers(model) -> tuple[int, ...]:
    """The layers an engine computes: those of full causal attention (Gemma 3's windowed local layers
    keep the model's own attention: the engines of apa compare run plain causal attention)."""
    return tuple(getattr(model.hp, "global_layers", range(model.hp.n_layer)))


@dataclass
class LayerStat:
    """What one layer's engine call gave: (hot tiles, visited tiles) for APA, and the lowest cosine of a
    (row, head) output against float64 attention of the same FP16 inputs (NaN when not measured)."""

    hot: tuple[int, int] | None = None
    worst_cos: float = math.nan
    nonfinite: int = 0


@dataclass
class Swap:
    """An ``attend`` hook: the layers in ``layers`` computed by ``contender`` (a versus.Contender, its
    float64 reference and APA's by ``engine``), the others by the model's own attention. ``cosines``:
    measure each swapped layer's worst pair (a float64 attention of the layer). ``stats``: per layer."""

    model: object
    contender: versus.Contender
    engine: object
    layers: frozenset
    cosines: bool = False
    stats: dict = field(default_factory=dict)

    def __call__(self, layer: int, q, k, v):
        if layer not in self.layers:
            return self.model.attend(layer, q, k, v)
        dump = Dump(*(fp16(x, name, layer) for x, name in ((q, "Q"), (k, "K"), (v, "V"))), 0)
        c = self.contender
        need_ref = isinstance(c, versus.Exact) or self.cosines
        ref = versus.float64_reference(self.engine, dump, c.scale(dump.hd)) if need_ref else None
        out = np.asarray(c.call(c.prepare(dump, ref)))
        finite = np.isfinite(out).all(axis=-1)
        stat = LayerStat(hot=c.hot, nonfinite=int((~finite).sum()))
        if self.cosines and finite.any():
            cos, _ = fp64.cos_rel(fp64.pair_sums(np, out.reshape(-1, dump.hd), ref.reshape(-1, dump.hd)))
            stat.worst_cos = float(cos[finite.reshape(-1)].min())
        self.stats[layer] = stat
        return like(out.astype(np.float32), q)


def host(x) -> np.ndarray:
    """A torch tensor's values as a NumPy array on the host; a NumPy array as it is."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def like(out: np.ndarray, q):
    """``out`` as the model's arrays are: NumPy, or a torch tensor on q's device."""
    if hasattr(q, "detach"):
        import torch

        return torch.from_numpy(out).to(q.device)
    return out


def fp16(x, name: str, layer: int) -> np.ndarray:
    """A layer's attention input rounded to FP16, refused (OverflowError) past FP16's range."""
    x = host(x)
    peak = float(np.abs(x).max())
    if not peak <= F16_MAX:
        raise OverflowError(f"layer {layer}: {name} reaches |x| = {peak:.6g}, past the FP16 maximum 65504: "
                            "an FP16 attention kernel cannot take it")
    return np.ascontiguousarray(x.astype(np.float16))


class _Rows:
    """Row reductions and elementwise functions of NumPy arrays or torch tensors, so the measures of a
    torch model run where its logits are (a 32768 x 262144 float64 projection is 69 GB: on the host,
    NumPy's single-threaded exp would take minutes per run)."""

    def __init__(self, z):
        self.torch = hasattr(z, "detach")
        if self.torch:
            import torch

            self.xp, self.device = torch, z.device
        else:
            self.xp, self.device = np, None

    def reduce(self, z, op: str, keep: bool = False):
        if self.torch:
            return getattr(z, {"max": "amax"}.get(op, op))(dim=1, keepdim=keep)
        return getattr(z, op)(axis=1, keepdims=keep)

    def index(self, a: np.ndarray):
        return self.xp.as_tensor(a, device=self.device) if self.torch else a


def log_softmax(z, rows: _Rows | None = None):
    """Row-wise log-softmax of float64 logits (NumPy or torch)."""
    rows = rows or _Rows(z)
    shifted = z - rows.reduce(z, "max", keep=True)
    return shifted - rows.xp.log(rows.reduce(rows.xp.exp(shifted), "sum", keep=True))


@dataclass
class Positions:
    """Per predicted position i (the model has seen tokens 0..i and predicts token i + 1): the KL
    divergence KL(base ‖ engine) of the next-token distributions, whether the top tokens agree, the
    engine's minus the base's probability of the reference token, both negative log-likelihoods of
    it, and whether the engine's logits are all finite (the other measures count only where they are)."""

    kld: np.ndarray
    same_top: np.ndarray
    dp: np.ndarray
    nll_base: np.ndarray
    nll: np.ndarray
    finite: np.ndarray

    @property
    def context(self) -> np.ndarray:
        """Tokens of context of each position: i + 1."""
        return np.arange(1, self.kld.size + 1)


def as_f64(z):
    """Logits as float64 where they are: a torch tensor stays on its device."""
    return z.double() if hasattr(z, "detach") else np.asarray(z, dtype=np.float64)


def positions(model, tokens: np.ndarray, base_hidden, hidden) -> Positions:
    """The per-position measures of a run (final hidden states ``hidden``) against the base run's,
    the logits projected and compared a block of rows at a time."""
    n = tokens.size - 1
    rows = max(1, _LOGIT_ELEMENTS // model.embd.shape[0])
    parts = []
    for s in range(0, n, rows):
        e = min(n, s + rows)
        z0, z1 = (as_f64(model.logits(h[s:e])) for h in (base_hidden, hidden))
        parts.append(_block(z0, z1, tokens[s + 1:e + 1]))
    return Positions(*(np.concatenate(a) for a in zip(*parts)))


def _block(z0, z1, ref: np.ndarray) -> tuple:
    rows = _Rows(z0)
    xp = rows.xp
    finite = rows.reduce(xp.isfinite(z1), "all")
    z1 = xp.where(finite[:, None], z1, z0)  # a non-finite row is counted, never averaged in
    lp0, lp1 = log_softmax(z0, rows), log_softmax(z1, rows)
    kld = rows.reduce(xp.exp(lp0) * (lp0 - lp1), "sum")
    r, ref = rows.index(np.arange(ref.size)), rows.index(ref)
    ref0, ref1 = lp0[r, ref], lp1[r, ref]
    same = rows.reduce(z0, "argmax") == rows.reduce(z1, "argmax")
    return tuple(host(a) for a in (kld, same, xp.exp(ref1) - xp.exp(ref0), -ref0, -ref1, finite))


def summary(p: Positions, first: int = 1, last: float = math.inf) -> dict:
    """The measures pooled over the positions with ``first``..``last`` tokens of context whose logits
    are finite (see the command's help for each definition)."""
    ctx = p.context
    inside = (ctx >= first) & (ctx <= last)
    m = inside & p.finite
    kld = p.kld[m]
    some = kld.size > 0
    return dict(positions=int(inside.sum()), nonfinite=int((inside & ~p.finite).sum()),
                ppl_ratio=float(np.exp(p.nll[m].mean() - p.nll_base[m].mean())) if some else math.nan,
                kld_mean=float(kld.mean()) if some else math.nan,
                kld_p99=float(np.quantile(kld, 0.99)) if some else math.nan,
                kld_p999=float(np.quantile(kld, 0.999)) if some else math.nan,
                same_top=100.0 * float(p.same_top[m].mean()) if some else math.nan,
                rms_dp=float(np.sqrt(np.mean(p.dp[m] ** 2))) if some else math.nan)  # ok: a float64 metric


def buckets(p: Positions) -> list[dict]:
    """``summary`` per context-length bucket that holds a position, then over all positions."""
    n = p.kld.size
    rows = [dict(bucket=label, **summary(p, first, last)) for first, last, label in BUCKETS if first <= n]
    return rows + [dict(bucket="all", **summary(p))] if len(rows) > 1 else rows


@dataclass
class Run:
    """One engine in every full layer at once: its per-position measures and each layer's LayerStat."""

    spec: str
    label: str
    device: str
    positions: Positions
    layers: dict[int, LayerStat]

    def hot_share(self) -> float | None:
        """APA: the share of visited key tiles sent to pass 2, over all its layers."""
        hot = [s.hot for s in self.layers.values() if s.hot is not None]
        total = sum(h[1] for h in hot)
        return sum(h[0] for h in hot) / total if total else None


class Passes:
    """Forward passes over one token sequence, the base pass's final hidden states kept (not its
    logits: a 32768 x 262144 float array would not fit), ``progress(done, total)`` counting layers over
    ``passes`` passes."""

    def __init__(self, model, tokens: np.ndarray, passes: int, progress=None):
        self.model, self.tokens, self.progress = model, tokens, progress
        self.total, self.done = passes * model.hp.n_layer, 0
        self.base = self.hidden(None)

    def hidden(self, attend):
        done = self.done
        step = (lambda i, _: self.progress(done + i, self.total)) if self.progress else None
        hidden, _ = self.model.forward(self.tokens, progress=step, attend=attend)
        self.done += self.model.hp.n_layer
        return hidden

    def measure(self, attend) -> Positions:
        return positions(self.model, self.tokens, self.base, self.hidden(attend))


def lacking(model, contender) -> str | None:
    """Why ``contender`` cannot run the model's attention (its head dim), or None."""
    hp = model.hp
    probe = np.zeros((1, hp.n_head, hp.head_dim), np.float16), np.zeros((1, hp.n_head_kv, hp.head_dim), np.float16)
    return contender.lacks(Dump(probe[0], probe[1], probe[1], 0))


def every_layer(passes: Passes, contenders, engine) -> list[Run]:
    """Each engine in every full layer at once (``full_layers``); the worst pair of each layer is
    measured for the APA engines."""
    runs = []
    layers = frozenset(full_layers(passes.model))
    for c in contenders:
        swap = Swap(passes.model, c, engine, layers, cosines=isinstance(c, versus.Apa))
        runs.append(Run(c.spec, c.label, c.device, passes.measure(swap), swap.stats))
    return runs


def per_layer(passes: Passes, contenders, engine) -> dict[str, dict[int, dict]]:
    """Each engine in one full layer at a time: ``summary`` of every position, by engine spec and layer."""
    out = {}
    for c in contenders:
        out[c.spec] = {layer: summary(passes.measure(Swap(passes.model, c, engine, frozenset([layer]))))
                       for layer in full_layers(passes.model)}
    return out
