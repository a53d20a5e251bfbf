"""The study tools sit on top of the core: the core never imports them, and the ``apa`` entry point
and ``python -m apa_emu.study.cli`` both reach the command line."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports, relative imports resolved against its package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_core_never_imports_the_study_tools():
    core = sorted(ROOT.glob("apa_emu/*.py")) + sorted(ROOT.glob("apa_gpu/**/*.py"))
    assert len(core) > 10
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("apa_emu.study"))
                 for p in core}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_entry_point_resolves_to_the_cli():
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["apa"]
    module, func = target.split(":")
    from apa_emu.study import cli

    assert getattr(importlib.import_module(module), func) is cli.main


def test_module_help_runs():
    out = subprocess.run([sys.executable, "-m", "apa_emu.study.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "scan" in out.stdout and "smollm2" in out.stdout
