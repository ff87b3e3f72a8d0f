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
