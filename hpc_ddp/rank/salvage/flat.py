"""The per-rank mirror's message body for the usual per-rank state: a JSON skeleton and the tensors'
bytes.

The mirror (:mod:`hpc_ddp.rank.salvage.mirror`) sends each rank's per-rank state at every boundary.
``torch.save`` made that cost 0.5 ms of CPU per step of B2 on this machine (its pickler runs Python
for every object, with the training loop's caches cold) plus a staging copy, while the state itself
is mostly tensors (a prefetched batch, a generator's state, a small module's ``state_dict``) and a
few numbers. So the training thread copies each tensor's bytes straight into the message once,
beside a JSON skeleton of the containers and scalars; the bytes a snapshot holds (``torch.save``'s)
are made from it only when a snapshot needs them, after a failure or at a periodic snapshot of that
step.

**Leaves, for a delta.** A body is a run of leaves at fixed offsets (:func:`segments`: the skeleton,
then each tensor's bytes). When two bodies have the same leaves (same skeleton length, same tensor
offsets and sizes), a body is the other with only the leaves that differ replaced: :func:`changed`
finds them (with an early exit on each leaf's first bytes, so a changed batch costs almost nothing
to compare), :func:`write_delta` packs them and :func:`apply_delta` writes them onto a copy of the
other body. What lies between leaves (alignment padding) is never read, so the result holds the same
state, byte for byte where it is read, as the whole body.

Only exact round trips take this path: dicts, OrderedDicts, lists and tuples of exactly those types,
``str``, ``int``, ``float``, ``bool``, ``None``, strided tensors and ``nn.Parameter``\ s. Anything
else (a NumPy array, a namedtuple, a dataclass, a dict subclass, another tensor subclass) returns
None from :func:`plan`, and the mirror sends ``torch.save`` bytes instead, made on the training
thread at every boundary: with a CUDA tensor inside, that is a device sync per step, so the first
boundary warns once and names it (:func:`unsupported`, issue 58). Such types must also be
registered for ``weights_only`` loads, or the first boundary refuses them
(:func:`hpc_ddp.rank.state.tracked.unloadable`). Tensors that share storage come back as separate
copies with the same values.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

Segment = tuple[int, int]  # a leaf's [start, end) in a body
PEEK = 4096  # bytes of each leaf compared first: a leaf that changed almost always differs there
# tensor data starts at multiples of this inside the body (any dtype's element size divides it)
ALIGN = 64
META = 8  # bytes: int64 length of the JSON skeleton at the start of the body


class _Unsupported(Exception):
    """A value the format cannot carry: its type, and where it is (filled in as it goes up)."""

    def __init__(self, kind: type) -> None:
        super().__init__(kind)
        self.kind, self.path = kind, ""


class Plan:
    """A state laid out for one message body: its skeleton, its tensors and where each one's bytes
    go."""

    def __init__(self, meta: bytes, tensors: list[torch.Tensor]) -> None:
        self.meta, self.tensors = meta, tensors
        # its body should be pinned: the copies then never wait
        self.cuda = any(t.is_cuda for t in tensors)
        at = _up(META + len(meta))
        self.offsets = []
        for tensor in tensors:
            self.offsets.append(at)
            at = _up(at + tensor.numel() * tensor.element_size())
        self.nbytes = at

    def write(self, body: torch.Tensor) -> None:
        """Fill ``body`` (uint8, at least ``nbytes``): one copy of each tensor. A CUDA tensor's copy
        is only enqueued on the current stream when ``body`` is pinned: its bytes are there once the
        stream reaches it (the caller records an event and waits for it before reading), so the
        training thread never waits for the GPU here. Into pageable memory the copy waits for the
        GPU, as a plain ``.cpu()`` would."""
        body[:META] = torch.tensor([len(self.meta)], dtype=torch.int64).view(torch.uint8)
        body[META:META + len(self.meta)] = torch.frombuffer(bytearray(self.meta), dtype=torch.uint8)
        # the skeleton's leaf ends aligned: same bytes
        body[META + len(self.meta):_up(META + len(self.meta))] = 0
        for tensor, at in zip(self.tensors, self.offsets):
            size = tensor.numel() * tensor.element_size()
            if size:
                body[at:at + size].copy_(tensor.contiguous().reshape(-1).view(torch.uint8),
                                         non_blocking=tensor.is_cuda and body.is_pinned())


    def segments(self) -> list[Segment]:
        """The body's leaves: the skeleton (its length, and zeros up to the first tensor's offset,
        so a counter in it that gains a digit leaves the layout as it was), then each tensor's bytes
        (empty ones included)."""
        sizes = (t.numel() * t.element_size() for t in self.tensors)
        return [(0, _up(META + len(self.meta))),
                *((at, at + n) for at, n in zip(self.offsets, sizes))]


def plan(state: object) -> Plan | None:
    """``state`` laid out for a message, or None when it holds something this format cannot give
    back exactly."""
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
        tensors.append(piece.view(dtype).reshape(shape).clone() if size
                       else torch.empty(shape, dtype=dtype))
        at = _up(at + size)
    return _build(meta["s"], tensors)


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two uint8 ranges hold the same bytes: the first :data:`PEEK` first (a changed leaf
    exits there), then the rest as int64 where both are 8-byte aligned (7 x faster than comparing
    bytes: 4 ms for 64 MB here)."""
    if a.numel() != b.numel() or not torch.equal(a[:PEEK], b[:PEEK]):
        return False
    words = a.numel() // 8 * 8 if a.storage_offset() % 8 == 0 and b.storage_offset() % 8 == 0 else 0
    return (torch.equal(a[:words].view(torch.int64), b[:words].view(torch.int64))
            and torch.equal(a[words:], b[words:]))


