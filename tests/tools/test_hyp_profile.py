"""The CI profile bounds a failing property's report time (hyp.py): under CI=true the shrink is
capped and one failure is shrunk, without the explain phase's reruns."""

from __future__ import annotations

import time

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine

import hyp


@pytest.mark.skipif(hyp.PROFILE != "ci", reason="the CI profile is loaded under CI=true")
def test_ci_profile_caps_shrinking():
    assert engine.MAX_SHRINKING_SECONDS == hyp.CI_SHRINK_SECONDS <= 60
    assert settings().report_multiple_bugs is False and Phase.explain not in settings().phases


def test_the_shrink_cap_stops_a_slow_shrink(monkeypatch):
    """The knob the CI profile sets does bound the shrink: a failure whose every example is slow and
    whose minimal form is far away stops shrinking at the cap and is still reported."""
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 1)

    @settings(max_examples=50, database=None, deadline=None, derandomize=True)
    @given(st.lists(st.integers(0, 10**6), min_size=30, max_size=60))
    def slow_failure(xs):
        time.sleep(0.2)  # uncapped, the whole run takes about 15 s here (7.5 s at 0.1)
        assert sum(xs) < 1000

    t0 = time.perf_counter()
    with pytest.raises(AssertionError):
        slow_failure()
    assert time.perf_counter() - t0 < 6
