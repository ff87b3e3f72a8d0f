"""How a boundary copies what a step changes besides the parameters, in microseconds: the pieces of
:class:`hpc_ddp.rank.salvage.held.Held`'s copies.

An optimizer group's settings (:func:`group_copy`: the objects kept when all are immutable, so the
next boundary can reuse the copy), a plain state of numbers, strings, lists and dicts
(:func:`plain_copy`, not ``deepcopy``), a module's buffers by state_dict key with their owners
(:func:`slots`, :func:`buffers`), a GradScaler's state without a device sync (:func:`scaler_copy`,
read back by :func:`scaler_state`). Apart from ``Held`` because these are how one object is copied;
``Held`` decides when, and what a snapshot takes of them.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch

from hpc_ddp.rank.state.tracked import unwrap

SCALERS = tuple(c for c in (getattr(torch.amp, "GradScaler", None),
                            getattr(torch.cuda.amp, "GradScaler", None)) if c)
# state_dict key -> (owner, attribute, tensor)
Slots = dict[str, tuple[torch.nn.Module, str, torch.Tensor]]
SCALAR_TYPES = frozenset((int, float, bool, str, bytes, complex, type(None)))


class GroupCopy(NamedTuple):
    """One optimizer group's settings as copied at a boundary, and what they were copied from."""
    # the group's setting objects at the copy; None: one is mutable (copy every time)
    live: dict[str, Any] | None
    copy: dict[str, Any]  # what a snapshot holds: the settings and the parameters' numbers


def group_copy(group: dict[str, Any], params: list[int]) -> GroupCopy:
    """A group's settings as a snapshot holds them, with the objects they came from when all are
    immutable."""
    live = {k: v for k, v in group.items() if k != "params"}
    frozen = all(immutable(v) for v in live.values())
    return GroupCopy(live if frozen else None,
                     {**{k: _value(v) for k, v in live.items()}, "params": params})


def kind_of(obj: object) -> str:
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.nn.Module):
        return "module"
    return "scaler" if isinstance(obj, SCALERS) else "other"


def immutable(value: Any) -> bool:
    """Immutable all the way down: the same object is the same value (a tensor or a list may change
    in place)."""
    kind = type(value)
    return kind in SCALAR_TYPES or (kind is tuple and all(type(v) in SCALAR_TYPES for v in value))


def plain_copy(value: Any) -> Any:
    """A copy of a state of numbers, strings, and lists, tuples and dicts of them, without
    ``deepcopy``'s bookkeeping (a sampler's position, a scheduler's state); anything else in it is
    deep-copied."""
    kind = type(value)
    if kind in SCALAR_TYPES:
        return value
    if kind is dict:
        return {key: plain_copy(item) for key, item in value.items()}
    if kind is list:
        return [plain_copy(item) for item in value]
    if kind is tuple:
        return tuple([plain_copy(item) for item in value])
    return copy.deepcopy(value)


def _value(value: object) -> Any:
    """A group setting as it is now: a tensor learning rate is updated in place by a scheduler, so
    it is cloned."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.copy(value)


def slots(module: torch.nn.Module) -> Slots:
    """A module's buffers by state_dict key, with the module and attribute that hold each."""
    inner = unwrap(module)
    owners = {id(t): (m, attr) for _, m in inner.named_modules() for attr, t in m._buffers.items()
              if t is not None}
    return {key: (*owners[id(t)], t) for key, t in buffers(inner).items() if id(t) in owners}


def buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's buffers by state_dict key (they change in the forward; parameters only in
    step())."""
    inner = unwrap(module)
    params = {id(p) for p in inner.parameters()}
    return {key: value for key, value in inner.state_dict(keep_vars=True).items()
            if id(value) not in params}


def scaler_copy(scaler: Any) -> dict[str, Any]:
    """A GradScaler's state without a device sync: its scale and growth tracker cloned as
    tensors."""
    # disabled, or not used yet: plain numbers, no sync
    if not scaler.is_enabled() or scaler._scale is None:
        return dict(scaler.state_dict())
    return {"scale": scaler._scale.detach().clone(), "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval(),
            "_growth_tracker": scaler._growth_tracker.detach().clone()}


def scaler_state(copied: dict[str, Any]) -> dict[str, Any]:
    """What ``GradScaler.state_dict()`` gave at the boundary, from :func:`scaler_copy` (the sync
    happens here)."""
    state = dict(copied)
    if isinstance(state.get("scale"), torch.Tensor):
        state["scale"] = float(state["scale"].item())
    if isinstance(state.get("_growth_tracker"), torch.Tensor):
        state["_growth_tracker"] = int(state["_growth_tracker"].item())
    return state


class HostSide(NamedTuple):
    """What an optimizer's update changes on the host, as it was when the update began: on a GPU
    model, Adam's ``step`` counters are CPU tensors that ``step()`` advances at once, while the
    update's kernels still wait behind the gradients' all-reduce (issue 58). ``present``: the
    state_dict numbers that had a state then (a first update creates them)."""
    present: frozenset[int]
    values: dict[tuple[int, str], Any]


class HostPlan(NamedTuple):
    """Where an optimizer's host-side leaves are (made again when its state grows)."""
    size: int  # len(optimizer.state) when made
    present: frozenset[int]
    tensors: list[tuple[int, str]]  # CPU tensors, in the order of ``refs``
    refs: list[torch.Tensor]
    others: list[tuple[torch.Tensor, str, int]]  # (parameter, key, number): Python values


def host_plan(optimizer: torch.optim.Optimizer) -> HostPlan:
    """The CPU tensors and Python values in ``optimizer``'s state, numbered as state_dict() numbers
    the parameters."""
    numbers = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                              for p in g["params"])}
    tensors, refs, others = [], [], []
    for param, state in optimizer.state.items():
        number = numbers.get(id(param))
        if number is None:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if not value.is_cuda:
                    tensors.append((number, key))
                    refs.append(value)
            else:
                others.append((param, key, number))
    present = frozenset(numbers[id(p)] for p in optimizer.state if id(p) in numbers)
    return HostPlan(len(optimizer.state), present, tensors, refs, others)


def host_side(optimizer: torch.optim.Optimizer, plan: HostPlan) -> HostSide:
    """The host-side leaves now (one ``torch.stack`` for the usual 0-d counters: 40 µs for 150 on
    this machine, against 150 for a clone each)."""
    values: dict[tuple[int, str], Any] = {}
    if plan.refs:
        try:
            stacked = torch.stack(plan.refs)
            values.update(zip(plan.tensors, stacked.unbind(0)))
        except RuntimeError:  # shapes or dtypes that differ
            values.update(zip(plan.tensors, (t.clone() for t in plan.refs)))
    for param, key, number in plan.others:
        values[(number, key)] = copy.copy(optimizer.state[param][key])
    return HostSide(plan.present, values)


def with_host_side(state: dict[str, Any], side: HostSide) -> dict[str, Any]:
    """An optimizer's state_dict() with its host-side leaves as they were when the update began
    (and no state for a parameter that had none then)."""
    kept = {}
    for number, leaves in state["state"].items():
        if number in side.present:
            kept[number] = {key: _own(side.values[(number, key)]) if (number, key) in side.values
                            else value for key, value in leaves.items()}
    return {**state, "state": kept}


def _own(value: Any) -> Any:
    """A stacked counter as a tensor of its own (torch.save of a view writes its whole storage)."""
    return value.clone() if isinstance(value, torch.Tensor) else value
