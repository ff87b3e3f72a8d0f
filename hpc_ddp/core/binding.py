"""What a rank was given to run on (its CPUs and the GPUs it sees), checked against what the run
asked for.

Since Slurm 22.05, srun does not inherit ``--cpus-per-task`` from ``sbatch``/``salloc`` (only
through ``SRUN_CPUS_PER_TASK``; 23.11 reads ``SLURM_CPUS_PER_TASK`` again), so a rank may run its
intra-op threads and its data-loader workers on one core, ten times slower and without a word
(Lightning#18650); and ``--gpu-bind`` changes how many GPUs a task sees (Lightning#13605). A rank
reads its view at the start, before any collective, and refuses to train on less than it asked for
(:class:`BindingError`, exit 2: the same srun line gives the same binding on every retry).

Pure functions of a :class:`View` and a Mapping: the rank reads its affinity, the machine's CPU
count and its visible GPUs behind the seams of :mod:`hpc_ddp.rank.attempt.placement`. No torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hpc_ddp.core.errors import HpcDdpError, explain

FIX_CPUS = ("launch every rank with `srun --cpus-per-task={asked} ...`, or `export "
            "SRUN_CPUS_PER_TASK={asked}` in the batch script before srun (python -m hpc_ddp.submit "
            "does both); since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch or "
            "salloc. Also look for a --cpu-bind in slurm.srun_args that narrows it")


class BindingError(HpcDdpError):
    """A rank was given fewer CPUs than ``slurm.cpus_per_task`` or a GPU view it cannot pick its own
    GPU from. Deterministic: the same srun line binds the same way on every retry (exit 2, never
    requeued)."""


@dataclass(frozen=True)
class View:
    """One rank's view of its node: where it may run and which GPUs it sees."""

    rank: int
    local_rank: int
    host: str
    cpus: tuple[int, ...]  # os.sched_getaffinity(0), sorted
    # os.cpu_count(): every CPU of the machine, whether this task may use it or not
    machine_cpus: int
    visible_gpus: int | None  # torch.cuda.device_count() on a GPU run; None where nobody asked
    cuda_visible: str | None  # CUDA_VISIBLE_DEVICES as the task got it (None: unset)

    @property
    def bound(self) -> bool:
        """Slurm (or a cgroup, or taskset) narrowed this task to part of the machine. An unbound
        task runs on every CPU of the machine: it cannot have more, whatever the node declares (a
        test cluster's slurmd may declare 4 CPUs on a 2-core machine with
        SlurmdParameters=config_overrides)."""
        return len(self.cpus) < self.machine_cpus

    def line(self) -> str:
        """'rank 3 (local 1): CPUs 4-7 (4), GPUs 1 visible (CUDA_VISIBLE_DEVICES=1)': for the node's
        log line."""
        gpus = "" if self.visible_gpus is None and self.cuda_visible is None else (
            f", GPUs {'?' if self.visible_gpus is None else self.visible_gpus} visible"
            + (f" (CUDA_VISIBLE_DEVICES={self.cuda_visible})" if self.cuda_visible is not None
               else ""))
        return (f"rank {self.rank} (local {self.local_rank}): CPUs {cpu_list(self.cpus)} "
                f"({len(self.cpus)}){gpus}")


def cpu_list(cpus: Iterable[int]) -> str:
    """'0-3,8,10-11': a CPU set as taskset and Slurm print it."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = None
    for cpu in [*ordered, None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts) or "none"


def gpu_share(gpus_per_node: int, tasks_per_node: int) -> int:
    """GPUs each task of a node is meant to have (at least 1 on a GPU run)."""
    return max(1, gpus_per_node // max(1, tasks_per_node))


def check_cpus(view: View, asked: int, environ: Mapping[str, str]) -> str | None:
    """Refuse a task narrowed below ``slurm.cpus_per_task``; return a warning (or None) for an
    unbound task on a machine with fewer CPUs than asked, which no srun option could fix."""
    have = len(view.cpus)
    if have >= asked:
        return None
    slurm = environ.get("SLURM_CPUS_PER_TASK")
    gave = (f"SLURM_CPUS_PER_TASK={slurm} in the task's environment" if slurm
            else "no SLURM_CPUS_PER_TASK")
    if not view.bound:
        return (f"{view.host} has {have} CPU(s) in all and slurm.cpus_per_task={asked}: every task "
                "of this node "
                f"shares those {have} ({gave}); the node declares more CPUs than the machine has")
    raise BindingError(explain(
        f"rank {view.rank} (local rank {view.local_rank}) on {view.host} may run on {have} CPU(s) "
        "(CPU"
        f"{'s' if have > 1 else ''} {cpu_list(view.cpus)} of the machine's {view.machine_cpus}) "
        "but the run asked "
        f"for slurm.cpus_per_task={asked}: its threads and data-loader workers would share {have} "
        "core(s)",
        found=f"{gave}, an affinity of {have}", expected=f"at least {asked} CPUs in the task's "
                                                         "affinity",
        hint=FIX_CPUS.format(asked=asked)), key="slurm.cpus_per_task")


def check_gpus(view: View, gpus_per_node: int, tasks_per_node: int, local_world_size: int) -> None:
    """Refuse a GPU task that cannot pick a GPU of its own: the device is the local rank's among all
    the node's GPUs, or GPU 0 when Slurm bound one GPU to the task
    (hpc_ddp.rank.group.distributed.device_index). So a task must see its share and either exactly 1
    GPU or at least one per task of its node."""
    if gpus_per_node <= 0 or view.visible_gpus is None:
        return
    share, seen = gpu_share(gpus_per_node, tasks_per_node), view.visible_gpus
    if seen >= share and (seen == 1 or seen >= local_world_size):
        return
    why = ("no GPU at all" if seen == 0 else f"{seen} GPU(s), fewer than its share of {share}"
           if seen < share
           else f"{seen} GPUs: neither its own one nor one for each of the node's "
                f"{local_world_size} tasks")
    raise BindingError(explain(
        f"rank {view.rank} (local rank {view.local_rank}) on {view.host} sees {why}; the run asked "
        "for "
        f"slurm.gpus_per_node={gpus_per_node} for slurm.tasks_per_node={tasks_per_node}",
        found=f"CUDA_VISIBLE_DEVICES={view.cuda_visible!r}, {seen} visible",
        expected=f"{share} GPU(s) bound to the task, or all {max(local_world_size, share)} of the "
                 "node's",
        hint="leave the GPU binding to hpc_ddp (each task picks the GPU of its local rank): remove "
        "a --gpu-bind or --gpus-per-task from slurm.srun_args, do not set CUDA_VISIBLE_DEVICES in "
        "slurm.setup, and set slurm.tasks_per_node equal to "
        "slurm.gpus_per_node"), key="slurm.gpus_per_node")


def node_line(host: str, node_rank: int, num_nodes: int, lines: list[str], expected: int) -> str:
    """The node's one log line: every rank's view that reached its first rank, and how many did
    not."""
    missing = expected - len(lines)
    return (f"binding on {host} (node {node_rank} of {num_nodes}): " + "; ".join(lines)
            + (f"; {missing} task(s) did not report within the wait" if missing > 0 else ""))
