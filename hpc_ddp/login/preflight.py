"""Checks on the login node before a job is submitted: cheap now, expensive in the queue.

Each check returns :class:`Finding` s: an error stops the submit, a warning is
printed; both carry a HINT. Side effects sit behind seams (``which``, ``runner``,
the mounts table, ``sys.path``) so every check is tested with its message. No
torch, and no user code runs: the task module is located, never imported.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path

from hpc_ddp.core import limits
from hpc_ddp.core.batching import node_counts
from hpc_ddp.core.container import EXEC_RUNTIMES
from hpc_ddp.core.config import RunConfig

# submitit needs sbatch and squeue (and looks for srun); the partition check needs sinfo.
SLURM_COMMANDS = ("sbatch", "squeue", "srun", "sinfo")
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")
NODE_LOCAL_FSTYPES = ("tmpfs", "ramfs")
Runner = Callable[..., subprocess.CompletedProcess]


@dataclass(frozen=True)
class Finding:
    """One preflight result; ``level`` is "error" (stops the submit) or "warning"."""

    level: str
    key: str
    message: str
    hint: str

    def __str__(self) -> str:
        return f"{self.level} [{self.key}]: {self.message}\nHINT: {self.hint}"


def check_commands(which: Callable[[str], str | None] = shutil.which) -> list[Finding]:
    missing = [cmd for cmd in SLURM_COMMANDS if which(cmd) is None]
    if not missing:
        return []
    return [Finding("error", "PATH", f"Slurm client commands not found: {', '.join(missing)}",
                    "submit from a login node of the cluster (module load slurm, if your site uses modules); "
                    "on a laptop, rehearse with --local or look with --dry-run")]


def check_partition(partition: str | None, runner: Runner = subprocess.run) -> list[Finding]:
    """The partition must be one ``sinfo`` lists (the default partition is marked with ``*``)."""
    if not partition:
        return []
    try:
        proc = runner(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [Finding("warning", "slurm.partition", f"could not ask sinfo for partitions: {err}",
                        "check that Slurm answers (sinfo) before trusting the submit")]
    names = sorted({name.strip().rstrip("*") for name in proc.stdout.split() if name.strip()})
    if proc.returncode != 0:
        return [Finding("warning", "slurm.partition", f"sinfo failed: {(proc.stderr or '').strip()}",
                        "check that Slurm answers (sinfo) before trusting the submit")]
    if partition in names:
        return []
    return [Finding("error", "slurm.partition", f"partition {partition!r} does not exist; sinfo lists "
                    f"{', '.join(names) or 'none'}", f"set slurm.partition to one of {', '.join(names) or '(none)'}"
                    ", or slurm.partition=null for the cluster's default")]


def _mount_of(path: Path, mounts: str) -> tuple[str, str]:
    """(mount point, fstype) of the longest mount point containing ``path``, from /proc/mounts text."""
    best = ("/", "")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and (str(path) == fields[1] or str(path).startswith(fields[1].rstrip("/") + "/")):
            if len(fields[1]) >= len(best[0]):
                best = (fields[1], fields[2])
    return best


def check_run_dir(run_dir: Path, mounts: str | None = None) -> list[Finding]:
    """Writable (the nearest existing parent, if it does not exist yet) and shared between nodes."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    findings = []
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        findings.append(Finding("error", "run_dir", f"cannot write the run dir {run_dir} ({existing} is not a "
                                "writable directory)", "set run_dir=... to a directory you can write on a "
                                "shared filesystem (e.g. $HOME or /scratch/$USER)"))
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            mounts = ""
    point, fstype = _mount_of(run_dir, mounts)
    under = next((prefix for prefix in NODE_LOCAL_PREFIXES if str(run_dir).startswith(prefix + "/")
                  or str(run_dir) == prefix), None)
    if under or fstype in NODE_LOCAL_FSTYPES:
        where = f"it is under {under}" if under else f"{point} is {fstype}"
        findings.append(Finding("warning", "run_dir", f"run dir {run_dir} looks node-local ({where}): other "
                                "nodes, and a requeued job on another node, will not see its snapshots",
                                "use a shared filesystem (e.g. $HOME or /scratch/$USER) unless the job runs "
                                "on this one machine"))
    return findings


