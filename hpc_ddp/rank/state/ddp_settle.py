"""DDP's gradient buckets, settled before the first training step of every attempt.

DDP reorders its gradient buckets after the first backward of a process. A resumed attempt
would otherwise reduce its first step's gradients in the initial layout while a run that
never stopped used the rebuilt one: another summation order, last-bit differences, no exact
resume. :func:`settle_buckets_on_first_forward` makes every attempt (fresh ones too) take
that rebuild before its first real step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.rank.state.rng import capture_rng, restore_rng


def ddp_in(obj: object) -> DistributedDataParallel | None:
    """The DDP module of a tracked object: the object itself, or the one under
    ``torch.compile(DDP(model))``'s wrapper. Its buckets and buffers need settling all the same: a 2
    x 2 nanoGPT run in that order, stopped and resumed, ended apart from an uninterrupted one while
    the wrapper hid its DDP from these checks."""
    if isinstance(obj, DistributedDataParallel):
        return obj
    inner = getattr(obj, "_orig_mod", None)
    return inner if isinstance(inner, DistributedDataParallel) else None


def settle_buckets_on_first_forward(ddp: DistributedDataParallel) -> None:
    """Arm a hook that runs, before the first training forward of this attempt, one forward/backward
    that trains nothing: eval mode (no dropout, no BatchNorm statistics), every gradient
    synchronised, the RNG restored and the gradients dropped. An eval or no_grad forward before it
    (rank 0's first evaluation, as in nanoGPT) leaves the hook armed: spending it there left rank 0
    out of the other ranks' collectives."""
    def hook(module: DistributedDataParallel, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or not module.training:
            # an eval forward (maybe on rank 0 only, as nanoGPT's first eval): wait for the training
            # one
            return
        handle.remove()
        rng, sync, inner = capture_rng(), module.require_backward_grad_sync, module.module
        # a compiled module (DDP(torch.compile(model))) settles through its eager one: the same
        # parameters and buckets, and no eval-mode graph to compile (a second compile, for this one
        # forward)
        module.module = getattr(inner, "_orig_mod", inner)
        module.eval()
        module.require_backward_grad_sync = True
        try:
            tensors = [t for t in _tensors(module(*args, **kwargs)) if t.requires_grad]
            if tensors:
                (sum(t.float().sum() for t in tensors) * 0).backward()
        finally:
            module.module = inner
            module.train()
            module.require_backward_grad_sync = sync
            for p in module.parameters():
                p.grad = None
            restore_rng(rng)

    handle = ddp.register_forward_pre_hook(hook, with_kwargs=True)


def _tensors(value: object) -> list[torch.Tensor]:
    """Every tensor in a (nested) model output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def sync_buffers(ddp: DistributedDataParallel) -> bool:
    """Rank 0's buffers to every rank now: the broadcast DDP makes at the start of each forward (its
    own method: the same group, buckets, reassigned buffers and join handling), made at the boundary
    (rank/salvage/held.py says why). False where DDP would not broadcast them that way (a buffer
    communication hook of the user's decides)."""
    if hasattr(ddp, "buffer_hook") or not hasattr(ddp, "_sync_buffers"):
        return False
    # DDP's own check: a broadcast of nothing asserts in c10d
    if next(ddp.module.buffers(), None) is not None:
        ddp._sync_buffers()
    return True
