"""Synthetic attention problems with the structure of real prefill attention, for shapes no real dump covers.

Every knob is in units of the scaled logit q·k/√d, so its effect on the softmax reads directly:

* base: every Q and K channel carries N(0, 1) noise, so the logits of a row scatter about N(0, 1).
* ``sink``: key 0 gains ``sink`` over every other key, through one channel (the lowest RoPE
  frequency, where real models put their sinks) that is large in every query and in key 0 and
  zero in all other keys. With 2048 keys and the other defaults, ``sink`` = 8 gives key 0 a
  quarter to two fifths of a row's mass (half without locality), as in the shipped SmolLM2 dump.
* ``locality``: a RoPE-rotated direction shared by the queries and keys of a KV head adds
  ``locality`` · mean_f cos((i − j)·θ_f) to the logit of query position i and key position j, the
  mean over the d/2 − 1 rotation pairs f outside the sink's, with θ_f = 10000^(−2f/d): the full
  ``locality`` on the diagonal, falling off over tens to thousands of keys as the fast frequencies
  decorrelate, the relative-position structure of RoPE.
* ``diffuse_heads``: this fraction of the query heads (rounded, chosen by the seed) has queries
  shrunk to a tenth of the noise and no sink or locality: nearly flat rows whose mass spreads over
  every key.
* ``channel_offset``: each KV head's keys share a per-channel mean drawn as N(0, channel_offset²).
  It moves every logit of a row by the same amount (the softmax is unchanged); APA's mean-centring
  of K removes it, and without that it costs FP4 range. The default 1.5 gives a mean-key norm of
  12 at d = 64, close to the 12 to 13 of the shipped SmolLM2 dump.
* ``outliers``: each noise element of Q, K and V becomes, with this probability, ±16 (sixteen
  times the noise scale): the rare large values that stress block scales. The sink channel is
  exempt, so an outlier never makes a second sink.

Deterministic: the same arguments give the same arrays (NumPy's PCG64 streams, seeded per tensor
and head, so K and V of a KV head depend only on the seed, that head, kv, hd and the knobs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .dump import HEAD_DIMS, Dump

ROPE_BASE = 10000.0
OUTLIER_SCALE = 16.0
DIFFUSE_Q_SCALE = 0.1
PRESETS = {
    "llama-3.2-3b": dict(nh=24, nkv=8, hd=128),
    "smollm2-135m": dict(nh=9, nkv=3, hd=64),
}
# Input families for benchmarks, as knob sets of ``synthetic``: its defaults, and one with twice the
# channel offsets and ten times the outliers (wider FP4 block ranges; hot share 0.256 against 0.201 at
# 2048 × 122880, Llama-3.2-3B heads, ε = 0.005, measured on the H200, docs/results/performance-log.md).
FAMILIES = {"real-like": {}, "outlier-heavy": dict(channel_offset=3.0, outliers=1e-3)}
_F16_MAX = float(np.finfo(np.float16).max)
# Stream tags: each tensor and head draws from its own seeded stream.
_K, _V, _Q, _DIRECTION, _DIFFUSE = range(5)


def synthetic(
    n: int,
    kv: int,
    nh: int,
    nkv: int,
    hd: int,
    *,
    seed: int,
    sink: float = 8.0,
    locality: float = 4.0,
    diffuse_heads: float = 0.25,
    channel_offset: float = 1.5,
    outliers: float = 1e-4,
    q_offset: int | None = None,
) -> Dump:
    """A causal problem of n query rows against kv keys (FP16); the knobs are described in the module
    docstring. ``q_offset`` None puts the queries on the last n positions (kv − n), as in prefill."""
    _check_shape(n, kv, nh, nkv, hd, seed)
    q_offset = kv - n if q_offset is None else q_offset
    if not 0 <= q_offset <= kv - n:
        raise ValueError(
            f"q_offset = {q_offset}: must be in 0..kv − n = {kv - n} (n = {n} rows, kv = {kv} keys)"
        )
    for name, value in (("sink", sink), ("locality", locality), ("channel_offset", channel_offset)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} = {value}: must be finite and non-negative")
    for name, value in (("diffuse_heads", diffuse_heads), ("outliers", outliers)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name} = {value}: must be a fraction in [0, 1]")
    heads = _Heads.of(seed, nkv, hd, sink, locality, outliers)
    k, v = _keys_values(heads, kv, channel_offset)
    diffuse = np.zeros(nh, dtype=bool)
    diffuse[np.random.default_rng([seed, _DIFFUSE]).permutation(nh)[: round(diffuse_heads * nh)]] = True
    return Dump(_queries(heads, n, q_offset, diffuse), k, v, q_offset)


def synthetic_bytes(n: int, kv: int, nh: int, nkv: int, hd: int) -> int:
    """About the peak memory of ``synthetic``: q, k and v in FP16, the float64 key rotation tables
    and the float64 draws of one head (a few arrays of max(n, kv) × hd), and the head permutation."""
    return 2 * (n * nh * hd + 2 * kv * nkv * hd) + 8 * kv * hd + 3 * 8 * max(n, kv) * hd + 8 * nh


def _check_shape(n, kv, nh, nkv, hd, seed) -> None:
    for name, value in (("n", n), ("kv", kv), ("nh", nh), ("nkv", nkv), ("hd", hd), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    for name, value in (("n", n), ("kv", kv), ("nh", nh), ("nkv", nkv)):
        if value < 1:
            raise ValueError(f"{name} = {value}: must be positive")
    if seed < 0:
        raise ValueError(f"seed = {seed}: must be non-negative")
    if nh % nkv:
        raise ValueError(f"nh = {nh} is not a multiple of nkv = {nkv}")
    if hd not in HEAD_DIMS:
        raise ValueError(f"hd = {hd}: supported head dims are {', '.join(map(str, HEAD_DIMS))}")


@dataclass(frozen=True)
class _Heads:
    """What the draws of every head share: the seed, the sink and locality knobs as channel amplitudes,
    the RoPE frequencies and each KV head's unit locality direction."""

    seed: int
    hd: int
    outliers: float
    sink_channel: int
    sink_amp: float
    loc_amp: float
    theta: np.ndarray  # [hd/2] RoPE frequencies
    directions: list[np.ndarray]  # [nkv] of [hd]

    @classmethod
    def of(cls, seed: int, nkv: int, hd: int, sink: float, locality: float, outliers: float) -> "_Heads":
        root_d = math.sqrt(hd)
        half = hd // 2
        sink_channel = half - 1  # lowest-frequency channel of the rotate-half layout
        # One unit locality direction per KV head, spread evenly over the rotation pairs with random
        # phases, so its diagonal logit is exactly ``locality``; the sink's pair stays free of it.
        amp = np.full(half, 1 / math.sqrt(half - 1))
        amp[sink_channel] = 0.0
        directions = []
        for g in range(nkv):
            phase = np.random.default_rng([seed, _DIRECTION, g]).uniform(0, 2 * np.pi, size=half)
            directions.append(np.concatenate([amp * np.cos(phase), amp * np.sin(phase)]))
        # Split each knob's logit evenly between the query and key factors of the product.
        return cls(seed, hd, outliers, sink_channel, math.sqrt(sink * root_d), math.sqrt(locality * root_d),
                   ROPE_BASE ** (-np.arange(half, dtype=np.float64) * 2 / hd), directions)

    def noise(self, tag: int, head: int, rows: int):
        """The seeded stream of one tensor's head and its N(0, 1) draws with outliers, [rows, hd]."""
        rng = np.random.default_rng([self.seed, tag, head])
        return rng, _add_outliers(rng.standard_normal((rows, self.hd)), rng, self.outliers)


