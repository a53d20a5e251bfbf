"""A script of tools/ loaded as a module, the way ``python tools/NAME.py`` runs it: the package
importable (installed, or the checkout on PYTHONPATH), and the sibling tools it imports found by their
own names (a script's folder is first on sys.path when it runs; here they are loaded first instead)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str, *siblings: str) -> ModuleType:
    """tools/NAME.py as the module NAME, after the SIBLINGS (tool names) it imports at its top; each is
    registered in sys.modules, so that ``import SIBLING`` inside a tool finds the one loaded here."""
    for sibling in siblings:
        load_tool(sibling)
    path = TOOLS / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
