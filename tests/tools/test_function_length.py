"""The project's function-length limits hold: at most 60 lines a Python function (apa_emu, apa_gpu,
tools, tests) and 90 a CUDA one (cuda/, the simulator included), counted from the first line of the
signature (a ``template <...>`` line included, Python decorators not) to the last line of the body."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY_LIMIT, CUDA_LIMIT = 60, 90


def python_lengths(path: Path):
    """(name, first line, lines) of every function and method in a Python file."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.lineno
            yield node.name, first, node.end_lineno - first + 1


def _code_only(text: str) -> list[str]:
    """The source's lines with comments, string and character literals and preprocessor lines (with
    their continuations) blanked, so that only code braces and parentheses remain."""
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"' + r"|'(?:\\.|[^'\\\n])*'", '""', text)
    lines, cont = [], False
    for line in text.split("\n"):
        pre = cont or line.lstrip().startswith("#")
        cont = pre and line.rstrip().endswith("\\")
        lines.append("" if pre else line)
    return lines


_BODY = re.compile(r"\)\s*(const|noexcept|override|mutable|->\s*[\w:<>, *&]+|\s)*$")


def cuda_lengths(path: Path):
    """(name, first line, lines) of every function body in a CUDA/C++ file: a ``{`` that follows a
    parameter list, outside any other function (lambdas count towards the function holding them)."""
    lines = _code_only(path.read_text())
    depth, func_depth, start, name, head = 0, None, None, None, []
    decl_first = None
    for i, line in enumerate(lines, 1):
        for ch in line:
            if ch == "{":
                text = "".join(head).strip()
                if func_depth is None and _BODY.search(text) and not re.search(r"=\s*$|\b(struct|class|enum|namespace)\b", text):
                    m = re.findall(r"([A-Za-z_]\w*)\s*\(", text)
                    func_depth, start, name = depth, decl_first or i, m[0] if m else "?"
                depth += 1
                head, decl_first = [], None
            elif ch == "}":
                depth -= 1
                if func_depth is not None and depth == func_depth:
                    yield name, start, i - start + 1
                    func_depth = None
                head, decl_first = [], None
            elif ch == ";":
                head, decl_first = [], None
            else:
                if decl_first is None and not ch.isspace():
                    decl_first = i
                head.append(ch)
        head.append(" ")


def _over(files, lengths, limit):
    return [f"{p.relative_to(ROOT)}:{first} {name}: {n} lines" for p in files for name, first, n in lengths(p)
            if n > limit]


def test_python_functions_stay_within_60_lines():
    files = [p for top in ("apa_emu", "apa_gpu", "tools", "tests") for p in sorted((ROOT / top).rglob("*.py"))]
    assert _over(files, python_lengths, PY_LIMIT) == []


def test_cuda_functions_stay_within_90_lines():
    files = sorted(p for p in (ROOT / "cuda").rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    assert _over(files, cuda_lengths, CUDA_LIMIT) == []


@pytest.mark.parametrize("src, name, n", [
    ("template <int N>\n__device__ inline float f(float x) {\n  auto g = [&](int i) {\n    return i;\n  };\n"
     "  if (x) {\n    return g(1);\n  }\n  return x; // }\n}\n", "f", 10),
    ("struct S {\n  int a;\n  __device__ int get() const {\n    return a;\n  }\n};\n", "get", 3),
    ("#define M(x) \\\n  { x }\nint v[] = {1, 2};\nvoid h(\n    int a)\n{\n}\n", "h", 4),
])
def test_the_cuda_counter_counts_signature_to_closing_brace(tmp_path, src, name, n):
    """The counter itself, on hand-counted sources: a template line, a lambda and a brace in a comment
    inside, a method in a struct, a macro with braces and an initializer list that are no functions."""
    path = tmp_path / "x.cuh"
    path.write_text(src)
    assert [(f, k) for f, _, k in cuda_lengths(path)] == [(name, n)]
