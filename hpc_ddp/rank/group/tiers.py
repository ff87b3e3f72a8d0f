"""Control collectives in two levels: within each node, then among one leader per node (issue 45).

gloo's all_reduce of a small tensor is a ring: 2 x (W - 1) messages one after another, so the stop
agreement at every boundary took 0.5 ms a rank here and would take tens of milliseconds at 4,096
ranks on a network; a gather to rank 0 (a snapshot's commit entries) made rank 0 receive W messages.
Here the ranks of a node meet first (on their node: loopback, microseconds a message), their leaders
(each node's first rank) then meet by recursive doubling, log2(nodes) rounds of one exchange each,
and each leader hands the result back on its node. The model of what that costs at 4,096 and 32,768
ranks is in docs/performance.md (B12).

The groups are two gloo groups (:class:`Groups`: this node's ranks, and the leaders), made on every
rank in the same order, connected lazily. The stop agreement has a pair of its own
(:func:`open_tiers`, once per process group) and runs on a thread of its own, so that it still
overlaps the next step as the one all_reduce it replaces did (:meth:`Tiers.start_max`): only one
runs at a time, and nothing else uses those groups. A commit's collectives take the checkpointer's
pair, on the training thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rank.group import control

_TIERS: Tiers | None = None


class Groups:
    """Who reads and who shares: the nodes' leaders (local rank 0, by node) and this rank's node,
    with a gloo group among the leaders and one among the node's ranks (None where it would have one
    member).

    Every rank makes exactly two groups, in the same order, a group of itself alone where it is no
    member: torch names a group made by its members alone (``use_local_synchronization``) by its
    ranks and the count of groups the process already holds, so members whose counts differ would
    wait for each other forever. Make them once per process group (the checkpointer holds them) and
    make other such groups after."""

    def __init__(self, members: list[tuple[int, int]], env: DistEnv,
                 make: Callable[[list[int]], dist.ProcessGroup] | None = None) -> None:
        make = make if make is not None else control.subgroup
        first = {node: rank for rank, (node, local) in enumerate(members) if local == 0}
        self.leaders = [first[node] for node in sorted(first)]
        self.node = [rank for _, rank in sorted((local, rank)
                                                for rank, (node, local) in enumerate(members)
                                                 if node == env.node_rank)]
        self.leader = self.node[0]
        within = make(self.node if len(self.node) > 1 else [env.rank])
        between = make(self.leaders if env.rank == self.leader and len(self.leaders) > 1
                       else [env.rank])
        self.within = within if len(self.node) > 1 else None
        self.between = between if env.rank == self.leader and len(self.leaders) > 1 else None

    @classmethod
    def of(cls, env: DistEnv) -> Groups:
        """Collective: every rank's (node, local rank), then the groups."""
        return cls(control.to_main_and_back((env.node_rank, env.local_rank)), env)


