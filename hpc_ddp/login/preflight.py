"""Checks on the login node before a job is submitted: cheap now, expensive in the queue.

Each check returns :class:`Finding` s: an error stops the submit, a warning is
printed; both carry a HINT. Side effects sit behind seams (``which``, ``runner``,
the mounts table, ``sys.path``) so every check is tested with its message. No
torch, and no user code runs: the task module is located, never imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.slurm_local.conf import ClusterSpec
from hpc_ddp.core import limits
from hpc_ddp.core.batching import node_counts
from hpc_ddp.core.container import EXEC_RUNTIMES
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.run_dir_mode import loose_folders, run_dir_folders
from hpc_ddp.login.slurm_version import planned_for
from hpc_ddp.login.preflight_finding import Finding
from hpc_ddp.login.preflight_program import check_script, check_task, defines, find_module, module_origin

__all__ = ["Finding", "check_script", "check_task", "defines", "find_module", "module_origin",
           "preflight"]
# submitit needs sbatch and squeue (and looks for srun); the partition check needs sinfo.
SLURM_COMMANDS = ("sbatch", "squeue", "srun", "sinfo")
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")
NODE_LOCAL_FSTYPES = ("tmpfs", "ramfs")
Runner = Callable[..., subprocess.CompletedProcess]


def check_commands(which: Callable[[str], str | None] = shutil.which) -> list[Finding]:
    missing = [cmd for cmd in SLURM_COMMANDS if which(cmd) is None]
    if not missing:
        return []
    return [Finding("error", "PATH", f"Slurm client commands not found: {', '.join(missing)}",
                    "submit from a login node of the cluster (module load slurm, if your site uses "
                    "modules); "
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
        return [Finding("warning", "slurm.partition",
                        f"sinfo failed: {(proc.stderr or '').strip()}",
                        "check that Slurm answers (sinfo) before trusting the submit")]
    if partition in names:
        return []
    return [Finding("error", "slurm.partition", f"partition {partition!r} does not exist; sinfo "
                                                "lists "
                    f"{', '.join(names) or 'none'}", "set slurm.partition to one of "
                                                     f"{', '.join(names) or '(none)'}"
                    ", or slurm.partition=null for the cluster's default")]


def check_slurm_version(cfg: RunConfig, runner: Runner = subprocess.run) -> list[Finding]:
    """A note of the Slurm behaviour the job is planned for (:mod:`hpc_ddp.login.slurm_version`)."""
    return [Finding("note", "slurm.cpus_per_task", planned_for(cfg.slurm.cpus_per_task, runner),
                    "")]
def check_partition_limits(cfg: RunConfig, runner: Runner = subprocess.run) -> list[Finding]:
    """The request against the partition's nodes, MaxNodes, MinNodes and MaxTime
    (:mod:`hpc_ddp.login.partition`): what can never start is an error. With several partitions
    (``a,b``) only what none of them can run."""
    from hpc_ddp.login.partition import limit_problems, show_partitions

    slurm = cfg.slurm
    partitions = show_partitions(slurm.partition, runner)
    if isinstance(partitions, str):
        return [Finding("warning", "slurm.partition", "could not read the partition's limits: "
                                                      f"{partitions}",
                        "check that Slurm answers (scontrol show partition) before trusting the "
                        "submit")]
    each = [[Finding(*p) for p in limit_problems(part, slurm.nodes, slurm.spare_nodes,
                                                 slurm.timeout_min)]
            for part in partitions]
    # a request that fits: are enough of the nodes up now?
    for part, found in zip(partitions, each):
        if not any(f.level == "error" for f in found):
            found += _down_nodes(part.get("PartitionName", ""), node_counts(slurm.nodes)[0]
                                 + slurm.spare_nodes,
                                 runner)
    if len(each) > 1 and any(not any(f.level == "error" for f in found) for found in each):
        # one partition can run it
        return [f for found in each for f in found if f.level == "warning"]
    return [f for found in each for f in found]


def _down_nodes(name: str, needed: int, runner: Runner) -> list[Finding]:
    """A warning when fewer of the partition's nodes are up than the job needs: it waits until they
    return."""
    from hpc_ddp.login.partition import usable_nodes

    usable = usable_nodes(name, runner) if name else None
    if usable is None or usable >= needed:
        return []
    return [Finding("warning", "slurm.nodes", f"only {usable} of partition {name!r}'s nodes can "
                                              "take a job now (the "
                    f"others are down, drained or reserved: sinfo -p {name}) and the job needs "
                    f"{needed}",
                    "it waits until enough return (squeue shows ReqNodeNotAvail or Resources); "
                    "fewer slurm.nodes "
                    "start sooner")]


def _mount_of(path: Path, mounts: str) -> tuple[str, str]:
    """(mount point, fstype) of the longest mount point containing ``path``, from /proc/mounts
    text."""
    best = ("/", "")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and (str(path) == fields[1]
                                 or str(path).startswith(fields[1].rstrip("/") + "/")):
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
        findings.append(Finding("error", "run_dir", f"cannot write the run dir {run_dir} "
                                                    f"({existing} is not a "
                                "writable directory)", "set run_dir=... to a directory you can "
                                                       "write on a "
                                "shared filesystem (e.g. $HOME or /scratch/$USER)"))
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            mounts = ""
    point, fstype = _mount_of(run_dir, mounts)
    under = next((prefix for prefix in NODE_LOCAL_PREFIXES if str(run_dir).startswith(prefix + "/")
                  or str(run_dir) == prefix), None)
    # the local cluster's shared root: every node sees it
    if ClusterSpec.shared in (run_dir, *run_dir.parents):
        under = None
    if under or fstype in NODE_LOCAL_FSTYPES:
        where = f"it is under {under}" if under else f"{point} is {fstype}"
        findings.append(Finding("warning", "run_dir", f"run dir {run_dir} looks node-local "
                                                      f"({where}): other "
                                "nodes, and a requeued job on another node, will not see its "
                                "snapshots",
                                "use a shared filesystem (e.g. $HOME or /scratch/$USER) unless the "
                                "job runs "
                                "on this one machine"))
    return findings


def check_run_dir_writers(cfg: RunConfig) -> list[Finding]:
    """A run dir, slurm/ or compile_cache/ that others may write beyond run_dir_mode: they could run
    code as you (docs/security.md). A run dir not made yet is made with run_dir_mode."""
    return [Finding("warning", "run_dir_mode", what, fix)
            for what, fix in loose_folders(run_dir_folders(cfg.run_dir), cfg.run_dir_mode)]


def check_signal_delay(cfg: RunConfig) -> list[Finding]:
    """After the warning the job snapshots and leaves: the delay is walltime given up per
    attempt."""
    delay, limit = cfg.slurm.signal_delay_s, cfg.slurm.timeout_min * 60
    if delay > limit // 4:
        return [Finding("warning", "slurm.signal_delay_s", f"the warning comes {delay}s before a "
                                                           f"{limit}s limit: "
                        f"each attempt gives up {100 * delay // limit}% of its time",
                        "lower slurm.signal_delay_s (a snapshot needs seconds to a few minutes) or "
                        "raise "
                        "slurm.timeout_min")]
    if delay < 30:
        return [Finding("warning", "slurm.signal_delay_s", f"the warning comes only {delay}s "
                                                           "before the limit",
                        "leave time for the step in flight and the snapshot write: "
                        "slurm.signal_delay_s=120")]
    return []


def check_geometry(cfg: RunConfig) -> list[Finding]:
    """One task per GPU: more tasks than GPUs cannot bind a device; fewer leaves GPUs idle."""
    tasks, gpus = cfg.slurm.tasks_per_node, cfg.slurm.gpus_per_node
    if gpus and tasks > gpus:
        return [Finding("error", "slurm.tasks_per_node", f"{tasks} tasks per node but {gpus} GPUs "
                                                         "per node: "
                        "some tasks would have no GPU", f"set slurm.tasks_per_node={gpus} (one "
                                                        "task per GPU)")]
    if gpus and tasks < gpus:
        return [Finding("warning", "slurm.tasks_per_node", f"{tasks} tasks per node for {gpus} "
                                                           "GPUs per node: "
                        f"{gpus - tasks} GPUs per node stay idle unless your task uses several",
                        f"set slurm.tasks_per_node={gpus} for data parallelism over every GPU")]
    if not gpus and cfg.dist.backend == "nccl":
        return [Finding("error", "dist.backend", "dist.backend=nccl but slurm.gpus_per_node=0",
                        "set slurm.gpus_per_node to the GPUs per node, or dist.backend=auto")]
    return []


def check_open_files(cfg: RunConfig, rlimit: tuple[int, int] | None = None) -> list[Finding]:
    """The planned world size against this shell's limit on open files: Slurm hands the job the
    limits of the shell that submits it (unless the site's PropagateResourceLimits says otherwise),
    and each rank can raise its soft limit only up to the hard one. ``rlimit``: (soft, hard), for
    tests."""
    if rlimit is None:
        import resource

        rlimit = resource.getrlimit(resource.RLIMIT_NOFILE)
    world = max(node_counts(cfg.slurm.nodes)) * cfg.slurm.tasks_per_node
    problem = limits.problem(world, *rlimit)
    if not problem:
        return []
    message, hint = problem.split(" HINT: ")
    return [Finding("warning", "slurm.nodes", message, hint)]


def check_metrics(cfg: RunConfig) -> list[Finding]:
    """A ``metrics.*`` sink switched on without its package: the job would fail at its first logged
    step."""
    from hpc_ddp.core.extras import EXTRAS, missing_extras

    return [Finding("error", f"metrics.{key}", f"metrics.{key}=true needs the {EXTRAS[key][0]} "
                                               "package, which is "
                    "not installed", f"pip install 'hpc_ddp[{EXTRAS[key][1]}]' (here and in the "
                                     "job's environment), "
                    f"or set metrics.{key}=false") for key in missing_extras(cfg.metrics)]


def check_container(cfg: RunConfig, which: Callable[[str],
                                                    str | None] = shutil.which) -> list[Finding]:
    """The container runtime and image, as far as the login node can tell (compute nodes may differ:
    the job checks again, after slurm.setup, and stops with an error naming the key)."""
    box = cfg.slurm.container
    found: list[Finding] = []
    if box.runtime in EXEC_RUNTIMES and which(box.runtime) is None:
        found.append(Finding("warning", "slurm.container.runtime",
                             f"{box.runtime} is not on this node's PATH; "
                             "the job stops at its start if its nodes lack it too",
                             f"load it in slurm.setup (e.g. "
                             f"module load {box.runtime}), or check the runtime your site offers"))
    if box.runtime and box.image.startswith("/") and not Path(box.image).exists():
        found.append(Finding("warning", "slurm.container.image",
                             f"image {box.image} does not exist on this node",
                             "give a path the compute nodes can read (a shared filesystem)"))
    return found


def preflight(cfg: RunConfig, *, slurm: bool = True,
              which: Callable[[str], str | None] = shutil.which,
              runner: Runner = subprocess.run) -> list[Finding]:
    """All checks for ``cfg``; ``slurm=False`` leaves out those that ask Slurm (for
    --emit-sbatch)."""
    findings = [*check_run_dir(Path(cfg.run_dir)), *check_run_dir_writers(cfg),
                *check_signal_delay(cfg),
                *check_geometry(cfg), *check_open_files(cfg), *check_task(cfg), *check_metrics(cfg),
                *check_container(cfg, which)]
    if slurm:
        commands = check_commands(which)
        asked = [] if commands else check_partition(cfg.slurm.partition, runner)
        # of a partition that exists
        limits_of = [] if commands or asked else check_partition_limits(cfg, runner)
        findings = commands + findings + asked + limits_of + ([] if commands
                                                              else check_slurm_version(cfg, runner))
    return findings
