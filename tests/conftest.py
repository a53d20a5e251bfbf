"""Shared test settings: Hypothesis profiles, the skips of the gpu and hardware markers, and the
special-function tables the fast exp2 mode reads (numerics.md §13)."""

import os
import shutil
import tempfile

import numpy as np
import pytest
from hyp import register_profiles

register_profiles()
_STANDIN_DIR = None


def pytest_configure(config):
    """Without measured tables in the package (apa_emu/data/sfu_sm90.npz, written by
    ``tools/sfu_check.py --measure`` on a GPU) and without ``$APA_SFU_TABLES``, the session runs the fast
    mode on stand-in tables (tests/helpers.py ``standin_sfu_tables``: correctly rounded values at each
    table point), so that every code path is tested; no test compares them with hardware."""
    global _STANDIN_DIR
    from apa_emu import sfu

    if sfu.DATA.is_file() or os.environ.get("APA_SFU_TABLES"):
        return
    from helpers import standin_sfu_tables

    _STANDIN_DIR = tempfile.mkdtemp(prefix="apa_sfu_standin_")
    path = os.path.join(_STANDIN_DIR, "sfu_standin.npz")
    np.savez(path, **sfu.pack(standin_sfu_tables()))
    os.environ["APA_SFU_TABLES"] = path


def pytest_unconfigure(config):
    if _STANDIN_DIR:
        shutil.rmtree(_STANDIN_DIR, ignore_errors=True)


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
