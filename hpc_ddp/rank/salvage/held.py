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

**Generations, not flags.** A survivors' snapshot may be taken from a side thread (liveness,
watchdog) while the training thread still runs: a false alarm. ``updates`` is reset by every
boundary, so a write that began at step k and ended after the next boundary would see no update and
commit parameters half-way to k+1 as step k. ``generation`` only grows (each update begun, each
boundary): a write is committed only when the generation it read first is still the one after its
last byte.

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

**Device truth.** On CUDA the host runs ahead of the device: after a peer dies inside step k+1's
all-reduce, a survivor's CPU may have passed ``run.boundary(k+1)`` while the GPU never finished that
all-reduce, and any read of the state (``torch.save``, a fingerprint) would queue behind the wedged
kernel forever. Each mark records an event on the current stream, which is queried, never waited on:
a rank whose last boundary's event has not completed holds no step it can read, and says so at once.

**No device sync.** ``GradScaler.state_dict()`` calls ``.item()`` twice; its scale and growth
tracker are cloned as tensors here, and read back to numbers only when a snapshot is written.
"""

from __future__ import annotations

from typing import Any

import torch

from hpc_ddp.rank.salvage.held_copies import (SCALERS, GroupCopy, group_copy, immutable, kind_of,
                                              plain_copy, scaler_copy, scaler_state, slots)
from hpc_ddp.rank.state.checkpointer import STEP
from hpc_ddp.rank.state.tracked import state_of, unwrap

_MISSING = object()


class Held:
    """The whole state of the last boundary's step, as long as no optimizer update began since
    (module docstring)."""

    def __init__(self, tracked: dict[str, Any]) -> None:
        self.tracked = tracked
        self.step: int | None = None
        self.updates = 0  # optimizer updates begun since the last boundary
        # bumped by every update begun and every boundary; never reset (module docstring)
        self.generation = 0
        # rank 0's buffers were broadcast after the last mark (:meth:`synced`)
        self.buffers_synced = False
        self.copies: dict[str, Any] = {}
        self._buffers = {name: slots(obj) for name, obj in tracked.items()
                         if isinstance(obj, torch.nn.Module)}
        self._cuda = any(p.is_cuda for obj in tracked.values() if isinstance(obj, torch.nn.Module)
                         for p in obj.parameters())
        # CUDA: recorded at the last mark, on the current stream
        self.event: torch.cuda.Event | None = None
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
        for obj in tracked.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._began)

    def _began(self, *args: object) -> None:
        self.updates += 1
        self.generation += 1

    def buffer_keys(self, name: str) -> set[str]:
        """The state_dict keys of the tracked module ``name``'s buffers."""
        return set(self._buffers.get(name, {}))

    def mark(self, step: int) -> None:
        """At run.boundary(step) and resume: the live state is this step's; copy what the next step
        changes early."""
        self.generation += 1
        self.buffers_synced = False
        # an exception raised inside the copy (a signal handler's) leaves none
        self.step, self.updates = None, 0
        self._refresh()
        kinds = self._kinds
        self.copies = {name: self._copy(name, obj, kinds[name])
                       for name, obj in self.tracked.items()}  # then published
        self.event = _recorded() if self._cuda else None
        self.step = step

    def synced(self) -> None:
        """After the boundary broadcast rank 0's buffers to every rank (rank/loop/holding.py): copy
        them again. Every rank then holds the buffers a snapshot of this step must hold, rank 0's,
        also when rank 0 is the one lost."""
        self.generation += 1
        self.copies = {**self.copies, **{name: {key: tensor.detach().clone()
                                                for key, (_, _, tensor) in found.items()}
                                         for name, found in self._buffers.items()}}
        self.buffers_synced = True

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

    def whole(self) -> tuple[int, dict[str, Any]] | str:
        """(step, the replicated state of it) as a snapshot holds it, or why this rank holds no
        whole step. Read ``generation`` before and compare after using the state
        (:func:`intact`)."""
        step, copies = self.step, self.copies
        if step is None:
            return "this rank had not finished run.resume()"
        if self.updates:
            return (f"this rank's optimizer had begun the update after step {step} and its "
                    f"run.boundary({step + 1}) had not come")
        event = self.event
        if event is not None and not event.query():
            return (f"this rank's GPU had not finished the work of step {step} (its "
                    f"run.boundary({step}) came "
                    "first on the host; a collective on the device may be wedged): its state "
                    "cannot be read")
        state: dict[str, Any] = {}
        for name, obj in self.tracked.items():
            if isinstance(obj, torch.optim.Optimizer):
                if len(obj.param_groups) != len(copies[name]):
                    return (f"{name} has {len(obj.param_groups)} parameter groups, "
                            f"{len(copies[name])} at "
                            f"run.boundary({step}): a group was added since, and the step's state "
                            "is not whole")
                state[name] = {**obj.state_dict(), "param_groups": copies[name]}
            elif isinstance(obj, torch.nn.Module):
                state[name] = {**unwrap(obj).state_dict(), **copies[name]}
            elif isinstance(obj, SCALERS):
                state[name] = scaler_state(copies[name])
            else:
                state[name] = copies[name]
        state[STEP] = step
        return step, state


def _recorded() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


