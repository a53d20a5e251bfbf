"""The project's files speak of the project alone: what it does, why, what was measured (with date,
machine, command and commit), never how it was written: no counts of work periods and no tracker numbers, in any
tracked file, the record under docs/results/ included. And every ``docs/`` or ``tools/`` path a file
names exists, so a moved page leaves no dangling reference behind."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Built from parts so that this file does not match itself.
PERIOD = re.compile(r"\b" + "sess" + r"ions?\b", re.I)
ISSUE = re.compile(r"\b" + "iss" + r"ues? ?#?[0-9]", re.I)
# Technical uses: the subprocess argument, and owner/repo#N references to other projects' trackers.
ALLOWED = re.compile(r"start_new_" + "sess" + "ion" + r"|[\w.-]+/[\w.-]+#[0-9]+")
# A path a file names, globs and {a,b} alternatives included; one after an option (--out FILE) is an output.
# A path after ``commit:`` (git show) is the tree at that commit; NAME in capitals is a placeholder.
PATH = re.compile(r"(?<![\w./:-])(?<!--out )((?:docs|tools)/[\w./*{},-]*[\w*}])")
PLACEHOLDER = re.compile(r"/[A-Z_]+(\.\w+)?$")


def _exists(ref: str) -> bool:
    """Whether the named path exists, or for a glob with {a,b} alternatives, each alternative matches."""
    m = re.search(r"\{([^{}]*)\}", ref)
    if m:
        return all(_exists(ref[:m.start()] + alt + ref[m.end():]) for alt in m.group(1).split(","))
    return any(ROOT.glob(ref)) if "*" in ref else (ROOT / ref).exists()


def tracked_text_files():
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    for name in names:
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            yield name, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def words_found(files):
    """``file:line: text`` of each line that names a work period or a tracker number."""
    hits = []
    for name, text in files:
        for i, line in enumerate(text.splitlines(), 1):
            bare = ALLOWED.sub("", line)
            if PERIOD.search(bare) or ISSUE.search(bare):
                hits.append(f"{name}:{i}: {line.strip()[:120]}")
    return hits


def test_no_file_speaks_of_work_periods_or_tracker_numbers():
    assert words_found(tracked_text_files()) == []


def test_the_word_check_finds_what_it_must_and_spares_technical_uses():
    planted = [("a.md", "## Twenty-second " + "sess" + "ion, 2026-12-03"), ("b.py", "# see " + "iss" + "ue 32's target"),
               ("c.py", "x = 1  # " + "Iss" + "ues #40-41"), ("d.py", "Popen(argv, start_new_" + "sess" + "ion=True)"),
               ("e.md", "thu-ml/SageAttention#340 drops a tile")]
    assert [h.split(":")[0] for h in words_found(planted)] == ["a.md", "b.py", "c.py"]


def test_every_named_docs_or_tools_path_exists():
    """The dated record (docs/results/) names tools as they were at its entries' commits: only its
    references into docs/ must still resolve."""
    missing = [f"{name}:{i}: {ref}" for name, text in tracked_text_files()
               for i, line in enumerate(text.splitlines(), 1) for ref in PATH.findall(line)
               if not (name.startswith("docs/results/") and ref.startswith("tools/"))
               and not PLACEHOLDER.search(ref) and not _exists(ref.rstrip("."))]
    assert missing == []


def test_the_path_check_expands_globs_and_alternatives():
    tools, docs = "tools" + "/", "docs" + "/"  # split, so that this file names no missing path itself
    assert _exists(tools + "*.py") and _exists(tools + "{snapshot,mutants}.py")
    assert not _exists(tools + "{snapshot,no_such_tool}.py") and not _exists(docs + "no_such_*.md")
    line = f"run `python {tools}x.py --out {docs}new.md` > {docs}y.md"
    assert PATH.findall(line) == [tools + "x.py", docs + "y.md"]
    assert PATH.findall(f"git show 44f7390:{tools}gone.py") == [] and PLACEHOLDER.search(tools + "NAME.py")
