"""What a rank holds whole between two boundaries: the state a survivors' snapshot may take
(rank/salvage/jit.py).

Parameters and optimizer state change only in ``optimizer.step()``: they are read live, and the
optimizers' step hooks say whether an update began since the last ``run.boundary(k)``. If none did,
the live parameters are step k's. What changes during a step besides them (module buffers in the
forward, the sampler's position as a batch is drawn, a learning rate set before the step, any other
tracked object) is copied at each boundary, which costs a few microseconds for the usual small
objects.

**Copies only of what changed** (issue 47: a boundary costs microseconds). An optimizer group whose
settings are the very objects of the last boundary's copy, every one immutable (numbers, strings,
tuples of them), keeps that copy; a group with a tensor or a list among its settings is copied every
time. A state made of numbers, strings, lists, tuples and dicts (a sampler's position, a scheduler's
state) is copied by :func:`~hpc_ddp.rank.salvage.held_copies.plain_copy`, not ``deepcopy`` (1-2 µs,
not 5-20). Buffers are cloned at every boundary: a forward changes them, and a change made through
``.data`` leaves no trace (``_version``) to skip by.

**Checked after the read, by the mark.** A survivors' snapshot may be taken from a side thread
(liveness, watchdog) while the training thread still runs: a false alarm. ``updates`` is reset by
every boundary, so a write that began at step k and ended after the next boundary would see no
update and commit parameters half-way to k+1 as step k. So the write keeps the mark it read and asks
:meth:`intact` after its last byte: the update after that mark had not begun (on the device, for a
GPU).

**Buffers are rank 0's.** DDP with ``broadcast_buffers`` gives every rank rank 0's buffers
(BatchNorm's running statistics) at the start of each forward, and each rank's forward then moves
its own: between two forwards they differ by rank, and the step's are rank 0's (a periodic snapshot
holds those). So the boundary broadcasts them once more, right after :meth:`mark` (the same
broadcast DDP makes at the next forward, made earlier: the training is unchanged), and
:meth:`synced` copies them again. A survivor then holds rank 0's buffers of the step even when rank
0 was lost.

**References go stale.** A buffer reassigned after ``resume`` (``module.to(dtype)``, a user's
``self.running_mean = ...``) or a parameter group added (progressive unfreezing) would make a copy
from the first references wrong. Each boundary checks the buffers' identity in their owners (a dict
lookup each, not a walk of the model: 330 us for 150 modules) and re-reads the optimizers' numbering
when their groups changed; a group added after the boundary makes the rank no source.

**Device truth** (issue 58). On CUDA the host runs ahead of the device: after a peer dies inside
step k+1's all-reduce, a survivor's CPU may have begun step k+1's update or passed
``run.boundary(k+1)`` while its GPU never finished that all-reduce, and step k is still whole in
device memory. So the last two boundaries are kept
(:class:`~hpc_ddp.rank.salvage.device_clock.Mark`: the copies, an event after them, the events
around the update that follows, recorded by the optimizers' step pre- and post-hooks on the stream
that runs the update), and :meth:`whole` takes the newest whose events say the memory holds it
(:func:`~hpc_ddp.rank.salvage.device_clock.holding`): queried, never waited on. On the CPU the same
rule reads the host's order: an update begun on the host has begun.

**No device sync.** ``GradScaler.state_dict()`` calls ``.item()`` twice; its scale and growth
tracker are cloned as tensors here, and read back to numbers only when a snapshot is written.
"""

from __future__ import annotations

from typing import Any

import torch

from hpc_ddp.rank.salvage.device_clock import (Clock, CudaClock, Holding, HostClock, Mark,
                                               holding, intact)
from hpc_ddp.rank.salvage.device_read import Reader
from hpc_ddp.rank.salvage.held_copies import (SCALERS, GroupCopy, HostPlan, group_copy, host_plan,
                                              host_side, immutable, kind_of, plain_copy,
                                              scaler_copy, scaler_state, slots, with_host_side)
from hpc_ddp.rank.state.checkpointer import STEP
from hpc_ddp.rank.state.tracked import state_of, unwrap

_MISSING = object()