def changed(new: torch.Tensor, old: torch.Tensor, leaves: list[Segment]) -> list[Segment]:
    """The leaves of body ``new`` whose bytes differ from the same leaves of body ``old`` (same
    layout)."""
    return [(s, e) for s, e in leaves if not equal(new[s:e], old[s:e])]


def delta_size(leaves: list[Segment]) -> int:
    """Bytes of a delta carrying ``leaves``: a count, a start and end per leaf, then their bytes."""
    return 8 + 16 * len(leaves) + sum(e - s for s, e in leaves)


def write_delta(out: torch.Tensor, body: torch.Tensor, leaves: list[Segment]) -> int:
    """Write into ``out`` (uint8, at least :func:`delta_size`) the leaves of ``body``: returns the
    bytes written."""
    table = torch.tensor([len(leaves), *(v for leaf in leaves for v in leaf)], dtype=torch.int64)
    at = table.numel() * 8
    out[:at] = table.view(torch.uint8)
    for s, e in leaves:
        out[at:at + e - s].copy_(body[s:e])
        at += e - s
    return at


def delta_leaves(delta: torch.Tensor, size: int) -> list[Segment]:
    """The leaves a delta carries, checked first: each inside a body of ``size`` bytes, their bytes
    inside the delta. A receiver reads them before it changes anything (it writes the old bytes of
    those leaves aside to keep the state before the delta), so a delta that does not fit raises
    before any byte is written."""
    count = int(delta[:8].view(torch.int64)[0]) if delta.numel() >= 8 else -1
    if count < 0 or delta.numel() < 8 + 16 * count:
        raise ValueError(f"a mirror delta of {delta.numel()} bytes has no table of leaves (count "
                         f"{count})")
    table = delta[8:8 + 16 * count].view(torch.int64).tolist()
    leaves = list(zip(table[::2], table[1::2]))
    if any(not 0 <= s <= e <= size for s, e in leaves) or delta.numel() < delta_size(leaves):
        raise ValueError(f"a mirror delta's leaves do not fit a body of {size} bytes or the delta "
                         "itself")
    return leaves


def apply_delta(body: torch.Tensor, delta: torch.Tensor) -> None:
    """Write the leaves a delta carries onto ``body`` (in place): it then holds the state the delta
    was made from."""
    leaves = delta_leaves(delta, body.numel())
    at = 8 + 16 * len(leaves)
    for s, e in leaves:
        body[s:e].copy_(delta[at:at + e - s])
        at += e - s


def _walk(value: Any, tensors: list[torch.Tensor]) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if isinstance(value, torch.Tensor):
        if (value.layout != torch.strided or value.is_quantized
                or kind not in (torch.Tensor, torch.nn.Parameter)):
            raise _Unsupported(kind)
        tensors.append(value.detach())
        if kind is torch.nn.Parameter:  # a per-rank parameter: itself again, with its flag
            return {"P": [len(tensors) - 1, value.requires_grad]}
        return {"T": len(tensors) - 1}
    if kind is dict or kind is OrderedDict:
        return {"D" if kind is dict else "O": [[_item(k, tensors, k, ":key"), _item(v, tensors, k)]
                                               for k, v in value.items()]}
    if kind is list or kind is tuple:
        return {"L" if kind is list else "U": [_item(v, tensors, i)
                                               for i, v in enumerate(value)]}
    raise _Unsupported(kind)


def _item(value: Any, tensors: list[torch.Tensor], at: object, suffix: str = "") -> Any:
    """:func:`_walk` of a container's item ``at``; a refusal names where it was (formatted only
    then: nothing per leaf on a boundary that succeeds)."""
    try:
        return _walk(value, tensors)
    except _Unsupported as err:
        err.path = f"[{at!r}]{suffix}{err.path}"
        raise


def unsupported(state: object) -> str | None:
    """The first part of ``state`` this format cannot carry, as "a TYPE at PATH", or None: what the
    first boundary's warning names (it goes as ``torch.save`` bytes instead, at every boundary).
    The same walk as :func:`plan`'s."""
    try:
        _walk(state, [])
    except _Unsupported as err:
        return f"a {err.kind.__module__}.{err.kind.__qualname__} at {err.path or 'the top'}"
    return None


def _build(node: object, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    (tag, inner), = node.items()
    if tag == "T":
        return tensors[inner]
    if tag == "P":
        return torch.nn.Parameter(tensors[inner[0]], requires_grad=inner[1])
    if tag in ("D", "O"):
        pairs = ((_build(k, tensors), _build(v, tensors)) for k, v in inner)
        return dict(pairs) if tag == "D" else OrderedDict(pairs)
    items = [_build(v, tensors) for v in inner]
    return items if tag == "L" else tuple(items)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
