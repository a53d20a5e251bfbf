"""A copy of cuda/ with one kernel mutant of tools/mutants.py planted, and ``apa check`` run on it in
a subprocess (its backend and sources settings leave the test process's alone). Shared by the CI
test on the simulator (tests/kernel/test_gpu_sim.py) and the device test (tests/study/test_gpu_study.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from apa_gpu.build import CUDA_DIR

ROOT = Path(__file__).resolve().parent.parent


def _mutants():
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {m.id: m for m in module.MUTANTS}


def planted_sources(tmp_path: Path, mutant_id: str) -> Path:
    """``tmp_path``/cuda: the kernel sources with kernel mutant ``mutant_id`` applied."""
    m = _mutants()[mutant_id]
    root = tmp_path / "cuda"
    shutil.copytree(CUDA_DIR, root)
    path = root / Path(m.file).relative_to("cuda")
    text = path.read_text()
    assert text.count(m.old) == 1, f"{m.id}: the text to replace occurs {text.count(m.old)} times in {m.file}"
    path.write_text(text.replace(m.old, m.new))
    return root


def apa_check(args, *, backend: str, cache: Path, repro: Path, sources: Path | None = None):
    """``apa check ARGS`` in a subprocess on ``backend`` with the kernel built from ``sources``."""
    env = dict(os.environ, APA_GPU_BACKEND=backend, APA_GPU_CACHE=str(cache), APA_GPU_REPRO_DIR=str(repro),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("APA_GPU_SOURCES", None)
    if sources is not None:
        env["APA_GPU_SOURCES"] = str(sources)
    return subprocess.run([sys.executable, "-m", "apa_emu.study.cli", "check", *map(str, args)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
