"""The call contract's refusals (apa_emu/call.py): every bad argument of ``attention`` is one
ValueError naming it, the same through the emulator and the kernel's launcher."""

from __future__ import annotations

import numpy as np
import pytest

import apa_emu
import apa_gpu

rng = np.random.default_rng(0)
Q = rng.standard_normal((64, 2, 64)).astype(np.float16)
K = rng.standard_normal((128, 1, 64)).astype(np.float16)
V = rng.standard_normal((128, 1, 64)).astype(np.float16)
ENGINES = [apa_emu.attention, apa_gpu.attention]


@pytest.mark.parametrize("attention", ENGINES)
@pytest.mark.parametrize("config", ["eps=0.1", {"eps": 0.1}, 0.1])
def test_config_that_is_not_a_config_is_refused(attention, config):
    with pytest.raises(ValueError, match=r"^config: expected an apa_emu Config"):
        attention(Q, K, V, 64, config)


@pytest.mark.parametrize("attention", ENGINES)
@pytest.mark.parametrize("trace", [5, 1.5, "some", [5], [(0, 0)]])
def test_trace_that_is_not_triples_is_refused(attention, trace):
    with pytest.raises(ValueError, match=r"^trace: "):
        attention(Q, K, V, 64, trace=trace)


@pytest.mark.parametrize("name", ["trace", "warps"])
@pytest.mark.parametrize("entry", [1.5, 0.5, np.float64(1.0), 1.0, True])
def test_non_integer_warp_numbers_are_refused_not_truncated(name, entry):
    with pytest.raises(ValueError, match=rf"^{name}: .* is not an integer"):
        apa_emu.attention(Q, K, V, 64, **{name: [(0, 0, entry)]})


def test_numpy_integer_warp_numbers_are_accepted():
    triple = (np.int64(0), np.uint8(0), np.int32(1))
    res = apa_emu.attention(Q, K, V, 64, warps=[triple], trace=[triple])
    want = apa_emu.attention(Q, K, V, 64, warps=[(0, 0, 1)])
    assert res.out.tobytes() == want.out.tobytes() and np.isfinite(res.out).any()
    assert set(zip(res.visits["b"], res.visits["hk"], res.visits["warp"])) == {(0, 0, 1)}


@pytest.mark.parametrize("kind", [np.uint64, np.uint32, np.uint16, np.int64])
def test_numpy_unsigned_window_and_offset_do_not_wrap(kind):
    """A NumPy unsigned window or q_offset is the same call as the Python int (no wrap-around)."""
    want = apa_emu.attention(Q, K, V, 64, window=100)
    got = apa_emu.attention(Q, K, V, kind(64), window=kind(100))
    assert got.out.tobytes() == want.out.tobytes()
    with pytest.raises(ValueError, match=r"^window=20: query row 63 \(position 127\) .* starts at key 108,"):
        apa_emu.attention(Q[:, :, :], K[:100], V[:100], kind(64), window=kind(20))
