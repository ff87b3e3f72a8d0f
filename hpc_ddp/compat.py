"""Old module paths keep working for one minor version, with a warning that names the new path.

hpc_ddp 0.2 put every module in the folder of the place it runs (``core``, ``rundir``, ``login``,
``shell``, ``rank``, ``rehearsal``). Code written against 0.1 imports ``hpc_ddp.config``,
``hpc_ddp.sampler``, ``hpc_ddp.distributed`` ...: a finder on ``sys.meta_path`` answers those names
with the module at its new path (the same module object, so ``isinstance`` and monkeypatching
behave) and a :class:`DeprecationWarning`. A module that was split (``preemption``, ``liveness``,
``tracking``, ``tracked``) answers with a module that looks up each name in its successors.
``hpc_ddp.session`` is not here: that name is the public context manager. A dotted key
(``core.config_checks``) is a 0.2 path that issue 56 moved into a folder of its family
(``core/config/``). The entry points (``python -m hpc_ddp.submit`` and the others) are real modules
at their old paths and never move. Removed in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

REMOVED_IN = "0.3"
MOVED: dict[str, tuple[str, ...]] = {
    **{m: (f"hpc_ddp.core.{m}",) for m in ("errors", "atomic", "hostlist", "slurm_env", "batching",
                                           "config", "helptext", "shutdown")},
    "config_checks": ("hpc_ddp.core.config.checks",),
    **{m: (f"hpc_ddp.rundir.{m}",) for m in ("layout", "runlock", "snapshot", "slicing", "flight",
                                             "metrics_file")},
    **{m: (f"hpc_ddp.login.{m}",) for m in ("preflight", "sbatch", "sweep", "finished",
                                            "failure_logs")},
    **{m: (f"hpc_ddp.shell.{m}",) for m in ("settle", "heal", "shell_rules", "steps")},
    **{m: (f"hpc_ddp.rank.loop.{m}",) for m in ("run", "trainer", "task", "sampler")},
    **{m: (f"hpc_ddp.rank.group.{m}",) for m in ("distributed", "control")},
    **{m: (f"hpc_ddp.rank.watch.{m}",) for m in ("watchdog", "hang")},
    **{m: (f"hpc_ddp.rank.state.{m}",) for m in ("checkpointer", "spread", "replication",
                                                 "ddp_settle")},
    "script": ("hpc_ddp.rank.script.wrapper",), "script_outcome": ("hpc_ddp.rank.script.outcome",),
    "script_output": ("hpc_ddp.rank.script.output",),
    **{m: (f"hpc_ddp.rehearsal.{m}",) for m in ("local", "local_heal", "local_inject")},
    "preemption": ("hpc_ddp.core.codes", "hpc_ddp.core.stopping", "hpc_ddp.core.slurm_jobs",
                   "hpc_ddp.rundir.ledger"),
    "liveness": ("hpc_ddp.core.codes", "hpc_ddp.rundir.losses", "hpc_ddp.rank.watch.liveness",
                 "hpc_ddp.rank.watch.liveness_start", "hpc_ddp.rank.watch.declaration"),
    "tracking": ("hpc_ddp.rank.metrics.sinks", "hpc_ddp.core.extras"),
    # issue 56 split these two by job: the per-rank resume and the liveness start moved out
    "tracked": ("hpc_ddp.rank.state.tracked", "hpc_ddp.rank.state.per_rank_resume"),
    # issue 56: the prefix families became folders; a dotted key is the 0.2 path under hpc_ddp
    # core/config/:
    "core.config_checks": ("hpc_ddp.core.config.checks",),
    "core.config_schema": ("hpc_ddp.core.config.schema",),
    "core.config_diff": ("hpc_ddp.core.config.diff",),
    "core.config_env": ("hpc_ddp.core.config.env",),
    "core.config_hints": ("hpc_ddp.core.config.hints",),
    "core.config_items": ("hpc_ddp.core.config.items",),

    # login/status/ and login/preflight/:
    **{f"login.status_{m}": (f"hpc_ddp.login.status.{m}",) for m in ("read", "plot", "runs")},
    **{f"login.preflight_{m}": (f"hpc_ddp.login.preflight.{m}",) for m in ("program", "finding")},
    "login.slurm_version": ("hpc_ddp.login.preflight.slurm_version",),

    # rundir/snapshot/:
    "rundir.snapshot_steps": ("hpc_ddp.rundir.snapshot.steps",),
    "rundir.snapshot_verify": ("hpc_ddp.rundir.snapshot.verify",),
    "rundir.snapshot_write": ("hpc_ddp.rundir.snapshot.write",),

}


def message(old: str, new: Sequence[str]) -> str:
    where = " and ".join(new)
    return (f"hpc_ddp.{old} moved to {where} in hpc_ddp 0.2; import it from there (the old path "
            "goes in "
            f"{REMOVED_IN}). The public API stays at the top: hpc_ddp.Run, session, ShardSampler, "
            "per_rank")


class _Successors(types.ModuleType):
    """An old module that was split: each name is looked up in the modules that took its parts, and
    its warning names the one module that has it now."""

    def __init__(self, name: str, parts: Sequence[types.ModuleType]) -> None:
        super().__init__(name, f"Moved: see {', '.join(p.__name__ for p in parts)}")
        self._parts = list(parts)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        having = [part for part in self._parts if hasattr(part, name)]
        home = [part for part in having
                if getattr(getattr(part, name), "__module__", None) == part.__name__]
        if having:
            # where a function or class is defined, else the first that has it
            part = (home or having)[0]
            warnings.warn(f"{self.__name__}.{name} moved to {part.__name__}.{name} in hpc_ddp 0.2; "
                          "import it from "
                          f"there (the old path goes in {REMOVED_IN})", DeprecationWarning,
                          stacklevel=2)
            return getattr(part, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}: it was split in "
                             "hpc_ddp 0.2 into "
                             f"{', '.join(p.__name__ for p in self._parts)}, and none of them has "
                             "it")

    def __dir__(self) -> list[str]:
        return sorted({n for p in self._parts for n in dir(p)})


# duck-typed: importlib.abc costs the CLI ~6 ms (it imports importlib.resources; issue 56, B1)
class _Loader:
    def __init__(self, old: str) -> None:
        self.old = old

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[self.old]
        parts = [importlib.import_module(n) for n in new]
        if len(parts) == 1:  # a split module warns per name instead, naming where that name went
            # stacklevel 2: the importer's line (the warnings module skips the import machinery's
            # frames)
            warnings.warn(message(self.old, new), DeprecationWarning, stacklevel=2)
            return parts[0]
        return _Successors(spec.name, parts)

    def exec_module(self, module: types.ModuleType) -> None:
        # the module object at its new path, under the old name
        sys.modules[f"hpc_ddp.{self.old}"] = module


class Finder:
    """Answers ``hpc_ddp.<old name>`` with its new module (see the module docstring)."""

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        head, _, old = fullname.partition(".")
        if fullname == "hpc_ddp.session":
            raise ModuleNotFoundError(
                "hpc_ddp.session is the context manager (`with hpc_ddp.session() as run:`), not a "
                "module: in hpc_ddp "
                "0.1 importing the module replaced the function. The module is "
                "hpc_ddp.rank.attempt.session; the "
                "function is defined in hpc_ddp.rank.worker", name=fullname)
        if head != "hpc_ddp" or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(old))


def install() -> None:
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.append(Finder())
