"""Numba's cache follows every source of apa_emu, not only the file of the cached function."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import numba, apa_emu.fpmath as f; print(numba.config.CACHE_DIR); print(f.exp2s._cache._cache_path)"


def _cache_dirs(pkg_parent: Path, tmp: Path) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": str(pkg_parent)}
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp, capture_output=True, text=True, check=True)
    return r.stdout.split()


def test_editing_any_core_source_moves_the_cache(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "apa_emu", copy / "apa_emu", ignore=shutil.ignore_patterns("__pycache__", "study"))
    first = _cache_dirs(copy, tmp_path)
    assert _cache_dirs(copy, tmp_path) == first  # stable while nothing changes
    assert first[1].startswith(first[0]) and first[0].startswith(str(tmp_path))  # the copy, not the repo
    # an edit in a file other than fpmath.py, whose functions fpmath's callers inline
    with open(copy / "apa_emu" / "mma.py", "a") as f:
        f.write("\n# edited\n")
    second = _cache_dirs(copy, tmp_path)
    assert second[0] != first[0] and second[1].startswith(second[0])
