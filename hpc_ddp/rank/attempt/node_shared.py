"""Whether a node's ranks share its node-local storage, checked once as the attempt starts.

hpc_ddp's node protocol (the liveness beats a node's ranks watch each other by, the start's reads
shared within a node, the survivors' offers gathered per node, the flight dumps) meets in the
node's private folder under ``/dev/shm`` (:func:`hpc_ddp.rundir.beats.node_dir`). Where each task
has a ``/dev/shm`` of its own (Apptainer's ``--contain``, a runtime that mounts a private tmpfs per
task), a rank never sees its node peers' beats: a false alarm waits for the first liveness period,
and each rank would publish its node's file alone. So the node's first rank leaves a mark there
before the rendezvous (:func:`leave_mark`), every other rank looks for it after (:func:`agree`),
and one small collective tells every rank whether any missed it: then all refuse at once with the
same error, before any training, naming the rank that could not see it.
"""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.core.errors import SlurmEnvError, explain
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rundir import beats, node_local
from hpc_ddp.rundir.ledger import attempt_tag

MARK = "node.mark"


def _folder(run_dir: Path, env: DistEnv) -> tuple[Path, str]:
    tag = attempt_tag(env.job_id, env.restart_count, env.in_job)
    return beats.node_dir(run_dir, tag, env.node_rank), beats.local_tag(run_dir, tag)


def leave_mark(run_dir: Path, env: DistEnv) -> None:
    """The node's first rank, before the rendezvous: the mark its node's other ranks look for."""
    if env.local_world_size > 1 and env.is_node_main:
        folder, tag = _folder(run_dir, env)
        node_local.ensure(folder)
        write_atomic(folder / MARK, tag)


def agree(run_dir: Path, env: DistEnv) -> None:
    """Collective, after the rendezvous (every rank calls it): raise on every rank when any rank
    did not find its node's mark."""
    import torch

    from hpc_ddp.rank.group import control

    folder, tag = _folder(run_dir, env)
    missed = env.local_world_size > 1 and not env.is_node_main and (
        node_local.read(folder / MARK, 4096) or b"").decode(errors="replace") != tag
    worst = int(control.max_of(torch.tensor([env.rank + 1 if missed else 0])).item())
    if worst:
        raise SlurmEnvError(explain(
            f"rank {worst - 1} does not see the files its node's first rank left in "
            f"{beats.run_folder(run_dir)} before the rendezvous: the tasks of a node do not share "
            "node-local storage (/dev/shm), which hpc_ddp's liveness beats and per-node files "
            "need", hint="a container runtime gave each task a /dev/shm of its own: drop "
            "Apptainer's --contain (-c) or a private /dev/shm mount from slurm.container.args"))
