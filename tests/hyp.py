"""Hypothesis budgets and coverage: one profile setting scales every property, and each property
asserts that its interesting case happened.

``HYPOTHESIS_PROFILE`` picks the profile (``ci`` under CI=true, else ``dev``); ``thorough`` multiplies
every test's example count by ``THOROUGH``. A property written as ``covering(...)`` collects what each
example saw and fails when a case it exists for never occurred: a cold-tile property that never met a
cold tile proves nothing.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings

THOROUGH = 25
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
SCALE = THOROUGH if PROFILE == "thorough" else 1


def register_profiles() -> None:
    # CI sets CI=true, which auto-loads Hypothesis's own "ci" profile (derandomized, no deadline);
    # every test names its own example count through examples(), so profiles only scale it.
    quiet = [HealthCheck.too_slow]
    settings.register_profile("ci", settings.get_profile("ci"), suppress_health_check=quiet)
    settings.register_profile("dev", deadline=None, suppress_health_check=quiet)
    settings.register_profile("thorough", deadline=None, suppress_health_check=quiet)
    settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A test's example count under the active profile."""
    return n * SCALE


class Seen(Counter):
    """Counts events across a property's examples; ``require`` fails for any that never happened."""

    def require(self, *events: str) -> None:
        missing = [e for e in events if not self[e]]
        assert not missing, f"the property never met: {', '.join(missing)} (seen: {dict(self)})"
