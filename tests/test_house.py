"""The house's sizes (issue 56): no module of the package over 300 lines, no function over 60 and no
line over 100 characters, so a newcomer reads one job at a time, side by side. A change that would pass
a limit splits by job (a new module in the same folder, named for its job, with a docstring that says
why it is apart), it does not raise the limit; ``python dev/rewrap.py FILE...`` wraps long lines in the
house's style (ruff's E501 at ``line-length = 100`` in pyproject.toml says the same)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_ddp"
MODULE_LINES, FUNCTION_LINES, LINE_CHARS = 300, 60, 100


def module_sizes(package: Path = PACKAGE) -> dict[str, int]:
    return {str(p.relative_to(package)): len(p.read_text().splitlines()) for p in sorted(package.rglob("*.py"))}


def function_sizes(package: Path = PACKAGE) -> dict[str, int]:
    """Every function's lines, decorators and docstring included, named ``path:Outer.inner``."""
    sizes: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    sizes[f"{path.relative_to(package)}:{name}"] = (child.end_lineno or child.lineno) - first + 1
                    walk(child, f"{name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
        walk(ast.parse(path.read_text()), "")
    return sizes


def long_lines(package: Path = PACKAGE) -> dict[str, int]:
    """Every line over ``LINE_CHARS`` characters, named ``path:line``."""
    return {f"{p.relative_to(package)}:{n}": len(line) for p in sorted(package.rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if len(line) > LINE_CHARS}


def over(sizes: dict[str, int], limit: int) -> list[str]:
    return [f"{name}: {size} lines (limit {limit}): split it by job" for name, size in sizes.items() if size > limit]


def test_no_module_over_300_lines() -> None:
    assert over(module_sizes(), MODULE_LINES) == []


def test_no_function_over_60_lines() -> None:
    assert over(function_sizes(), FUNCTION_LINES) == []


def test_no_line_over_100_characters() -> None:
    assert [f"{where}: {n} characters (limit {LINE_CHARS}): python dev/rewrap.py wraps it"
            for where, n in long_lines().items()] == []


def test_the_check_sees_a_long_method_inside_a_class_a_long_module_and_a_long_line(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"class C:\n    @staticmethod\n    def f():\n{body}\n" + "#\n" * 240)
    assert over(function_sizes(tmp_path), FUNCTION_LINES) == ["m.py:C.f: 62 lines (limit 60): split it by job"]
    assert over(module_sizes(tmp_path), MODULE_LINES) == ["m.py: 303 lines (limit 300): split it by job"]
    (tmp_path / "n.py").write_text("x = 1\n" + "y = '" + "a" * 95 + "'\n")
    assert long_lines(tmp_path) == {"n.py:2": 101}
