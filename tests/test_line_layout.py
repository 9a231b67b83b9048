"""Lines of at most MAX_COLUMNS, one statement each: the module and function size limits
(tests/test_layout.py) are met by splitting code, not by packing it sideways (`a; b`, `if x: y`)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_COLUMNS = 120
CHECKED = ("flowedge", "tests", "tools")


def sources() -> list[Path]:
    return sorted(p for part in CHECKED for p in (ROOT / part).rglob("*.py")) + sorted(ROOT.glob("*.py"))


def long_lines(path: Path) -> list[str]:
    """`path:line (columns)` for each line wider than MAX_COLUMNS."""
    return [f"{path.relative_to(ROOT)}:{n} ({len(line)})" for n, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > MAX_COLUMNS]


def packed_statements(path: Path) -> list[str]:
    """`path:line` where a statement shares its line with the one before it or with its block's header."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for field in ("body", "orelse", "finalbody"):
            value = getattr(node, field, None)
            body = [s for s in value if isinstance(s, ast.stmt)] if isinstance(value, list) else []
            header = getattr(node, "lineno", None) if field == "body" else None
            lines = [header] + [s.lineno for s in body] if header is not None else [s.lineno for s in body]
            decorated = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            found += [f"{path.relative_to(ROOT)}:{b}" for a, b in zip(lines, lines[1:])
                      if a == b and not (decorated and a == header and _one_line_stub(body))]
    return found


def _one_line_stub(body: list[ast.stmt]) -> bool:
    """`def f(self) -> int: ...` (a Protocol's member) is a declaration, not packed code."""
    return len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and body[0].value.value is Ellipsis


def test_no_line_over_the_limit():
    wide = [line for path in sources() for line in long_lines(path)]
    assert not wide, f"{len(wide)} lines over {MAX_COLUMNS} columns: split them\n" + "\n".join(wide[:50])


def test_one_statement_per_line():
    packed = [where for path in sources() for where in packed_statements(path)]
    assert not packed, "statements packed on one line:\n" + "\n".join(packed[:50])


def test_the_checks_can_fail(tmp_path, monkeypatch):
    sample = tmp_path / "sample.py"
    sample.write_text("x = 1; y = 2\nif x: y = 3\nz = '" + "a" * MAX_COLUMNS + "'\n"
                      "class P:\n    def f(self) -> int: ...\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_lines(sample) == [f"sample.py:3 ({MAX_COLUMNS + 6})"]
    assert packed_statements(sample) == ["sample.py:1", "sample.py:2"]
