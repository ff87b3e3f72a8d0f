"""The house's sizes (issue 56): a module at most 300 lines, a function at most 60, so a newcomer reads one
job at a time. Modules and functions over the limit when the rule came are listed with their size then:
they may shrink, never grow, and an entry that fits the limit again must leave the list (a ratchet, so the
list only gets shorter). Splitting one is a change of its own; the list says where to start."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_ddp"
MODULE_LINES, FUNCTION_LINES = 300, 60

# path under hpc_ddp/: its line count when the rule came (never more)
LONG_MODULES: dict[str, int] = {
    "core/config.py": 329,
    "core/slurm_env.py": 306,
    "rehearsal/local.py": 354,
    "slurm_local/daemons.py": 305,
}
# "path:function" (methods as Class.method): its line count when the rule came (never more)
LONG_FUNCTIONS: dict[str, int] = {
    "rank/script/wrapper.py:run_script": 71,
    "rehearsal/local.py:_rehearse": 75,
    "rehearsal/local.py:launch": 74,
    "shell/settle.py:settle": 66,
}


def module_sizes() -> dict[str, int]:
    return {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}


def function_sizes() -> dict[str, int]:
    """Every function's lines, decorators and docstring included, named ``path:Outer.inner``."""
    sizes: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    sizes[f"{path.relative_to(PACKAGE)}:{name}"] = (child.end_lineno or child.lineno) - first + 1
                    walk(child, f"{name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
        walk(ast.parse(path.read_text()), "")
    return sizes


def over(sizes: dict[str, int], limit: int, known: dict[str, int]) -> list[str]:
    """What breaks the rule: a new entry over the limit, a known one that grew, a known one that fits now."""
    found = []
    for name, size in sizes.items():
        if size > limit and name not in known:
            found.append(f"{name}: {size} lines (limit {limit}): split it")
        elif name in known and size > known[name]:
            found.append(f"{name}: {size} lines, grew from {known[name]}: split it rather than grow it")
    for name, size in known.items():
        if sizes.get(name, 0) <= limit:
            found.append(f"{name}: now {sizes.get(name, 'gone')} (limit {limit}): remove it from the list")
    return found


def test_no_module_over_300_lines_beyond_the_list_and_none_grows() -> None:
    assert over(module_sizes(), MODULE_LINES, LONG_MODULES) == []


def test_no_function_over_60_lines_beyond_the_list_and_none_grows() -> None:
    assert over(function_sizes(), FUNCTION_LINES, LONG_FUNCTIONS) == []


def test_the_ratchet_names_a_new_long_function_a_grown_one_and_a_stale_entry() -> None:
    sizes = {"a.py:f": 61, "b.py:g": 80, "c.py:h": 50}
    assert over(sizes, 60, {"b.py:g": 70, "c.py:h": 90}) == [
        "a.py:f: 61 lines (limit 60): split it",
        "b.py:g: 80 lines, grew from 70: split it rather than grow it",
        "c.py:h: now 50 (limit 60): remove it from the list"]
