"""tools/bound_floor.py: the probes recover the weights the call multiplies the values by (their weighted
sum of the values is the call's output, on a problem with hot and cold tiles), and the floor is a hand
count on weights chosen by hand."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from apa_emu import Config, reference
from apa_emu.study.synth import synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bound_floor  # noqa: E402

DUMP = synthetic(32, 512, 2, 1, 64, seed=3)
LONG = synthetic(32, 2048, 2, 1, 64, seed=3)  # at ε = 0.05 about 0.7 of its tiles hot


def exact_weights(q, k, off, cfg):
    n, H, d = q.shape
    s = np.einsum("nhd,sd->nhs", q.astype(np.float64), k[:, 0].astype(np.float64)) * float(cfg.softmax_scale(d))
    s = np.where(np.arange(k.shape[0])[None, None, :] > (off + np.arange(n))[:, None, None], -np.inf, s)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    return p / p.sum(axis=2, keepdims=True)


def test_the_probed_weights_give_the_calls_output():
    cfg = Config(eps=0.05, quant_v=False)  # u = v: the output is the probed weights' sum of the FP16 values
    q, k, v, off = LONG.q, LONG.k, LONG.v, LONG.q_offset
    res, a = bound_floor.probe_weights(bound_floor._Backend("cpu", q, k, off, cfg), v)
    assert 0 < res.hot_share < 1  # both kinds of tile weighed
    a64, v64 = a.astype(np.float64), v[:, 0].astype(np.float64)
    recombined = np.einsum("nhs,sd->nhd", a64, v64)
    slack = np.einsum("nhs,s->nh", a64 * 2.0**-10 + 2.0**-24, np.linalg.norm(v64, axis=1))
    off_by = np.linalg.norm(recombined - res.out.astype(np.float64), axis=2)
    assert (off_by <= slack + 2.0**-10 * np.linalg.norm(res.out.astype(np.float64), axis=2)).all()
    # and the weights are APA's, not the exact ones rounded: FP4 keys err by far more than FP16 does
    p = exact_weights(q, k, off, cfg)
    assert (np.abs(a64 - p) > 16 * (p * 2.0**-11 + 2.0**-25)).any()


def test_the_floor_is_a_hand_count():
    cfg = Config()
    q, k, v, off = DUMP.q, DUMP.k, DUMP.v, DUMP.q_offset
    p = exact_weights(q, k, off, cfg)
    O = reference(q, k, v, off, cfg)
    fake = SimpleNamespace(out=O.astype(np.float16), hot=np.zeros((1, 1, 4, 1), np.uint32),
                           err_bound=np.ones(O.shape[:2], np.float32))
    row, head, key, delta = 31, 1, 7, 2.0**-4
    a = p.astype(np.float16).astype(np.float64)
    a[row, head, key] += delta  # one key's weight off by delta: the floor is delta x its distance from O
    t = bound_floor.floor_terms(q, k, v, off, fake, a.astype(np.float16), cfg)
    dist = np.linalg.norm(v[key, 0].astype(np.float64) - O[row, head])
    slack = (abs(a[row, head, key]) * 2.0**-11 + 2.0**-25) * dist
    assert t["floor"][row, head] == pytest.approx(delta * dist - slack, rel=1e-3, abs=2.0**-9 * dist)
    others = np.ones_like(t["floor"], bool)
    others[row, head] = False
    assert (t["floor"][others] == 0).all()  # FP16-rounded exact weights: within the probe's slack
    assert (t["floor_cold"] == t["floor"]).all()  # no hot tile in the fake mask
