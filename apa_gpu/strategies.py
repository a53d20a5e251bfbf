"""The kernel's own run options as a Hypothesis strategy, beside the engine-agnostic problems and
configs of apa_emu/strategies.py (Hypothesis is a test extra: import this module only where it is)."""

from __future__ import annotations

from hypothesis import strategies as st


def schedules():
    """apa_gpu.attention's schedule keywords: the default launches, the fused one, or the bounded one
    with segments of 1-4 tiles, so that small problems run several."""
    bounded = st.builds(lambda t: dict(schedule="bounded", segment_tiles=t), st.integers(1, 4))
    return st.one_of(st.just({}), st.just(dict(schedule="fused")), bounded)
