"""Results pages (``--record PAGE.md``): each run appends one dated section with the command that made it,
the machine it ran on and the commit of the code, then its tables, so that every number on the page can be
made again. Nothing already on the page is changed."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from .files import write_atomically

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The checkout's commit, ``+ uncommitted changes`` when tracked files differ from it; else the
    installed version."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=20).stdout.strip()

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"apa-emu {version('apa-emu')} (not a git checkout)"
        except PackageNotFoundError:
            return "unknown (not a git checkout, not installed)"
    return f"`{head}`" + (" + uncommitted changes" if dirty else "")


def _gpu_name() -> str | None:
    """The current CUDA device's name, by torch or CuPy where either sees one."""
    for probe in (lambda: __import__("torch").cuda.get_device_name(),
                  lambda: __import__("cupy").cuda.runtime.getDeviceProperties(0)["name"].decode()):
        try:
            return probe()
        except Exception:  # noqa: BLE001 - no package, no driver or no device: try the next, else none
            continue
    return None


def machine(devices) -> str:
    """The host's processor and cores, and the GPU where an engine ran on one (``devices``: the engines'
    device words; empty, "-" and CPU ones name no GPU)."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    host = f"{cpu} ({os.cpu_count()} cores)"
    on_gpu = any(d and d != "-" and "cpu" not in d.lower() for d in devices)
    gpu = _gpu_name() if on_gpu else None
    return f"{host}, {gpu}" if gpu else host


def append(page: str | os.PathLike, body: str, devices=(), when: datetime.datetime | None = None) -> Path:
    """Append one section to ``page`` (created with a title when new): the date, the command line, the
    machine and the commit, then ``body`` (Markdown)."""
    page = Path(page)
    when = when or datetime.datetime.now(datetime.timezone.utc)
    command = "apa " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    head = page.read_text(encoding="utf-8").rstrip("\n") + "\n\n" if page.exists() else "# Results\n\n"
    what = " ".join(sys.argv[1:2]) or "run"
    section = (f"## {when:%Y-%m-%d %H:%M} UTC: apa {what}\n\n- Command: `{command}`\n"
               f"- Machine: {machine(devices)}\n- Commit: {commit()}\n- Date: {when:%Y-%m-%d %H:%M} UTC\n\n"
               f"{body.strip()}\n")
    return write_atomically(page, lambda f: f.write((head + section).encode()))
