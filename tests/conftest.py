"""Shared test settings: Hypothesis profiles and the gpu marker's skip."""

import pytest
from hyp import register_profiles

register_profiles()


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
