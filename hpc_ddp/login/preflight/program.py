"""Preflight's look at the program the job runs: train.task's or train.loop's module and name, found
and read (``importlib``'s path finder, ``ast``) without importing anything, or train.script's file.

What ``slurm.setup`` lines may change is judged line by line (:func:`setup_changes`): a line that
activates an environment or sets ``PYTHONPATH`` may make a module importable in the job that is not
here, and a line that changes directory may make a relative script path resolve elsewhere; any other
line (``export OMP_NUM_THREADS=1``) changes neither, so a missing module or script stays an error.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Iterator, Sequence
from importlib.machinery import PathFinder
from pathlib import Path

from hpc_ddp.core.config import RunConfig
from hpc_ddp.login.preflight.finding import Finding

# a setup line that may make a module importable in the job: an environment, a module system,
# PYTHONPATH
_ENV_LINE = re.compile(r"(^|[\s;&|(])(source|\.|module|ml|conda|mamba|micromamba|activate|spack|"
                       r"pip|pip3|uv|pyenv|eval|export\s+(PYTHONPATH|PATH)\b|(PYTHONPATH|PATH)=|"
                       r"cd|pushd)(\s|$|=)")
# a line that changes the directory the job runs in
_CD_LINE = re.compile(r"(^|[;&|(]\s*)(cd|pushd)(\s|$)")


def setup_changes(setup: Sequence[str]) -> tuple[str | None, str | None]:
    """(the first setup line that may change which modules import, the first that changes
    directory)."""
    env = next((line for line in setup if _ENV_LINE.search(line.strip())), None)
    cd = next((line for line in setup if _CD_LINE.search(line.strip())), None)
    return env, cd

def module_origin(dotted: str, search: Sequence[str]) -> str | None:
    """The file ``dotted`` would be imported from, found in ``search`` without importing anything;
    None when it is not found ("namespace" for a package without ``__init__.py``)."""
    path: Sequence[str] | None = [entry or os.getcwd() for entry in search]
    parts = dotted.split(".")
    origin: str | None = None
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), path)
        if spec is None:
            return None
        path, origin = spec.submodule_search_locations, spec.origin or "namespace"
        if path is None and i < len(parts) - 1:
            return None  # a module, not a package, has no submodules
    return origin


def find_module(dotted: str, search: Sequence[str]) -> bool:
    """Whether ``dotted`` can be imported from ``search``, found without importing anything."""
    return module_origin(dotted, search) is not None


def defines(source: str, name: str) -> bool | None:
    """Whether module ``source`` binds ``name`` at top level (class, def, assignment, import): read,
    never run. None when that cannot be told without running it (``import *``, a module
    ``__getattr__``)."""
    def bound(body: list[ast.stmt]) -> Iterator[str]:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield node.name
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    yield alias.asname or alias.name.split(".")[0]
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            for block in ("body", "orelse", "finalbody", "handlers"):  # if/try/with at module level
                if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = getattr(node, block, None)
                    if isinstance(inner, list):
                        yield from bound([n for n in inner if isinstance(n, ast.stmt)] +
                                         [s for h in inner if isinstance(h, ast.ExceptHandler)
                                          for s in h.body])
    try:
        names = set(bound(ast.parse(source).body))
    except (SyntaxError, ValueError):
        return None  # the import in the job reports it, with the line
    if name in names:
        return True
    return None if "*" in names or "__getattr__" in names else False


def check_task(cfg: RunConfig, search: Sequence[str] | None = None) -> list[Finding]:
    """The program the job runs can be found from here: train.task's or train.loop's module and name
    (read with ``ast``, never imported), or train.script's file."""
    env_line, cd_line = setup_changes(cfg.slurm.setup)
    if cfg.train.script:
        return check_script(cfg.train.script, cd_line)
    level = "warning" if env_line else "error"  # that line may activate the env that has the module
    key = "train.loop" if cfg.train.loop else "train.task"
    target = cfg.train.loop or cfg.train.task
    module, _, attr = target.partition(":")
    origin = module_origin(module, sys.path if search is None
                           else search) if module else "namespace"
    if origin is None:
        why = (f"; a warning, not an error, because slurm.setup line {env_line!r} may provide it "
               "in the job"
               if env_line else "")
        return [Finding(level, key, f"module {module!r} of {key}={target} is not importable "
                        f"from here (cwd {os.getcwd()}){why}",
                        "submit from the directory that holds it, pip install "
                        "your project, or add it to PYTHONPATH; the job starts in this directory "
                        "with this "
                        "environment (only a setup line that activates an environment, loads a "
                        "module, sets "
                        "PYTHONPATH or changes directory makes this a warning)")]
    if not attr or not origin.endswith(".py"):
        return []  # a compiled or namespace module: only importing it could tell
    try:
        source = Path(origin).read_text(errors="replace")
    except OSError:
        return []
    name = attr.split(".")[0]
    if defines(source, name) is False:
        example = (f"{module}:{_first_class(origin) or 'MyTask'}" if key == "train.task"
                   else f"{module}:train")
        kind = "CLASS" if key == "train.task" else "FUNCTION"
        return [Finding(level, key, f"module {module!r} ({origin}) defines no {name!r}, named by "
                                    f"{key}={target}",
                        f"check the spelling after the colon; {key} is MODULE:{kind}, e.g. "
                        f"{example}")]
    problem = loop_signature_problem(source, name) if key == "train.loop" else None
    return [Finding("error", key, problem, f"define it as `def {name}(run): ...`: hpc_ddp calls it "
                                           "with "
                    "the run object")] if problem else []


