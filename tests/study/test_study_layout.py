"""The ``apa`` entry point and ``python -m apa_emu.study.cli`` both reach the command line, and the
kernel's engine entry point names the GPU engine. The layering itself (the core below the study
tools, apa_emu never importing apa_gpu, apa_gpu importing only apa_emu.call) is import-linter's
contracts in pyproject.toml, which CI runs (.ci/run)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from apa_emu.engines import Engine

ROOT = Path(__file__).resolve().parents[2]


def test_entry_point_resolves_to_the_cli():
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["apa"]
    module, func = target.split(":")
    from apa_emu.study import cli

    assert getattr(importlib.import_module(module), func) is cli.main


def test_engine_entry_point_names_the_gpu_engine():
    from apa_emu.engines import Engine
    from apa_gpu.engine import GpuEngine

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["apa_emu.engines"]["gpu"]
    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert cls is GpuEngine and issubclass(cls, Engine) and cls.name == "gpu"


def test_module_help_runs():
    out = subprocess.run([sys.executable, "-m", "apa_emu.study.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "scan" in out.stdout and "smollm2" in out.stdout


class _Toy(Engine):
    """Stands in for an engine class that $APA_ENGINES names (nothing here runs it)."""


def test_apa_engines_names_engines_of_a_checkout_that_is_not_installed(monkeypatch):
    """A copy run from PYTHONPATH (the device's) has no installed entry points: $APA_ENGINES names the
    engines there, beside those installed; a malformed entry is one line naming it, also from a study of the
    CLI, while --help, which chooses no engine, still works."""
    from apa_emu import engines
    from apa_emu.study import cli

    monkeypatch.setenv("APA_ENGINES", f"toy = {__name__}:_Toy")
    assert "toy" in engines.registered() and engines.load("toy") is _Toy
    monkeypatch.setenv("APA_ENGINES", "toy")
    with pytest.raises(ValueError, match=r"^APA_ENGINES: 'toy' is not name=module:Class$"):
        engines.registered()
    env = {**os.environ, "APA_ENGINES": "toy"}
    # --help chooses no engine and still works; a study, which chooses one, stops at the entry
    helped = subprocess.run([sys.executable, "-m", "apa_emu.study.cli", "scan", "--help"], capture_output=True,
                            text=True, cwd=ROOT, env=env)
    assert helped.returncode == 0 and "--backend" in helped.stdout
    proc = subprocess.run([sys.executable, "-m", "apa_emu.study.cli", "scan", "--rows", "0:1"], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    assert proc.returncode == cli.EXIT_ERROR
    assert proc.stderr == "apa: error: scan: argument --backend: APA_ENGINES: 'toy' is not name=module:Class\n"
