"""The pytest plugin's helpers (apa_emu.testing) given ill-typed arguments: each a ValueError naming
the argument, raised before any work, never a TypeError or AttributeError from deep inside."""

from __future__ import annotations

import numpy as np
import pytest

import apa_emu
from apa_emu import Config
from apa_emu.testing import Seen, assert_matches_emulator, problems, repro_command

rng = np.random.default_rng(0)
Q = rng.standard_normal((16, 2, 64)).astype(np.float16)
K = rng.standard_normal((64, 1, 64)).astype(np.float16)
V = rng.standard_normal((64, 1, 64)).astype(np.float16)


def good(q, k, v, q_offset=0, config=None):
    return apa_emu.attention(q, k, v, q_offset, config).out


@pytest.mark.parametrize("problem, kw, words", [
    (((Q, K, V, 48), None), {}, r"^problem: expected a Problem or \(args, kwargs\)"),
    (None, {}, r"^problem: expected a Problem or \(args, kwargs\)"),
    ((Q, K, V, 48), {}, r"^problem: expected a Problem or \(args, kwargs\)"),
    (((Q, K, V, 48), {"bogus": 1}), {}, r"^problem: attention takes no keyword 'bogus'"),
    (((Q, K, V, 48), {}), dict(max_rel_l2=None), r"^max_rel_l2=None: expected a finite number >= 0"),
    (((Q, K, V, 48), {}), dict(max_rel_l2=-1), r"^max_rel_l2=-1: expected a finite number >= 0"),
    (((Q, K, V, 48), {}), dict(max_rel_l2=float("nan")), r"^max_rel_l2=nan"),
    (((Q, K, V, 48), {}), dict(seen=[]), r"^seen=\[\]: expected a Seen or None"),
])
def test_assert_matches_emulator_names_a_bad_argument(problem, kw, words):
    with pytest.raises(ValueError, match=words):
        assert_matches_emulator(good, problem, **kw)


def test_a_good_call_still_passes():
    assert assert_matches_emulator(good, ((Q, K, V, 48), {}), max_rel_l2=0).passed


def test_repro_command_and_seen_name_a_bad_argument():
    with pytest.raises(ValueError, match=r"^repro_command: problem=None: expected a Problem"):
        repro_command(good, None, Config(), "bitwise")
    with pytest.raises(ValueError, match=r"^Seen.require: None is not an event name"):
        Seen().require(None)


@pytest.mark.parametrize("args, words", [
    ((frozenset(), ()), r"^problems: dims=\(\): expected some of"),
    ((frozenset(), (96,)), r"^problems: dims=\(96,\)"),
    ((frozenset(), 5), r"^problems: dims=5"),
    (({"bogus"},), r"^problems: features=\{'bogus'\}"),
    (("window",), r"^problems: features='window'"),
    ((frozenset(), (64,), []), r"^problems: seen=\[\]"),
])
def test_problems_names_a_bad_argument_when_called(args, words):
    pytest.importorskip("hypothesis")
    with pytest.raises(ValueError, match=words):
        problems(*args)
