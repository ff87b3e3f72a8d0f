"""Control traffic on the CPU: the small messages ranks agree on, over a gloo group beside the
training one.

Training collectives run on the training backend (NCCL on GPUs). Our own messages (the stop
agreement at every boundary, a snapshot's commit entries and verdict, the restore's
manifests, verdicts, refusals and state slices, rank 0's refusal, the RNG gather within a
node) go over this group on CPU tensors. On NCCL they would each be a CUDA tensor read back
with ``.item()``/``.tolist()``: a device-to-host copy queued behind the whole step, so the host
would wait for the GPU to drain at every boundary and the next step's data loading and
launches would no longer overlap the GPU's work. Pickled objects would also move through GPU
memory, and a wedged NCCL communicator would take our error paths down with it.

On gloo too the control traffic has a group of its own: a collective in the user's loop that only
some ranks issue (an evaluation's all_reduce on rank 0 alone) would otherwise be matched with our
stop agreement on the others: a silent wrong value, or a mismatch error that names our collective.
On its own group the user's collective waits for partners that never come, and the hang watchdog
names it (tests/rank/test_control.py). The cost, one more gloo group, is in docs/performance.md
(B2). The control groups connect lazily (``TORCH_GLOO_LAZY_INIT=1`` while they are made, unless the
user set it): gloo would otherwise connect every pair of ranks before the group returns, a cost that
grows with the world size (B12 in docs/performance.md: 85 ms at 32 ranks here, about 12 s at 4,096
by the fit; lazily 0.8 ms, flat). It saves no descriptors: a gather of pickled objects exchanges
sizes with every rank, so after a commit every pair is connected either way
(:mod:`hpc_ddp.core.limits` raises each rank's open-files limit for that).
:func:`open_group` must run on every rank right after the process group exists (creating a group
is collective); :func:`close_group` forgets it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# the gloo group when the training backend is another; None: the default group is gloo
_GROUP: dist.ProcessGroup | None = None
_OPEN = False  # open_group ran for the current process group
# the training group's timeout; dist.new_group would default to 30 minutes whatever it was
_TIMEOUT: timedelta | None = None


def needs_own_group(backend: str) -> bool:
    """Every backend: on NCCL the training group is on the device; on gloo it is the user's (module
    docstring)."""
    return True


def open_group(backend: str, own: bool | None = None, timeout: timedelta | None = None) -> None:
    """Collective: the control group for this process group. ``own=False`` puts the control traffic
    on the default group when it is gloo (only for measurements: B2's cost of the separate group);
    None decides by
    :func:`needs_own_group`. ``timeout`` (a timedelta) is the training group's: without it
    ``dist.new_group`` gives the control group and every subgroup 30 minutes, whatever the process
    group was given."""
    global _GROUP, _OPEN, _TIMEOUT
    _TIMEOUT = timeout
    # a process group the program made itself, joined again by hpc_ddp.session(): already there
    if _OPEN:
        return
    # never on NCCL
    own_group = needs_own_group(backend) if own is None else (own or backend != "gloo")
    with lazily():
        _GROUP = dist.new_group(backend="gloo", timeout=timeout) if own_group else None
    _OPEN = True


def close_group() -> None:
    global _GROUP, _OPEN, _TIMEOUT
    _GROUP, _OPEN, _TIMEOUT = None, False, None


def timeout() -> timedelta | None:
    """The training group's timeout (a timedelta; None before :func:`open_group`): every group made
    later takes it."""
    return _TIMEOUT


def group() -> dist.ProcessGroup | None:
    """The group control collectives take (None: the default group, which is gloo)."""
    return _GROUP


def start_max(values: Sequence[int]) -> tuple[torch.Tensor, Any]:
    """Start an element-wise max of small integers over all ranks (a CPU tensor, async: it overlaps
    the next step); ``work.wait()`` and read the tensor when the answer is needed."""
    tensor = torch.tensor(list(values), dtype=torch.int32)
    return tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_GROUP, async_op=True)


def max_of(tensor: torch.Tensor) -> torch.Tensor:
    """Collective: the element-wise max of a CPU tensor over all ranks, in place."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_GROUP)
    return tensor


def sum_of(value: float) -> float:
    """Collective: the sum of one float over all ranks."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=_GROUP)
    return float(tensor.item())


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Collective: ``src``'s CPU tensor on every rank (in place)."""
    dist.broadcast(tensor, src=src, group=_GROUP)


def broadcast_in(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    """Collective within ``group`` (made by :func:`subgroup`): global rank ``src``'s CPU tensor, in
    place."""
    dist.broadcast(tensor, src=src, group=group)


def from_main(value: object) -> Any:
    """Collective: rank 0's ``value`` on every rank (one pickled object)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_GROUP)
    return box[0]


def to_main(value: object) -> list[Any] | None:
    """Collective: rank 0 gets every rank's ``value`` (by rank); the others get None."""
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0, group=_GROUP)
    return gathered


def to_main_and_back(value: object, merge: Callable[[list[Any]], Any] | None = None) -> Any:
    """Collective: rank 0 gathers one object from every rank and sends back ``merge(list)``
    (default: the list). A non-zero rank sends one object and receives one: O(1) entries, not W as
    an all_gather."""
    gathered = to_main(value)
    return from_main(None if gathered is None else merge(gathered) if merge is not None
                     else gathered)


def all_gather(value: object) -> list[Any]:
    """Collective: every rank's ``value`` on every rank (only where each rank needs all of them)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=_GROUP)
    return gathered


def barrier() -> None:
    """Collective: every rank has arrived (on the CPU: no device synchronisation)."""
    dist.barrier(group=_GROUP)


def subgroup(ranks: list[int]) -> dist.ProcessGroup:
    """A gloo group of some ranks (collective among them alone)."""
    with lazily():
        return dist.new_group(ranks, use_local_synchronization=True, backend="gloo",
                              timeout=timeout())


LAZY_VAR = "TORCH_GLOO_LAZY_INIT"


@contextlib.contextmanager
def lazily() -> Iterator[None]:
    """gloo groups made inside connect a pair of ranks on its first message (module docstring); a
    value the user exported is left alone, and the training group, made before, is not touched."""
    if LAZY_VAR in os.environ:
        yield
        return
    os.environ[LAZY_VAR] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_VAR, None)


def gather_within(value: object, dst: int, members: int,
                  group: dist.ProcessGroup | None) -> list[Any] | None:
    """Collective within ``group`` (made by :func:`subgroup`): ``dst`` gets every member's value."""
    gathered: list[Any] | None = [None] * members if dist.get_rank() == dst else None
    dist.gather_object(value, gathered, dst=dst, group=group)
    return gathered


def scatter_within(values: list[Any] | None, src: int, group: dist.ProcessGroup) -> Any:
    """Collective within ``group`` (made by :func:`subgroup`): member ``i`` gets ``src``'s
    ``values[i]`` (members in the order of their global ranks)."""
    out: list[Any] = [None]
    dist.scatter_object_list(out, values if dist.get_rank() == src else None, src=src, group=group)
    return out[0]