class Pending:
    """An agreement started on the tiers' thread: ``wait()`` returns once it is done, or raises what
    it raised (a peer lost in the middle), as a collective's work does."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> bool:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return True


class Tiers:
    """This rank's place in the two levels, and the collectives over them."""

    def __init__(self, groups: Groups, env: DistEnv) -> None:
        self.groups, self.env = groups, env
        self.leader = env.rank == groups.leader
        self._jobs: queue.SimpleQueue[tuple[torch.Tensor, Pending] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, env: DistEnv) -> Tiers:
        """Collective on every rank: the groups, then the tiers."""
        return cls(Groups.of(env), env)

    # -- max of a few small integers: the stop agreement
    # -----------------------------------------------------
    def max_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: the element-wise max of a small CPU tensor over all ranks, in place."""
        within, between = self.groups.within, self.groups.between
        if within is not None:
            dist.reduce(tensor, dst=self.groups.leader, op=dist.ReduceOp.MAX, group=within)
        if self.leader and between is not None:
            doubling(tensor, self.groups.leaders, self.env.rank, torch.maximum, between)
        if within is not None:
            dist.broadcast(tensor, src=self.groups.leader, group=within)
        return tensor

    def start_max(self, values: Sequence[int]) -> tuple[torch.Tensor, Pending]:
        """Start :meth:`max_of` on the tiers' thread (it overlaps the next step); ``wait()`` the
        second item, then read the first."""
        tensor, pending = torch.tensor(list(values), dtype=torch.int32), Pending()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="hpc_ddp-tiers", daemon=True)
            self._thread.start()
        self._jobs.put((tensor, pending))
        return tensor, pending

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            tensor, pending = job
            try:
                self.max_of(tensor)
            # handed to whoever waits, as a collective's error is
            except BaseException as err:  # noqa: BLE001
                pending.finish(err)
                continue
            pending.finish()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    # -- one object from each node's leader to rank 0, and one back: a commit
    # ----------------------------------
    def leaders_to_main(self, value: object) -> list[Any] | None:
        """Collective on every rank: rank 0 gets each node leader's ``value`` (in node order); None
        elsewhere. The node's other ranks send nothing (a commit's entries come from the leaders,
        who write the files)."""
        between = self.groups.between
        if not self.leader:
            return None
        if between is None:
            return [value]
        gathered: list[Any] | None = ([None] * len(self.groups.leaders) if self.env.rank == 0
                                      else None)
        dist.gather_object(value, gathered, dst=0, group=between)
        return gathered

    def from_main(self, value: object) -> Any:
        """Collective on every rank: rank 0's ``value`` on every rank, leaders first, then within
        each node."""
        box = [value]
        if self.leader and self.groups.between is not None:
            dist.broadcast_object_list(box, src=0, group=self.groups.between)
        if self.groups.within is not None:
            dist.broadcast_object_list(box, src=self.groups.leader, group=self.groups.within)
        return box[0]

    def barrier(self) -> None:
        """Collective: every rank has arrived (a max of nothing, in two levels)."""
        self.max_of(torch.zeros(1, dtype=torch.int32))


def doubling(tensor: torch.Tensor, members: list[int], me: int,
             combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             group: dist.ProcessGroup) -> torch.Tensor:
    """Recursive doubling among ``members`` (global ranks, in order): each ends with ``combine`` of
    every member's tensor, in place, after log2(members) rounds of one exchange (plus one round each
    way for the members past the largest power of two, who hand their tensor to a partner and get
    the result back), over ``group`` (a gloo group of the members; ranks are global)."""
    size, index = len(members), members.index(me)
    power = 1 << (size.bit_length() - 1)
    extra = size - power
    if index >= power:  # folded in: hand over, then take the result
        dist.send(tensor, dst=members[index - power], group=group)
        dist.recv(tensor, src=members[index - power], group=group)
        return tensor
    incoming = torch.empty_like(tensor)
    if index < extra:
        dist.recv(incoming, src=members[index + power], group=group)
        tensor.copy_(combine(tensor, incoming))
    step = 1
    while step < power:
        partner = members[index ^ step]
        sent = dist.isend(tensor.clone(), dst=partner, group=group)
        dist.recv(incoming, src=partner, group=group)
        sent.wait()
        tensor.copy_(combine(tensor, incoming))
        step <<= 1
    if index < extra:
        dist.send(tensor, dst=members[index + power], group=group)
    return tensor


def open_tiers(env: DistEnv) -> Tiers | None:
    """Collective on every rank, once per process group: the tiers (None for a job of one rank)."""
    global _TIERS
    # a program's own process group joined again: already there
    if _TIERS is None or _TIERS.env != env:
        _TIERS = Tiers.of(env) if env.world_size > 1 else None
    return _TIERS


def current() -> Tiers | None:
    return _TIERS


def close_tiers() -> None:
    global _TIERS
    if _TIERS is not None:
        _TIERS.close()
    _TIERS = None
