"""Old module paths keep working for one minor version, with a warning that names the new path.

hpc_ddp 0.2 put every module in the folder of the place it runs (``core``, ``rundir``,
``login``, ``shell``, ``rank``, ``rehearsal``). Code written against 0.1 imports
``hpc_ddp.config``, ``hpc_ddp.sampler``, ``hpc_ddp.distributed`` ...: a finder on
``sys.meta_path`` answers those names with the module at its new path (the same module object,
so ``isinstance`` and monkeypatching behave) and a :class:`DeprecationWarning`. A module that
was split in two (``preemption``, ``liveness``, ``tracking``) answers with a module that looks
up each name in its successors. ``hpc_ddp.session`` is not here: that name is the public
context manager. The entry points (``python -m hpc_ddp.submit`` and the others) are real
modules at their old paths and never move. Removed in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

REMOVED_IN = "0.3"
MOVED: dict[str, tuple[str, ...]] = {
    **{m: (f"hpc_ddp.core.{m}",) for m in ("errors", "atomic", "hostlist", "slurm_env", "batching", "config",
                                           "config_checks", "helptext", "shutdown")},
    **{m: (f"hpc_ddp.rundir.{m}",) for m in ("layout", "runlock", "snapshot", "slicing", "flight", "metrics_file")},
    **{m: (f"hpc_ddp.login.{m}",) for m in ("preflight", "sbatch", "sweep", "finished", "failure_logs")},
    **{m: (f"hpc_ddp.shell.{m}",) for m in ("settle", "heal", "shell_rules", "steps")},
    **{m: (f"hpc_ddp.rank.{m}",) for m in ("run", "trainer", "task", "sampler", "distributed", "control", "watchdog",
                                           "hang", "checkpointer", "tracked", "spread", "replication", "ddp_settle",
                                           "script", "script_outcome", "script_output")},
    **{m: (f"hpc_ddp.rehearsal.{m}",) for m in ("local", "local_heal", "local_inject")},
    "preemption": ("hpc_ddp.core.stopping", "hpc_ddp.core.slurm_jobs", "hpc_ddp.rundir.ledger", "hpc_ddp.core.codes"),
    "liveness": ("hpc_ddp.rank.liveness", "hpc_ddp.rundir.losses", "hpc_ddp.core.codes"),
    "tracking": ("hpc_ddp.rank.tracking", "hpc_ddp.core.extras"),
}


def message(old: str, new: Sequence[str]) -> str:
    where = " and ".join(new)
    return (f"hpc_ddp.{old} moved to {where} in hpc_ddp 0.2; import it from there (the old path goes in "
            f"{REMOVED_IN}). The public API stays at the top: hpc_ddp.Run, session, ShardSampler, per_rank")


class _Successors(types.ModuleType):
    """An old module that was split: each name is looked up in the modules that took its parts."""

    def __init__(self, name: str, parts: Sequence[types.ModuleType]) -> None:
        super().__init__(name, f"Moved: see {', '.join(p.__name__ for p in parts)}")
        self._parts = list(parts)

    def __getattr__(self, name: str) -> Any:
        for part in self._parts:
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for p in self._parts for n in dir(p)})


class _Loader(importlib.abc.Loader):
    def __init__(self, old: str) -> None:
        self.old = old

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[self.old]
        warnings.warn(message(self.old, new), DeprecationWarning, stacklevel=_caller_level())
        parts = [importlib.import_module(n) for n in new]
        return parts[0] if len(parts) == 1 else _Successors(spec.name, parts)

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[f"hpc_ddp.{self.old}"] = module  # the module object at its new path, under the old name


class Finder(importlib.abc.MetaPathFinder):
    """Answers ``hpc_ddp.<old name>`` with its new module (see the module docstring)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        head, _, old = fullname.partition(".")
        if head != "hpc_ddp" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(old))


def _caller_level() -> int:
    """The stack level of the first frame outside the import machinery and this module: the importer's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and ("importlib" in frame.f_code.co_filename or frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith("<frozen")):
        frame, level = frame.f_back, level + 1
    return level


def install() -> None:
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.append(Finder())
