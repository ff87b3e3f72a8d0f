"""Preflight's checks of what the config asks, against itself and this node: the stop warning's
delay against the time limit, tasks against GPUs, the world size against open files, the metrics
sinks' packages, the container runtime and image, and a node to be left out with nothing to go
on with.

Apart from the run dir's and Slurm's checks: these read only the config and this machine. No torch.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.core import limits
from hpc_ddp.core.batching import node_counts, replace_problem
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.container import EXEC_RUNTIMES
from hpc_ddp.login.preflight.finding import Finding


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


def check_replace(cfg: RunConfig) -> list[Finding]:
    """A slow or sick node to be left out with nothing to go on with: it will only be named."""
    asked = [key for key, on in (("slurm.straggler.action",
                                  cfg.slurm.straggler.action == "replace"),
                                 ("slurm.health.action", cfg.slurm.health.checks != "off"
                                  and cfg.slurm.health.action == "replace")) if on]
    problem = replace_problem(cfg.slurm) if asked else ""
    if not problem:
        return []
    return [Finding("warning", asked[0], f"{' and '.join(asked)}=replace, but {problem}",
                    "without either, a slow or sick node is only named, and kept")]
