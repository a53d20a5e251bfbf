"""The engine interface and the pytest plugin where the suite's forwarding engines cannot tell: the
arguments a function engine receives are those its user would pass (an unbatched paged call's table
keeps rank 1), ``assert_matches_emulator`` checks under the config an engine claims, and ``Seen``
counts cold tiles only where there were some."""

from __future__ import annotations

import numpy as np
import pytest
from hyp import Seen

import apa_emu
from apa_emu import Config
from apa_emu.call import resolve_call
from apa_emu.engines import call_arguments, engine
from apa_emu.problems import Problem
from apa_emu.testing import assert_matches_emulator

TABLES = []


@engine(name="paged-rank", features={"paging"}, bitexact=True)
def paged_rank(q, k, v, q_offset=0, config=None, block_table=None, seqlen_k=None):
    """Records the table it is given, then forwards."""
    TABLES.append(np.asarray(block_table))
    return apa_emu.attention(q, k, v, q_offset, config, block_table=block_table, seqlen_k=seqlen_k).out


@engine(name="always-seed", bitexact=True, config="preset=seed")
def always_seed(q, k, v, q_offset=0, config=None):
    """A kernel of the seed's arithmetic that ignores the config it is passed: right only when it is
    checked under the config it claims."""
    return apa_emu.attention(q, k, v, q_offset, Config.seed()).out


def _paged(batched: bool):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 2, 64)).astype(np.float16)
    pool = rng.standard_normal((6, 16, 1, 64)).astype(np.float16)
    table = np.array([3, 0, 5, 1], np.int32)
    return (q[None], pool, pool.copy(), 56), dict(block_table=table[None] if batched else table, seqlen_k=60)


@pytest.mark.parametrize("batched", (False, True), ids=["unbatched", "batched"])
def test_a_function_engine_gets_the_paged_arguments_as_passed(batched):
    """call_arguments(resolve_call(args)) gives back the block table as given: rank 1 with a 3-D q, rank
    2 with a 4-D one; so does what a paging engine receives through assert_matches_emulator."""
    args, kw = _paged(batched)
    if not batched:
        args = (args[0][0], *args[1:])
    got_args, got_kw = call_arguments(resolve_call(*args, **kw))
    assert got_args[0].shape == args[0].shape
    assert got_kw["block_table"].shape == kw["block_table"].shape
    np.testing.assert_array_equal(got_kw["block_table"], kw["block_table"])
    TABLES.clear()
    assert_matches_emulator(paged_rank, (args, kw))
    assert TABLES and all(t.shape == kw["block_table"].shape for t in TABLES), [t.shape for t in TABLES]


def test_the_plugin_checks_under_the_claimed_config():
    """An engine that claims preset=seed and runs the seed whatever it is passed passes with no config
    (the claimed one is used), and the emulator then ran Config.seed(); checked under the default config
    instead it fails: the problem tells the seed from the default."""
    problem = Problem(seed=3, B=1, n=48, Hkv=1, G=2, d=64, S=600, structure="sink", batched=False, q_offset=552)
    outcome = assert_matches_emulator(always_seed, problem)
    assert outcome.passed and outcome.mode == "bitwise"
    with pytest.raises(AssertionError, match="differs from the emulator bitwise"):
        assert_matches_emulator(always_seed, problem, Config())


def test_seen_counts_cold_tiles_only_when_some_tile_is_cold():
    """ε < 0 makes every active tile hot (§9.6): Seen records hot tiles and no cold ones, so a property
    that requires cold tiles fails on it; at ε = 0.3 the same problem has both."""
    problem = Problem(seed=3, B=1, n=48, Hkv=1, G=2, d=64, S=600, structure="sink", batched=False, q_offset=552)
    seen = Seen()
    outcome = assert_matches_emulator("cpu", problem, Config(eps=-1.0), seen=seen)
    assert outcome.emulator.hot_tiles == outcome.emulator.active_tiles > 0
    assert seen["hot tiles"] == 1 and seen["cold tiles"] == 0
    with pytest.raises(AssertionError, match="cold tiles"):
        seen.require("cold tiles")
    assert_matches_emulator("cpu", problem, Config(eps=0.3), seen=seen)
    assert seen["cold tiles"] == 1 and seen["hot tiles"] == 2
