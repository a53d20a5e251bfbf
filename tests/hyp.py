"""Hypothesis budgets and coverage: one profile setting scales every property, and each property
asserts that its interesting case happened.

``HYPOTHESIS_PROFILE`` picks the profile. The default is ``ci``, derandomized, so that the README's
``python -m pytest -q`` and CI run the same examples and a red run is one anyone can repeat. Opt-in:
``dev``, randomized exploration (each run draws new examples; ``--hypothesis-seed`` picks them);
``thorough``, randomized with every test's example count multiplied by ``THOROUGH``; ``explicit``,
only each property's ``@example`` cases.

A property that requires a case (``Seen.require``) collects what each example saw and fails when a
case it exists for never occurred: a cold-tile property that never met a cold tile proves nothing. Its
``@example`` cases meet every required case on their own, so no draw can fail it for want of one;
the ``explicit`` profile checks that they do.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.internal.conjecture import engine

from apa_emu.testing import Seen  # noqa: F401  (the plugin's, re-exported to the tests that import it here)

THOROUGH = 25
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SCALE = THOROUGH if PROFILE == "thorough" else 1


# Under CI a failing property reports within about a minute: on a loaded 2-core machine one shrank for
# over 15 minutes, past the job's patience, and a CI run that times out says nothing about the code.
CI_SHRINK_SECONDS = 60


def register_profiles() -> None:
    # Ours extends Hypothesis's own "ci" profile (derandomized, no deadline, no database); every test
    # names its own example count through examples(), so profiles only scale it.
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
    settings.register_profile("explicit", deadline=None, suppress_health_check=quiet, phases=[Phase.explicit])
    settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """A test's example count under the active profile."""
    return n * SCALE