def loop_signature_problem(source: str, name: str) -> str | None:
    """Why ``name(run)`` cannot be called, for a top-level ``def name`` in ``source``; None when it
    can (or when only running the module could tell)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name),
                None)
    if node is None:
        return None
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    required = len(positional) - len(args.defaults)
    required_kw = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    if isinstance(node, ast.AsyncFunctionDef):
        return f"train.loop's {name} is `async def`; it must be a plain function"
    if (not positional and args.vararg is None) or required > 1 or required_kw:
        shown = ", ".join(a.arg for a in positional) + (", *" + args.vararg.arg if args.vararg
                                                        else "")
        return (f"train.loop's {name}({shown}) cannot be called with the run as its one argument"
                + (f" (it needs keyword arguments {', '.join(required_kw)})" if required_kw
                   else ""))
    return None


def check_script(script: str, cd_line: str | None = None) -> list[Finding]:
    """train.script's file, from here. The job starts in this directory, so a relative path that is
    not here is an error, unless a setup line changes directory (``cd_line``: then a warning); an
    absolute one is an error whatever the setup lines do."""
    path = Path(script)
    if not path.is_file():
        level = "warning" if cd_line and not path.is_absolute() else "error"
        why = (f"; a warning, not an error, because slurm.setup line {cd_line!r} changes the "
               "directory the "
               "job runs it from" if level == "warning" else "")
        return [Finding(level, "train.script", f"train.script={script} does not exist (cwd "
                                               f"{os.getcwd()}){why}",
                        "give a path relative to the directory you submit from (the job starts "
                        "there), or an "
                        "absolute path")]
    if path.suffix != ".py":
        return [Finding("warning", "train.script", f"train.script={script} is not a .py file",
                        "hpc_ddp runs it as `python SCRIPT ARGS...` in every task")]
    return []


def _first_class(origin: str) -> str | None:
    """A task class the module does define (one with ``build_model``), for the hint."""
    try:
        tree = ast.parse(Path(origin).read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return None
    return next((node.name for node in tree.body if isinstance(node, ast.ClassDef) and any(
        isinstance(item, ast.FunctionDef) and item.name == "build_model" for item in node.body)),
                None)


