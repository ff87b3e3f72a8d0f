"""Variables that something else set over Slurm's inside a step: Slurm's win, and the rank says so.

Sites enable enroot's PyTorch hook for NGC images, and many sites and tutorials wrap each task in a
script that exports ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` from Slurm's
variables (and pyxis gives the container's variables precedence). They are torchrun's names, but
not torchrun's doing: no ``LOCAL_WORLD_SIZE``, and ``MASTER_ADDR`` from ``SLURM_JOB_NODELIST``,
which names a node the job lost after a heal. Read as torchrun's, every rank failed (exit 2, never
retried) or rendezvoused at a node that is gone (issue 57).

So inside a Slurm step (``SLURM_STEP_ID``) that torchrun did not start (it always sets
``TORCHELASTIC_RUN_ID``), the rank variables (and the ``MASTER_PORT`` set with them: the hook's
is fixed) are set aside and Slurm's derive the place; a ``MASTER_ADDR`` that names a node of the
job outside this step is set aside too. Pure: the session
logs :func:`disagreements` once, naming each variable and the likely setter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpc_ddp.core.hostlist import expand_hostlist

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE")
TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")
SETTER = "a container hook (enroot's PyTorch hook) or a wrapper script"


def foreign_ranks(env: Mapping[str, str]) -> bool:
    """Rank variables in a Slurm step that torchrun did not start."""
    return (any(env.get(v) for v in STEP_VARS) and any(v in env for v in RANK_VARS)
            and not any(v in env for v in TORCHRUN_MARKERS))


def stale_master(env: Mapping[str, str]) -> bool:
    """``MASTER_ADDR`` names a node of the job that this step does not run on (a hook took the
    job's first node; the heal left it out)."""
    addr = env.get("MASTER_ADDR", "").strip()
    step, job = env.get("SLURM_STEP_NODELIST"), env.get("SLURM_JOB_NODELIST")
    if not addr or not step or not job or not any(env.get(v) for v in STEP_VARS):
        return False
    try:
        return addr in expand_hostlist(job) and addr not in expand_hostlist(step)
    except Exception:  # noqa: BLE001 - an unreadable list is said where it is derived
        return False


def slurm_view(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` as Slurm set it: foreign rank variables and a stale MASTER_ADDR left out."""
    # a hook's MASTER_PORT is fixed (enroot's: 29500): two jobs on one node would share it, and the
    # attempt's own unguessable store ports would give way to it
    drop = [*((*RANK_VARS, "MASTER_PORT") if foreign_ranks(env) else ()),
            *(("MASTER_ADDR",) if stale_master(env) else ())]
    if not drop:
        return env
    return {k: v for k, v in env.items() if k not in drop}


def disagreements(env: Mapping[str, str], derived: Any) -> list[str]:
    """What was set aside that disagreed with the place Slurm gave (``derived``: the DistEnv), one
    line each; empty when nothing was, or everything agreed."""
    said = []
    if foreign_ranks(env):
        ours = {"RANK": derived.rank, "LOCAL_RANK": derived.local_rank,
                "WORLD_SIZE": derived.world_size, "LOCAL_WORLD_SIZE": derived.local_world_size,
                "GROUP_RANK": derived.node_rank, "GROUP_WORLD_SIZE": derived.num_nodes}
        said += [f"{name}={env[name]} but Slurm says {ours[name]}" for name in RANK_VARS
                 if name in env and env[name].strip() != str(ours[name])]
        if env.get("MASTER_PORT"):
            said.append(f"MASTER_PORT={env['MASTER_PORT']} (set with them) gives way to the "
                        "attempt's own port")
    if stale_master(env):
        said.append(f"MASTER_ADDR={env['MASTER_ADDR']} is a node of the job this step does not "
                    f"run on (the step's first node {derived.master_addr} is used)")
    return said


def warning(lines: list[str]) -> str:
    """The one warning a rank logs for :func:`disagreements`."""
    return ("Slurm's variables win over these, set in the task's environment by " + SETTER
            + " (torchrun did not start this task): " + "; ".join(lines) + ". Nothing to do: "
            "each rank's place comes from Slurm; a wrapper script of yours can drop its exports")


def launched_alone(derived: Any, nodes: Any, tasks_per_node: int) -> str | None:
    """Why a task that found no rank variables at all must not train, when the run asks for more
    than one rank; None when it may.

    A container runtime's ``--cleanenv``/``--containall`` (or ``env -i`` in a wrapper) passes no
    Slurm variable: each of the N tasks would be rank 0 of 1, and N trainings would share one run
    dir. ``derived`` is :func:`hpc_ddp.core.slurm_env.from_environ`'s answer; ``nodes`` and
    ``tasks_per_node`` are the run's ``slurm`` section."""
    from hpc_ddp.core.batching import node_counts

    fewest = node_counts(nodes)[0] * tasks_per_node
    if derived.source != "single" or fewest <= 1:
        return None
    return (f"this task found no rank variables (no SLURM_PROCID or SLURM_NTASKS of a Slurm step, "
            f"no RANK or WORLD_SIZE of torchrun): it would train as rank 0 of 1, but the run asks "
            f"for slurm.nodes={nodes} x slurm.tasks_per_node={tasks_per_node} = {fewest} ranks "
            "or more. Something between srun and this process cleared the environment: a "
            "container runtime's --cleanenv, -e, --containall or -C (slurm.container.args), or a "
            "wrapper that starts Python with `env -i`. Refused before the run dir was touched")
