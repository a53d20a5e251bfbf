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


@pytest.mark.parametrize("attention", ENGINES)
@pytest.mark.parametrize("window", [2**63, 2**64, np.uint64(2**63), 10**30])
def test_window_past_int64_is_one_value_error(attention, window):
    with pytest.raises(ValueError, match=r"^window=\d+: must be at most 2\*\*63 - 1"):
        attention(Q, K, V, 64, window=window)


def test_largest_window_is_full_causal():
    """A window of 2**63 - 1 keys reaches back past key 0 from every row: the full causal call."""
    got = apa_emu.attention(Q, K, V, 64, window=2**63 - 1)
    want = apa_emu.attention(Q, K, V, 64)
    np.testing.assert_array_equal(got.out.view(np.uint16), want.out.view(np.uint16))


def test_warps_all_is_refused_without_offering_all():
    """warps= runs every warp with None; its refusal of 'all' must not offer 'all'."""
    with pytest.raises(ValueError, match=r"^warps: expected None \(every warp\) or an iterable") as e:
        apa_emu.attention(Q, K, V, 64, warps="all")
    assert "'all' or" not in str(e.value)


def test_trace_as_an_array_of_triples_is_those_triples():
    """trace= as a NumPy array of triples traces those warps, like the same list of tuples."""
    got = apa_emu.attention(Q, K, V, 64, trace=np.array([[0, 0, 1]]))
    want = apa_emu.attention(Q, K, V, 64, trace=[(0, 0, 1)])
    np.testing.assert_array_equal(got.visits, want.visits)
    np.testing.assert_array_equal(got.out.view(np.uint16), want.out.view(np.uint16))


@pytest.mark.parametrize("q_terms", [2.0, 1.0, np.float64(2), True])
def test_q_terms_that_is_not_an_integer_is_refused(q_terms):
    with pytest.raises(ValueError, match=r"^config\.q_terms="):
        apa_emu.Config(q_terms=q_terms)


@pytest.mark.parametrize("scale", [3e38, 2.4e38])
def test_a_scale_whose_multiplier_overflows_is_refused(scale):
    """§5.3's f32(scale ⊗ log2 e) past binary32 would make every score NaN, with NumPy's warnings."""
    with pytest.raises(ValueError, match=r"^config\.scale=.*product with log2 e stays finite"):
        apa_emu.Config(scale=scale)
    assert apa_emu.Config(scale=2.3e38).scale == 2.3e38
