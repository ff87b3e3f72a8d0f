"""The house's sizes (issue 56): no module of the package over 300 lines and no function over 60, so a
newcomer reads one job at a time. A change that would pass either splits by job (a new module in the
same folder, named for its job, with a docstring that says why it is apart), it does not raise the limit."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_ddp"
MODULE_LINES, FUNCTION_LINES = 300, 60


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


def over(sizes: dict[str, int], limit: int) -> list[str]:
    return [f"{name}: {size} lines (limit {limit}): split it by job" for name, size in sizes.items() if size > limit]


def test_no_module_over_300_lines() -> None:
    assert over(module_sizes(), MODULE_LINES) == []


def test_no_function_over_60_lines() -> None:
    assert over(function_sizes(), FUNCTION_LINES) == []


def test_the_check_sees_a_long_method_inside_a_class_and_a_long_module(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"class C:\n    @staticmethod\n    def f():\n{body}\n" + "#\n" * 240)
    assert over(function_sizes(tmp_path), FUNCTION_LINES) == ["m.py:C.f: 62 lines (limit 60): split it by job"]
    assert over(module_sizes(tmp_path), MODULE_LINES) == ["m.py: 303 lines (limit 300): split it by job"]
