"""SageAttention 1.0.6's real Triton kernels (apa_gpu.sageattention) against their recipe
(apa_emu.peers.sageattn, numerics.md §14), bitwise, on the device: a few problems across the head dims,
GQA and the 128-row query and 64-row key block edges, and the built-in dump padded in front. Skipped,
with the engine's one line, where torch, Triton, sageattention 1.0.6 or a CUDA device is missing."""

from __future__ import annotations

import pytest

from apa_emu import peers
from apa_emu.problems import Problem
from apa_emu.study import peer_check
from apa_emu.study.dump import builtin_dump_path, read_dump

from apa_gpu.sageattention import SageEngine

pytestmark = [pytest.mark.hardware, pytest.mark.skipif(bool(SageEngine.missing()), reason=str(SageEngine.missing()))]


@pytest.mark.parametrize("n, hkv, g, d, structure", [
    (1, 1, 1, 64, "normal"), (64, 1, 2, 64, "sink"), (128, 2, 3, 128, "outliers"), (130, 1, 1, 128, "normal"),
    (200, 2, 2, 64, "channel"), (257, 1, 4, 64, "diffuse"), (320, 2, 1, 128, "normal"),
])
def test_engine_equals_the_recipe_bitwise(n, hkv, g, d, structure):
    problem = Problem(seed=n * d + g, B=1, n=n, Hkv=hkv, G=g, d=d, S=n, structure=structure, batched=False,
                      q_offset=0)
    outcome = peer_check.check_problem(SageEngine(), problem, mode="bitwise", max_rel_l2=0.0)
    assert outcome.passed, "\n".join([problem.describe(), *outcome.lines()])


def test_engine_equals_the_recipe_on_the_builtin_dump():
    path = builtin_dump_path()
    div, pairs = peer_check.check_dump(SageEngine(), "sageattention", read_dump(path), path, mode="bitwise")
    assert div is None, "\n".join(div.lines())
    assert pairs > 0


def test_engine_leaves_its_inputs_unchanged():
    (q, k, v, _), _ = Problem(seed=3, B=1, n=96, Hkv=1, G=2, d=64, S=96, structure="normal", batched=False,
                              q_offset=0).arguments()
    before = k.copy()
    out, inputs = peers.peer_run(SageEngine(), q, k, v)  # raises if it changed a copy it was handed
    assert (k == before).all() and out.shape == q.shape and inputs["km"].shape == (1, 64)
