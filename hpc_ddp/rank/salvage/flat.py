"""The per-rank mirror's message body for the usual per-rank state: a JSON skeleton and the tensors' bytes.

The mirror (:mod:`hpc_ddp.rank.salvage.mirror`) sends each rank's per-rank state at every boundary. ``torch.save``
made that cost 0.5 ms of CPU per step of B2 on this machine (its pickler runs Python for every object,
with the training loop's caches cold) plus a staging copy, while the state itself is mostly tensors
(a prefetched batch, a generator's state, a small module's ``state_dict``) and a few numbers. So the
training thread copies each tensor's bytes straight into the message once, beside a JSON skeleton of
the containers and scalars; the bytes a snapshot holds (``torch.save``'s) are made from it only when
a snapshot needs them, after a failure or at a periodic snapshot of that step.

Only exact round trips take this path: dicts, OrderedDicts, lists and tuples of exactly those types,
``str``, ``int``, ``float``, ``bool``, ``None`` and strided tensors. Anything else (a NumPy array, a
namedtuple, a dict subclass) returns None from :func:`plan`, and the mirror sends ``torch.save`` bytes
instead. Tensors that share storage come back as separate copies with the same values.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

ALIGN = 64  # tensor data starts at multiples of this inside the body (any dtype's element size divides it)
META = 8  # bytes: int64 length of the JSON skeleton at the start of the body


class _Unsupported(Exception):
    pass


class Plan:
    """A state laid out for one message body: its skeleton, its tensors and where each one's bytes go."""

    def __init__(self, meta: bytes, tensors: list[torch.Tensor]) -> None:
        self.meta, self.tensors = meta, tensors
        self.cuda = any(t.is_cuda for t in tensors)  # its body should be pinned: the copies then never wait
        at = _up(META + len(meta))
        self.offsets = []
        for tensor in tensors:
            self.offsets.append(at)
            at = _up(at + tensor.numel() * tensor.element_size())
        self.nbytes = at

    def write(self, body: torch.Tensor) -> None:
        """Fill ``body`` (uint8, at least ``nbytes``): one copy of each tensor. A CUDA tensor's copy is only
        enqueued on the current stream when ``body`` is pinned: its bytes are there once the stream reaches it
        (the caller records an event and waits for it before reading), so the training thread never waits for
        the GPU here. Into pageable memory the copy waits for the GPU, as a plain ``.cpu()`` would."""
        body[:META] = torch.tensor([len(self.meta)], dtype=torch.int64).view(torch.uint8)
        body[META:META + len(self.meta)] = torch.frombuffer(bytearray(self.meta), dtype=torch.uint8)
        for tensor, at in zip(self.tensors, self.offsets):
            size = tensor.numel() * tensor.element_size()
            if size:
                body[at:at + size].copy_(tensor.contiguous().reshape(-1).view(torch.uint8),
                                         non_blocking=tensor.is_cuda and body.is_pinned())


def plan(state: Any) -> Plan | None:
    """``state`` laid out for a message, or None when it holds something this format cannot give back exactly."""
    tensors: list[torch.Tensor] = []
    try:
        skeleton = _walk(state, tensors)
    except _Unsupported:
        return None
    meta = json.dumps({"s": skeleton, "t": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                             for t in tensors]}).encode()
    return Plan(meta, tensors)


def read(body: torch.Tensor) -> Any:
    """The state a body holds, with CPU tensors of their own (the body may be reused)."""
    length = int(body[:META].view(torch.int64)[0])
    meta = json.loads(body[META:META + length].numpy().tobytes())
    tensors, at = [], _up(META + length)
    for name, shape in meta["t"]:
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype in a mirror message: {name!r}")
        count = 1
        for n in shape:
            count *= n
        size = count * torch.empty((), dtype=dtype).element_size()
        piece = body[at:at + size]
        tensors.append(piece.view(dtype).reshape(shape).clone() if size else torch.empty(shape, dtype=dtype))
        at = _up(at + size)
    return _build(meta["s"], tensors)


def _walk(value: Any, tensors: list[torch.Tensor]) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized or type(value) is not torch.Tensor:
            raise _Unsupported
        tensors.append(value.detach())
        return {"T": len(tensors) - 1}
    if kind is dict or kind is OrderedDict:
        return {"D" if kind is dict else "O": [[_walk(k, tensors), _walk(v, tensors)] for k, v in value.items()]}
    if kind is list or kind is tuple:
        return {"L" if kind is list else "U": [_walk(v, tensors) for v in value]}
    raise _Unsupported


def _build(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    (tag, inner), = node.items()
    if tag == "T":
        return tensors[inner]
    if tag in ("D", "O"):
        pairs = ((_build(k, tensors), _build(v, tensors)) for k, v in inner)
        return dict(pairs) if tag == "D" else OrderedDict(pairs)
    items = [_build(v, tensors) for v in inner]
    return items if tag == "L" else tuple(items)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