def _keys_values(heads: _Heads, kv: int, channel_offset: float) -> tuple[np.ndarray, np.ndarray]:
    nkv = len(heads.directions)
    k = np.empty((kv, nkv, heads.hd), dtype=np.float16)
    v = np.empty((kv, nkv, heads.hd), dtype=np.float16)
    # The rotation tables depend only on the positions: computed once, shared by all heads.
    key_rot = _rotation(np.arange(kv), heads.theta)
    for g in range(nkv):
        rng, x = heads.noise(_K, g, kv)
        x[:, heads.sink_channel] = 0.0
        x[0, heads.sink_channel] = heads.sink_amp
        x += heads.loc_amp * _rotate(heads.directions[g], *key_rot)
        x += channel_offset * rng.standard_normal(heads.hd)
        k[:, g] = _to_f16(x, "k")
        _, x = heads.noise(_V, g, kv)
        v[:, g] = _to_f16(x, "v")
    return k, v


def _queries(heads: _Heads, n: int, q_offset: int, diffuse: np.ndarray) -> np.ndarray:
    nh = diffuse.size
    q = np.empty((n, nh, heads.hd), dtype=np.float16)
    q_rot = _rotation(np.arange(q_offset, q_offset + n), heads.theta)
    group = nh // len(heads.directions)
    for h in range(nh):
        _, x = heads.noise(_Q, h, n)
        if diffuse[h]:
            x *= DIFFUSE_Q_SCALE
        else:
            x[:, heads.sink_channel] = heads.sink_amp
            x += heads.loc_amp * _rotate(heads.directions[h // group], *q_rot)
        q[:, h] = _to_f16(x, "q")
    return q


def synthetic_preset(name: str, n: int, kv: int, *, seed: int, **knobs) -> Dump:
    """``synthetic`` with the head layout of a named model: "llama-3.2-3b" (24 query heads, 8 KV
    heads, d = 128, the model of the seed's dumps) or "smollm2-135m" (9, 3, 64)."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r}: expected one of {', '.join(PRESETS)}")
    return synthetic(n, kv, **PRESETS[name], seed=seed, **knobs)


def _rotation(positions: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angle = positions[:, None].astype(np.float64) * theta[None, :]
    return np.cos(angle), np.sin(angle)


def _rotate(direction: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE (rotate-half layout) applied to one direction at many positions: [len(positions), d]."""
    half = cos.shape[1]
    a, b = direction[:half], direction[half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=1)


def _add_outliers(x: np.ndarray, rng: np.random.Generator, rate: float) -> np.ndarray:
    if rate > 0:
        hit = rng.random(x.shape) < rate
        x[hit] = OUTLIER_SCALE * rng.choice([-1.0, 1.0], size=int(hit.sum()))
    return x


def _to_f16(x: np.ndarray, name: str) -> np.ndarray:
    peak = float(np.abs(x).max())
    if peak > _F16_MAX:
        raise ValueError(f"the knobs push |{name}| to {peak:.6g}, past the FP16 maximum 65504")
    return x.astype(np.float16)
