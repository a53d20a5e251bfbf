"""docs/engines.md's walk-through, run as written: its files written out, its commands run in a fresh
folder, the package from this checkout. The walk-through is the user's whole code, under 30 lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "engines.md"


def walkthrough() -> tuple[dict[str, str], list[str]]:
    """The files (the python blocks opened by ``# NAME``) and commands (the first bash block) of the
    doc's first section."""
    section = DOC.read_text().split("\n## ")[1]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    files = {text.splitlines()[0].removeprefix("# "): text for lang, text in blocks if lang == "python"}
    commands = next(text for lang, text in blocks if lang == "bash").strip().splitlines()
    return files, commands


def test_walkthrough_is_short():
    files, commands = walkthrough()
    assert set(files) == {"my_kernel.py", "test_my_kernel.py"} and len(commands) == 2
    code = [line for text in files.values() for line in text.splitlines() if line.strip()]
    assert len(code) < 30


@pytest.mark.skipif(not os.environ.get("CI") and sys.platform != "linux", reason="runs the commands under a shell")
def test_walkthrough_runs_verbatim(tmp_path):
    files, commands = walkthrough()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    env.pop("HYPOTHESIS_PROFILE", None)
    bin_dir = Path(sys.executable).parent  # the commands of the environment running this test
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    outputs, folders = [], []
    for command in commands:
        folders.append(sorted(tmp_path.iterdir()))
        r = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{command}\n{r.stdout}\n{r.stderr}"
        outputs.append(r.stdout)
    assert "1 passed" in outputs[0]
    assert "apa check: engine my-kernel equals the emulator bitwise" in outputs[1]
    assert re.search(r"on 5 generated problems and configs \(--seed 1; exp2 [a-z0-9 /,_]+\)", outputs[1])
    assert sorted(tmp_path.iterdir()) == folders[1]  # apa check wrote nothing
