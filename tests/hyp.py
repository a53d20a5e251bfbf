"""Hypothesis budgets and coverage: one profile setting scales every property, and each property
asserts that its interesting case happened.

``HYPOTHESIS_PROFILE`` picks the profile (``ci`` under CI=true, else ``dev``); ``thorough`` multiplies
every test's example count by ``THOROUGH``. A property written as ``covering(...)`` collects what each
example saw and fails when a case it exists for never occurred: a cold-tile property that never met a
cold tile proves nothing.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.internal.conjecture import engine

from apa_emu.testing import Seen  # noqa: F401  (the plugin's, re-exported to the tests that import it here)

THOROUGH = 25
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
SCALE = THOROUGH if PROFILE == "thorough" else 1


# Under CI a failing property reports within about a minute: on a loaded 2-core machine one shrank for
# over 15 minutes, past the job's patience, and a CI run that times out says nothing about the code.
CI_SHRINK_SECONDS = 60


def register_profiles() -> None:
    # CI sets CI=true, which auto-loads Hypothesis's own "ci" profile (derandomized, no deadline);
    # every test names its own example count through examples(), so profiles only scale it.
    quiet = [HealthCheck.too_slow]
    # One failure shrunk, not one per distinct error, and no explain phase (it reruns the test per
    # argument); the shrink itself is capped by engine.MAX_SHRINKING_SECONDS, which Hypothesis
    # documents as the knob (5 minutes by default).
    settings.register_profile("ci", settings.get_profile("ci"), suppress_health_check=quiet,
                              report_multiple_bugs=False,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
    if PROFILE == "ci":
        engine.MAX_SHRINKING_SECONDS = CI_SHRINK_SECONDS
    settings.register_profile("dev", deadline=None, suppress_health_check=quiet)
    settings.register_profile("thorough", deadline=None, suppress_health_check=quiet)
    settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A test's example count under the active profile."""
    return n * SCALE

