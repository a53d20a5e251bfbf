"""tools/mutants.py stays applicable: every planted bug's text occurs exactly once in its file, so a
refactor that moves the code fails here, in CI, instead of when someone next runs the mutants."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_tool

ROOT = Path(__file__).resolve().parents[2]
mutants = load_tool("mutants")


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.id)
def test_mutant_applies_once(m):
    text = (ROOT / m.file).read_text()
    assert text.count(m.old) == 1, f"{m.id}: {m.old!r} occurs {text.count(m.old)} times in {m.file}"
    assert m.new != m.old
    for t in m.tests:
        assert (ROOT / t.split("::")[0]).exists(), f"{m.id}: no test file {t}"


def test_mutant_ids_are_unique():
    """tools/mutants.py M… K… selects by id: a repeated id would run two planted bugs under one name."""
    ids = [m.id for m in mutants.MUTANTS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