def check_signal_delay(cfg: RunConfig) -> list[Finding]:
    """After the warning the job snapshots and leaves: the delay is walltime given up per attempt."""
    delay, limit = cfg.slurm.signal_delay_s, cfg.slurm.timeout_min * 60
    if delay > limit // 4:
        return [Finding("warning", "slurm.signal_delay_s", f"the warning comes {delay}s before a {limit}s limit: "
                        f"each attempt gives up {100 * delay // limit}% of its time",
                        "lower slurm.signal_delay_s (a snapshot needs seconds to a few minutes) or raise "
                        "slurm.timeout_min")]
    if delay < 30:
        return [Finding("warning", "slurm.signal_delay_s", f"the warning comes only {delay}s before the limit",
                        "leave time for the step in flight and the snapshot write: slurm.signal_delay_s=120")]
    return []


def check_geometry(cfg: RunConfig) -> list[Finding]:
    """One task per GPU: more tasks than GPUs cannot bind a device; fewer leaves GPUs idle."""
    tasks, gpus = cfg.slurm.tasks_per_node, cfg.slurm.gpus_per_node
    if gpus and tasks > gpus:
        return [Finding("error", "slurm.tasks_per_node", f"{tasks} tasks per node but {gpus} GPUs per node: "
                        "some tasks would have no GPU", f"set slurm.tasks_per_node={gpus} (one task per GPU)")]
    if gpus and tasks < gpus:
        return [Finding("warning", "slurm.tasks_per_node", f"{tasks} tasks per node for {gpus} GPUs per node: "
                        f"{gpus - tasks} GPUs per node stay idle unless your task uses several",
                        f"set slurm.tasks_per_node={gpus} for data parallelism over every GPU")]
    if not gpus and cfg.dist.backend == "nccl":
        return [Finding("error", "dist.backend", "dist.backend=nccl but slurm.gpus_per_node=0",
                        "set slurm.gpus_per_node to the GPUs per node, or dist.backend=auto")]
    return []


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
    """Whether module ``source`` binds ``name`` at top level (class, def, assignment, import): read, never
    run. None when that cannot be told without running it (``import *``, a module ``__getattr__``)."""
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
                                         [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])
    try:
        names = set(bound(ast.parse(source).body))
    except (SyntaxError, ValueError):
        return None  # the import in the job reports it, with the line
    if name in names:
        return True
    return None if "*" in names or "__getattr__" in names else False


def check_open_files(cfg: RunConfig, rlimit: tuple[int, int] | None = None) -> list[Finding]:
    """The planned world size against this shell's limit on open files: Slurm hands the job the limits of
    the shell that submits it (unless the site's PropagateResourceLimits says otherwise), and each rank
    can raise its soft limit only up to the hard one. ``rlimit``: (soft, hard), for tests."""
    if rlimit is None:
        import resource

        rlimit = resource.getrlimit(resource.RLIMIT_NOFILE)
    world = max(node_counts(cfg.slurm.nodes)) * cfg.slurm.tasks_per_node
    problem = limits.problem(world, *rlimit)
    if not problem:
        return []
    message, hint = problem.split(" HINT: ")
    return [Finding("warning", "slurm.nodes", message, hint)]


