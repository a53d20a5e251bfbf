"""The ``apa`` entry point and ``python -m apa_emu.study.cli`` both reach the command line, and the
kernel's engine entry point names the GPU engine. The layering itself (the core below the study
tools, apa_emu never importing apa_gpu, apa_gpu importing only apa_emu.call) is import-linter's
contracts in pyproject.toml, which CI runs (.ci/run)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
