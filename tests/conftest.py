"""Shared test settings: Hypothesis profiles and the gpu marker's skip."""

import os

import pytest
from hypothesis import HealthCheck, settings

# CI sets CI=true, which auto-loads Hypothesis's own "ci" profile (derandomized, no deadline);
# we keep its settings and only bound the example count so the default run stays short.
settings.register_profile("ci", settings.get_profile("ci"), max_examples=15,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
