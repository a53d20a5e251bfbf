"""Synthetic dumps: shapes, determinism, and each knob's effect measured with a float64 softmax."""

import numpy as np
import pytest

from apa_emu.study.dump import read_dump, write_dump
from apa_emu.study.synth import FAMILIES, PRESETS, synthetic, synthetic_preset


def _probs(d, h):
    """Causal float64 softmax of query head h over all keys: [n, kv]."""
    q = d.q[:, h].astype(np.float64)
    k = d.k[:, h // d.group].astype(np.float64)
    s = q @ k.T / np.sqrt(d.hd)
    s[np.arange(d.kv)[None, :] > d.positions[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


def _focused_heads(d):
    """Query heads that are not diffuse: diffuse heads have queries a tenth the size."""
    norms = np.linalg.norm(d.q.astype(np.float64), axis=2).mean(axis=0)
    return [h for h in range(d.nh) if norms[h] > 2 * np.sqrt(d.hd) * 0.1]


def _mass(d, heads, keys_of_row):
    return np.mean(
        [
            sum(_probs(d, h)[i, keys_of_row(pos)].sum() for i, pos in enumerate(d.positions)) / d.n
            for h in heads
        ]
    )


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("nh, nkv", [(4, 4), (6, 2), (8, 1)])
def test_shapes_and_ranges(hd, nh, nkv):
    d = synthetic(40, 200, nh, nkv, hd, seed=5)
    assert d.q.shape == (40, nh, hd) and d.k.shape == d.v.shape == (200, nkv, hd)
    assert d.q.dtype == d.k.dtype == d.v.dtype == np.float16
    assert d.q_offset == 160 and d.path is None
    for x in (d.q, d.k, d.v):
        assert np.isfinite(x.astype(np.float32)).all()
    scores = np.einsum(
        "nhd,khd->nhk", d.q.astype(np.float64), np.repeat(d.k, d.group, axis=1).astype(np.float64)
    )
    assert np.abs(scores).max() / np.sqrt(hd) < 64


def test_presets():
    d = synthetic_preset("llama-3.2-3b", 8, 64, seed=0)
    assert (d.nh, d.nkv, d.hd) == (24, 8, 128)
    d = synthetic_preset("smollm2-135m", 8, 64, seed=0)
    assert (d.nh, d.nkv, d.hd) == (9, 3, 64)
    assert set(PRESETS) == {"llama-3.2-3b", "smollm2-135m"}
    with pytest.raises(ValueError, match="preset 'gpt2'"):
        synthetic_preset("gpt2", 8, 64, seed=0)


def test_deterministic(tmp_path):
    a = synthetic(16, 96, 6, 2, 128, seed=11)
    b = synthetic(16, 96, 6, 2, 128, seed=11)
    c = synthetic(16, 96, 6, 2, 128, seed=12)
    for x, y, z in ((a.q, b.q, c.q), (a.k, b.k, c.k), (a.v, b.v, c.v)):
        assert x.tobytes() == y.tobytes() and x.tobytes() != z.tobytes()
    # K and V of a KV head depend on nothing but the seed, the head and the key count.
    wider = synthetic(4, 96, 12, 2, 128, seed=11)
    np.testing.assert_array_equal(wider.k, a.k)
    path = write_dump(tmp_path / "s.apadump", a.q, a.k, a.v, a.q_offset)
    np.testing.assert_array_equal(read_dump(path).q, a.q)


def test_q_offset():
    d = synthetic(8, 100, 2, 1, 64, seed=0, q_offset=10)
    assert list(d.positions) == list(range(10, 18))
    with pytest.raises(ValueError, match="q_offset = 93: must be in 0..kv − n = 92"):
        synthetic(8, 100, 2, 1, 64, seed=0, q_offset=93)


def test_sink_raises_key0_mass():
    common = dict(seed=2, diffuse_heads=0.0, locality=0.0)
    weak = synthetic(32, 1024, 4, 2, 64, sink=0.0, **common)
    strong = synthetic(32, 1024, 4, 2, 64, sink=8.0, **common)
    key0 = [_mass(d, range(4), lambda pos: [0]) for d in (weak, strong)]
    assert key0[0] < 0.01 < 0.3 < key0[1]


def test_locality_raises_diagonal_mass():
    common = dict(seed=3, diffuse_heads=0.0, sink=0.0)
    flat = synthetic(32, 1024, 4, 2, 128, locality=0.0, **common)
    local = synthetic(32, 1024, 4, 2, 128, locality=4.0, **common)
    last64 = [_mass(d, range(4), lambda pos: slice(pos - 63, pos + 1)) for d in (flat, local)]
    assert last64[0] < 0.15 and last64[1] > 2 * last64[0]
    # RoPE-like: the logits of the nearest keys stand about ``locality`` above the distant ones.
    q, k = local.q[:, 0].astype(np.float64), local.k[:, 0].astype(np.float64)
    s = q @ k.T / np.sqrt(128)
    near = np.mean([s[i, pos - 3 : pos + 1].mean() for i, pos in enumerate(local.positions)])
    far = np.mean([s[i, 64:512].mean() for i in range(local.n)])
    assert near > far + 2


def test_diffuse_heads_are_flat():
    d = synthetic(32, 512, 8, 2, 64, seed=4, diffuse_heads=0.5)
    focused = _focused_heads(d)
    assert len(focused) == 4
    for h in range(8):
        top = _probs(d, h).max(axis=1).mean()
        if h in focused:
            assert top > 0.2
        else:
            assert top < 4 / 512
    assert len(_focused_heads(synthetic(32, 512, 8, 2, 64, seed=4, diffuse_heads=0.0))) == 8
    assert _focused_heads(synthetic(32, 512, 8, 2, 64, seed=4, diffuse_heads=1.0)) == []


def test_channel_offset_is_a_shared_key_mean():
    base = synthetic(16, 512, 4, 2, 64, seed=6, channel_offset=0.0, outliers=0.0)
    shifted = synthetic(16, 512, 4, 2, 64, seed=6, channel_offset=3.0, outliers=0.0)
    diff = shifted.k.astype(np.float64) - base.k.astype(np.float64)
    offset = diff.mean(axis=0)  # [nkv, hd]: one shift per KV head and channel
    assert np.abs(diff - offset).max() < 0.02  # FP16 rounding only
    assert 1.5 < offset.std() < 4.5
    np.testing.assert_array_equal(base.q, shifted.q)
    # The softmax does not see it (float64, after undoing the FP16 rounding of the shift).
    p0, p1 = _probs(base, 0), _probs(shifted, 0)
    assert np.abs(p0 - p1).max() < 0.02


def test_outliers():
    clean = synthetic(64, 2048, 4, 2, 128, seed=7, outliers=0.0, sink=0.0)
    assert np.abs(clean.v.astype(np.float32)).max() < 8
    noisy = synthetic(64, 2048, 4, 2, 128, seed=7, outliers=1e-3, sink=0.0)
    hits = int((np.abs(noisy.v.astype(np.float32)) == 16).sum())
    expected = 1e-3 * noisy.v.size
    assert abs(hits - expected) < 5 * np.sqrt(expected)
    assert (np.abs(noisy.q.astype(np.float32)) >= 14).any() and (
        np.abs(noisy.k.astype(np.float32)) >= 14
    ).any()


def test_families_are_distinct_knob_sets():
    """The benchmark families (tools/bench_gpu.py --family) build, and the second one is what its name
    says: about ten times the outliers in V, and key means spread twice as wide."""
    made = {name: synthetic_preset("llama-3.2-3b", 16, 4096, seed=3, **knobs) for name, knobs in FAMILIES.items()}
    hits = {name: int((np.abs(d.v.astype(np.float32)) >= 12).sum()) for name, d in made.items()}
    spread = {name: float(d.k.astype(np.float64).mean(axis=0).std()) for name, d in made.items()}
    assert 7 < hits["outlier-heavy"] / hits["real-like"] < 14
    assert 1.6 < spread["outlier-heavy"] / spread["real-like"] < 2.4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n = 0: must be positive"),
        (dict(kv=-3), "kv = -3: must be positive"),
        (dict(nh=5), "nh = 5 is not a multiple of nkv = 2"),
        (dict(hd=96), "hd = 96: supported head dims are 64, 128, 256"),
        (dict(n=65), "q_offset = -1: must be in 0..kv − n = -1"),
        (dict(seed=-1), "seed = -1: must be non-negative"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(sink=-1.0), "sink = -1.0: must be finite and non-negative"),
        (dict(locality=float("inf")), "locality = inf"),
        (dict(channel_offset=float("nan")), "channel_offset = nan"),
        (dict(diffuse_heads=1.5), r"diffuse_heads = 1.5: must be a fraction in \[0, 1\]"),
        (dict(outliers=-0.1), "outliers = -0.1"),
        (dict(sink=1e12), r"the knobs push \|[qk]\| to .* past the FP16 maximum"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    args = dict(n=8, kv=64, nh=4, nkv=2, hd=64, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        synthetic(**args)
