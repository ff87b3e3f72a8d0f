"""Open files against the world size: a rank's sockets grow with the job, and many clusters cap them
at 1,024.

gloo connects a rank to every other rank of a group: at once when the group is made, or, for
hpc_ddp's control groups (made with ``TORCH_GLOO_LAZY_INIT=1``), on the first message between
them; and a gather of pickled objects exchanges sizes with every rank, so after a snapshot's
commit every pair of the control group is connected either way. B12 (docs/performance.md)
measured 31 descriptors plus 3.16 per other rank with real gloo ranks (2 to 32, a gloo training
group, the control group, each node's group), whether the control groups connect lazily or not;
:func:`needed` is that fit with room to spare. At 4,096 ranks that is about 13,000.

Two seams: the rank raises its soft limit to the hard one when it needs more
(:func:`raise_soft_limit`, the ``resource`` module behind a getter and a setter), and preflight
on the login node warns when even the hard limit is short (Slurm gives the job the limits of the
shell that submitted it, unless the site's ``PropagateResourceLimits`` says otherwise). No torch.
"""

from __future__ import annotations

from collections.abc import Callable

# the interpreter, torch's libraries, logs, the store, the liveness files: 31 measured (B12)
BASE = 64
# sockets per other rank: the training group's, the control group's, the node's group: 3.16 measured
PER_RANK = 3.5


def needed(world_size: int) -> int:
    """Descriptors a rank needs at this world size, with room to spare (B12's fit, rounded up)."""
    return int(BASE + PER_RANK * max(0, world_size - 1)) + 64


def problem(world_size: int, soft: int, hard: int) -> str | None:
    """What goes wrong when the hard limit is below what ``world_size`` ranks need; None when it is
    enough. (A soft limit below it is raised by each rank itself up to the hard one.)"""
    want = needed(world_size)
    if hard < 0 or hard >= want:  # RLIM_INFINITY is -1
        return None
    return (f"{world_size} ranks need about {want} open files each (their sockets to the other "
            "ranks), but the "
            f"hard limit here is {hard} (soft {soft}): the job would fail to connect its process "
            "group with "
            "'Too many open files'. HINT: ask for a higher limit (`ulimit -Hn` on the compute "
            "nodes; Slurm hands the "
            "job the limits of the shell you submit from unless the site says otherwise), or use "
            "fewer ranks")


def raise_soft_limit(want: int, get: Callable[[], tuple[int, int]] | None = None,
                     set_: Callable[[int, int], None] | None = None) -> tuple[int, int]:
    """Raise this process's soft limit on open files to ``want`` (capped by the hard limit) when it
    is lower; return (soft, hard) as they are afterwards."""
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
