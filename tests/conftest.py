"""Shared test settings: Hypothesis profiles and the skips of the gpu and hardware markers."""

import pytest
from hyp import register_profiles

register_profiles()


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests run when the selected backend can (APA_GPU_BACKEND: a CUDA device with CuPy, or
    the CPU simulator with g++); ``hardware`` tests (marked ``gpu`` too) only on the device itself."""
    gpu_items = [item for item in items if "gpu" in item.keywords or "hardware" in item.keywords]
    if not gpu_items:
        return
    from apa_gpu import build, device

    backend = build.backend_name()
    skip_gpu = None if device.usable() else pytest.mark.skip(reason=f"the {backend} backend cannot run here")
    skip_hw = None if backend == "cuda" else pytest.mark.skip(reason=f"needs the device itself, not {backend}")
    for item in gpu_items:
        skip = skip_gpu or ("hardware" in item.keywords and skip_hw)
        if skip:
            item.add_marker(skip)