def check_task(cfg: RunConfig, search: Sequence[str] | None = None) -> list[Finding]:
    """The program the job runs can be found from here: train.task's or train.loop's module and name
    (read with ``ast``, never imported), or train.script's file."""
    level = "warning" if cfg.slurm.setup else "error"  # setup lines may activate the env that has it
    if cfg.train.script:
        return check_script(cfg.train.script, level)
    key = "train.loop" if cfg.train.loop else "train.task"
    target = cfg.train.loop or cfg.train.task
    module, _, attr = target.partition(":")
    origin = module_origin(module, sys.path if search is None else search) if module else "namespace"
    if origin is None:
        return [Finding(level, key, f"module {module!r} of {key}={target} is not importable "
                        f"from here (cwd {os.getcwd()})", "submit from the directory that holds it, pip install "
                        "your project, or add it to PYTHONPATH; the job starts in this directory with this "
                        "environment")]
    if not attr or not origin.endswith(".py"):
        return []  # a compiled or namespace module: only importing it could tell
    try:
        source = Path(origin).read_text(errors="replace")
    except OSError:
        return []
    name = attr.split(".")[0]
    if defines(source, name) is False:
        example = f"{module}:{_first_class(origin) or 'MyTask'}" if key == "train.task" else f"{module}:train"
        kind = "CLASS" if key == "train.task" else "FUNCTION"
        return [Finding(level, key, f"module {module!r} ({origin}) defines no {name!r}, named by {key}={target}",
                        f"check the spelling after the colon; {key} is MODULE:{kind}, e.g. {example}")]
    problem = loop_signature_problem(source, name) if key == "train.loop" else None
    return [Finding("error", key, problem, f"define it as `def {name}(run): ...`: hpc_ddp calls it with "
                    "the run object")] if problem else []


def loop_signature_problem(source: str, name: str) -> str | None:
    """Why ``name(run)`` cannot be called, for a top-level ``def name`` in ``source``; None when it can
    (or when only running the module could tell)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
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
        shown = ", ".join(a.arg for a in positional) + (", *" + args.vararg.arg if args.vararg else "")
        return (f"train.loop's {name}({shown}) cannot be called with the run as its one argument"
                + (f" (it needs keyword arguments {', '.join(required_kw)})" if required_kw else ""))
    return None


def check_script(script: str, level: str) -> list[Finding]:
    path = Path(script)
    if not path.is_file():
        return [Finding(level, "train.script", f"train.script={script} does not exist (cwd {os.getcwd()})",
                        "give a path relative to the directory you submit from (the job starts there), or an "
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
        isinstance(item, ast.FunctionDef) and item.name == "build_model" for item in node.body)), None)


def check_metrics(cfg: RunConfig) -> list[Finding]:
    """A ``metrics.*`` sink switched on without its package: the job would fail at its first logged step."""
    from hpc_ddp.core.extras import EXTRAS, missing_extras

    return [Finding("error", f"metrics.{key}", f"metrics.{key}=true needs the {EXTRAS[key][0]} package, which is "
                    "not installed", f"pip install 'hpc_ddp[{EXTRAS[key][1]}]' (here and in the job's environment), "
                    f"or set metrics.{key}=false") for key in missing_extras(cfg.metrics)]


def check_container(cfg: RunConfig, which: Callable[[str], str | None] = shutil.which) -> list[Finding]:
    """The container runtime and image, as far as the login node can tell (compute nodes may differ: the job
    checks again, after slurm.setup, and stops with an error naming the key)."""
    box = cfg.slurm.container
    found: list[Finding] = []
    if box.runtime in EXEC_RUNTIMES and which(box.runtime) is None:
        found.append(Finding("warning", "slurm.container.runtime", f"{box.runtime} is not on this node's PATH; "
                             "the job stops at its start if its nodes lack it too", f"load it in slurm.setup (e.g. "
                             f"module load {box.runtime}), or check the runtime your site offers"))
    if box.runtime and box.image.startswith("/") and not Path(box.image).exists():
        found.append(Finding("warning", "slurm.container.image", f"image {box.image} does not exist on this node",
                             "give a path the compute nodes can read (a shared filesystem)"))
    return found


def preflight(cfg: RunConfig, *, slurm: bool = True, which: Callable[[str], str | None] = shutil.which,
              runner: Runner = subprocess.run) -> list[Finding]:
    """All checks for ``cfg``; ``slurm=False`` leaves out those that ask Slurm (for --emit-sbatch)."""
    findings = [*check_run_dir(Path(cfg.run_dir)), *check_signal_delay(cfg), *check_geometry(cfg),
                *check_open_files(cfg), *check_task(cfg), *check_metrics(cfg), *check_container(cfg, which)]
    if slurm:
        commands = check_commands(which)
        findings = commands + findings + ([] if commands else check_partition(cfg.slurm.partition, runner))
    return findings