class Held:
    """The whole state of the last boundary's step, as long as no optimizer update began since
    (module docstring)."""

    def __init__(self, tracked: dict[str, Any], clock: Clock | None = None) -> None:
        self.tracked = tracked
        self.step: int | None = None
        self.updates = 0  # optimizer updates begun since the last boundary
        # the last two boundaries, oldest first (module docstring)
        self.marks: list[Mark] = []
        self._buffers = {name: slots(obj) for name, obj in tracked.items()
                         if isinstance(obj, torch.nn.Module)}
        self._cuda = any(p.is_cuda for obj in tracked.values() if isinstance(obj, torch.nn.Module)
                         for p in obj.parameters())
        # the device's events (a CPU's: done when recorded); a test's stand-in
        self.clock: Clock = clock or (CudaClock() if self._cuda else HostClock())
        # a GPU's: what copies the held state to host memory after a failure (rank/loop/holding.py)
        self.reader: Reader | None = None
        # each group's parameter count: what state_dict's numbers follow
        self._groups: dict[str, tuple[int, ...]] = {}
        # each group's parameter indices as state_dict numbers them
        self._params: dict[str, list[list[int]]] = {}
        # the last boundary's, reused where nothing changed
        self._group_copies: dict[str, list[GroupCopy]] = {}
        # optimizer group settings copied, over all boundaries (the tests count them)
        self.settings_copied = 0
        # once: a boundary asks no isinstance
        self._kinds = {name: kind_of(obj) for name, obj in tracked.items()}
        self._optimizers = [(name, obj) for name, obj in tracked.items()
                            if self._kinds[name] == "optimizer"]
        # a GPU's: where each optimizer's host-side state is (held_copies.host_plan)
        self._host_plans: dict[str, HostPlan] = {}
        for name, obj in self._optimizers:
            obj.register_step_pre_hook(lambda opt, *_, name=name: self._began(name, opt))
            obj.register_step_post_hook(self._ended)

    @property
    def copies(self) -> dict[str, Any]:
        """The newest boundary's copies (rank 0's buffers once synced)."""
        if not self.marks:
            return {}
        mark = self.marks[-1]
        return {**mark.copies, **(mark.synced_copies or {})}

    @property
    def buffers_synced(self) -> bool:
        """Rank 0's buffers were broadcast after the newest mark (:meth:`synced`), on the host."""
        return bool(self.marks) and self.marks[-1].synced_copies is not None

    def _began(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        self.updates += 1
        if not self.marks:
            return
        mark = self.marks[-1]
        if mark.began is None:  # the first optimizer's: the update began
            mark.began = self.clock.record()
        if self.clock.device and name not in mark.host:  # the host changes these at once
            plan = self._host_plans.get(name)
            if plan is None or plan.size != len(optimizer.state):
                plan = self._host_plans[name] = host_plan(optimizer)
            mark.host[name] = host_side(optimizer, plan)

    def _ended(self, *args: object) -> None:
        if self.marks:  # the last optimizer's: the update ended
            self.marks[-1].ended = self.clock.record()

    def buffer_keys(self, name: str) -> set[str]:
        """The state_dict keys of the tracked module ``name``'s buffers."""
        return set(self._buffers.get(name, {}))

    def mark(self, step: int) -> None:
        """At run.boundary(step) and resume: the live state is this step's; copy what the next step
        changes early."""
        # an exception raised inside the copy (a signal handler's) leaves none
        self.step, self.updates = None, 0
        self._refresh()
        kinds = self._kinds
        copies = {name: self._copy(name, obj, kinds[name]) for name, obj in self.tracked.items()}
        # then published, with the event after the copies
        self.marks = [*self.marks[-1:], Mark(step, copies, self.clock.record())]
        self.step = step

    def synced(self) -> None:
        """After the boundary broadcast rank 0's buffers to every rank (rank/loop/holding.py): copy
        them again. Every rank then holds the buffers a snapshot of this step must hold, rank 0's,
        also when rank 0 is the one lost."""
        mark = self.marks[-1]
        copies = {name: {key: tensor.detach().clone() for key, (_, _, tensor) in found.items()}
                  for name, found in self._buffers.items()}
        # the event first: a mark whose synced copies are set has their event (device_clock)
        mark.synced_event = self.clock.record()
        mark.synced_copies = copies

    def _refresh(self) -> None:
        for name, found in self._buffers.items():
            if any(owner._buffers.get(attr) is not tensor for owner,
                   attr, tensor in found.values()):
                self._buffers[name] = slots(self.tracked[name])
        for name, obj in self._optimizers:  # state_dict numbers the parameters by position alone
            counts = tuple([len(group["params"]) for group in obj.param_groups])
            if counts != self._groups.get(name):
                self._groups[name] = counts
                self._params[name] = [g["params"] for g in obj.state_dict()["param_groups"]]

    def _copy(self, name: str, obj: Any, kind: str) -> Any:
        """What ``obj``'s state needs from now (a few microseconds for a model, its optimizer and a
        sampler)."""
        if kind == "optimizer":  # its groups' settings, numbered as state_dict() numbers them
            return self._copy_groups(name, obj)
        if kind == "module":
            return {key: tensor.detach().clone()
                    for key, (_, _, tensor) in self._buffers[name].items()}
        if kind == "scaler":
            return scaler_copy(obj)
        return plain_copy(state_of(obj))

    def _copy_groups(self, name: str, obj: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """Each group's settings: the last boundary's copy, with only the settings that changed
        copied again."""
        before = self._group_copies.get(name, ())
        now: list[GroupCopy] = []
        for index, (group, params) in enumerate(zip(obj.param_groups, self._params[name])):
            last = before[index] if index < len(before) else None
            if (last is None or last.live is None or last.copy["params"] is not params
                    or len(group) != len(last.live) + 1):
                last = group_copy(group, params)
                self.settings_copied += len(last.copy) - 1
            else:
                last = self._updated(group, last, params)
            now.append(last)
        self._group_copies[name] = now
        return [group.copy for group in now]

    def _updated(self, group: dict[str, Any], last: GroupCopy, params: list[int]) -> GroupCopy:
        """``last`` where every setting of ``group`` is the object copied then; else with the
        changed ones replaced (immutable: the object is its own copy), or copied whole when one is
        new or mutable."""
        live, copied = last.live, last.copy
        assert live is not None
        for key, value in group.items():
            if live.get(key, _MISSING) is value or key == "params":
                continue
            if key not in live or not immutable(value):
                self.settings_copied += len(group) - 1
                return group_copy(group, params)
            if live is last.live:
                live, copied = dict(live), dict(copied)
            live[key] = copied[key] = value
            self.settings_copied += 1
        return last if live is last.live else GroupCopy(live, copied)

    def whole(self) -> tuple[int, dict[str, Any], Holding] | str:
        """(step, the replicated state of it as a snapshot holds it, the holding) for the newest
        boundary the memory still holds, or why this rank holds none. After reading the state, ask
        :meth:`intact` with the holding's mark. Never waits on the device."""
        held = holding(self.marks, self.clock)
        if isinstance(held, str):
            return held
        step, copies = held.step, held.copies
        state: dict[str, Any] = {}
        for name, obj in self.tracked.items():
            if isinstance(obj, torch.optim.Optimizer):
                if len(obj.param_groups) != len(copies[name]):
                    return (f"{name} has {len(obj.param_groups)} parameter groups, "
                            f"{len(copies[name])} at "
                            f"run.boundary({step}): a group was added since, and the step's state "
                            "is not whole")
                live = obj.state_dict()
                if name in held.mark.host:  # the host began the update the device had not
                    live = with_host_side(live, held.mark.host[name])
                state[name] = {**live, "param_groups": copies[name]}
            elif isinstance(obj, torch.nn.Module):
                state[name] = {**unwrap(obj).state_dict(), **copies[name]}
            elif isinstance(obj, SCALERS):  # a GPU's: numbers once on the host (to_numbers)
                state[name] = copies[name] if self.clock.device else scaler_state(copies[name])
            else:
                state[name] = copies[name]
        state[STEP] = step
        return step, state, held

    def to_numbers(self, state: dict[str, Any]) -> dict[str, Any]:
        """A GPU's held state once copied to the host: a GradScaler's scale and growth tracker read
        back to the numbers its state_dict() gives (a CPU tensor's ``.item()``: no device sync)."""
        return {name: scaler_state(value) if self._kinds.get(name) == "scaler" else value
                for name, value in state.items()}

    def intact(self, mark: Mark) -> bool:
        """Whether the live state read for ``mark`` is still its step's, asked once the read is
        done (:func:`~hpc_ddp.rank.salvage.device_clock.intact`)."""
        return intact(mark, self.clock)
