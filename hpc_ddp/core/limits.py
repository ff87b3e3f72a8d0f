"""Open files against the world size: a rank's sockets grow with the job, and many clusters cap them at 1,024.

gloo connects a rank to every other rank of a group when the group is made, unless
``TORCH_GLOO_LAZY_INIT=1`` has it connect a pair on its first message (hpc_ddp sets it:
:func:`hpc_ddp.rank.distributed.gloo_env`). Even then rank 0 hears from every rank (the
commit's entries, the refusals and the flight summary gather there), so its descriptors grow
with the world size; the other ranks' stay near constant. B12 (docs/performance.md) measured
both with real gloo ranks; :func:`needed` is that fit with room to spare.

Two seams: the rank raises its soft limit to the hard one when it needs more
(:func:`raise_soft_limit`, the ``resource`` module behind a getter and a setter), and preflight
on the login node warns when even the hard limit is short (Slurm gives the job the limits of the
shell that submitted it, unless the site's ``PropagateResourceLimits`` says otherwise). No torch.
"""

from __future__ import annotations

from collections.abc import Callable

BASE = 64  # the interpreter, torch's libraries, logs, the store, the liveness files: measured ~40, with room
PER_RANK_EAGER = 3  # every pair of the training group, the control group and the node's group: measured 3
PER_RANK_LAZY = 1.2  # rank 0 with lazy connections: one socket to each rank that sends to it (measured ~1)


def needed(world_size: int, lazy: bool = True) -> int:
    """Descriptors the busiest rank (rank 0) needs at this world size, with room to spare."""
    per_rank = PER_RANK_LAZY if lazy else PER_RANK_EAGER
    return int(BASE + per_rank * max(0, world_size - 1)) + 64


def problem(world_size: int, soft: int, hard: int, lazy: bool = True) -> str | None:
    """What goes wrong when the hard limit is below what ``world_size`` ranks need; None when it is enough.
    (A soft limit below it is raised by each rank itself up to the hard one.)"""
    want = needed(world_size, lazy)
    if hard < 0 or hard >= want:  # RLIM_INFINITY is -1
        return None
    return (f"{world_size} ranks need about {want} open files on rank 0 (its sockets to the other ranks), but the "
            f"hard limit here is {hard} (soft {soft}): the job would fail to connect its process group with "
            f"'Too many open files'. HINT: ask for a higher limit (`ulimit -Hn` on the compute nodes; Slurm hands the "
            f"job the limits of the shell you submit from unless the site says otherwise), or use fewer ranks")


def raise_soft_limit(want: int, get: Callable[[], tuple[int, int]] | None = None,
                     set_: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """Raise this process's soft limit on open files to ``want`` (capped by the hard limit) when it is lower;
    return (soft, hard) as they are afterwards."""
    if get is None or set_ is None:
        import resource

        get = get or (lambda: resource.getrlimit(resource.RLIMIT_NOFILE))
        set_ = set_ or (lambda soft, hard: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    soft, hard = get()
    if 0 <= soft < want:
        target = want if hard < 0 else min(want, hard)
        if target > soft:
            set_(target, hard)
            soft = target
    return soft, hard
