"""Small parts: no class over 400 lines or 20 methods, no package function over 80 lines.

Measured on the source (``ast``: a definition's lines from ``def``/``class`` to its last line,
docstring included; methods = functions defined directly in the class body). The parts still over
a limit are listed with the reason; the test fails on a new one and on an entry no longer needed,
so the list only shrinks (issue 27: "Small parts in the server and the client").
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "flwr_sheaf"
MAX_CLASS_LINES, MAX_CLASS_METHODS, MAX_FUNCTION_LINES = 400, 20, 80

#: ``"<file>:<name>"`` -> why it is still over its limit (none left: every part is small)
EXCEPTIONS: dict[str, str] = {}


def oversized(path: Path, root: Path = PKG) -> dict[str, str]:
    """``{"<file>:<name>": what is over}`` of the classes and functions of ``path``."""
    rel = path.relative_to(root).as_posix()
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
            if lines > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS:
                out[f"{rel}:{node.name}"] = f"class: {lines} lines, {methods} methods"
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES
        ):
            out[f"{rel}:{node.name}"] = f"function: {lines} lines"
    return out


def test_no_part_over_its_limit_but_the_listed_ones():
    found = {k: v for p in sorted(PKG.rglob("*.py")) for k, v in oversized(p).items()}
    assert sorted(set(found) - set(EXCEPTIONS)) == [], found  # a new oversized part
    assert sorted(set(EXCEPTIONS) - set(found)) == []  # small now: remove its entry


def test_the_size_check_measures_lines_and_methods(tmp_path):
    body = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(21))
    long_fn = "def f():\n" + "    x = 1\n" * 80 + "    return x\n"
    (tmp_path / "probe.py").write_text(f"class C:\n{body}\n\n{long_fn}\ndef g():\n    return 0\n")
    assert oversized(tmp_path / "probe.py", tmp_path) == {
        "probe.py:C": "class: 43 lines, 21 methods",
        "probe.py:f": "function: 82 lines",
    }
