"""The survivors' snapshot's one read of device memory: on a stream of its own, into host memory
that is already there, with a deadline (issue 58).

After a failure on NCCL the stream that trains is wedged behind a collective that will never finish.
A read on it (``torch.save`` of a live CUDA tensor, a fingerprint's ``.cpu()``, both on the legacy
default stream of the thread that runs them) would queue behind the wedge forever. So the survivor
copies the state it holds (:meth:`hpc_ddp.rank.salvage.held.Held.whole`: its mark's event completed,
so the memory holds the step) once, on a side stream that waits for nothing, and then fingerprints
and writes the host copy. Nothing here synchronizes the device or a busy stream, calls ``.item()``,
or uses the default stream; the one wait is an event query, polled until :data:`READ_S`.

**Host memory.** Into the snapshot pipeline's pinned arena
(:class:`hpc_ddp.rank.state.pipeline.Arena`) when it exists, is pinned, is large enough and no
periodic write holds it: the copies are then asynchronous and the deadline bounds them. Otherwise
into pageable memory allocated here (never pinned memory: allocating or freeing it may synchronize
the device): the copy engine still never waits for the wedged stream, but each copy returns only
when done.

**A seam for the device.** :class:`Reader` is what touches the device; the walk, the host buffers
and the deadline are tested on the CPU with a stand-in whose copies complete, stall or never come
(tests/rank/test_device_clock.py).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

# how long the survivor waits for its copy of the state (under Slurm's KillWait, 30 s by default)
READ_S = 10.0
POLL_S = 0.001


class Reader(Protocol):
    """What copies device tensors to the host: which tensors it moves, host memory for them, the
    copies started at once and a handle that says whether they are done."""

    def moves(self, tensor: torch.Tensor) -> bool: ...

    def buffers(self, sizes: list[int]) -> list[torch.Tensor]: ...  # uint8 host buffers

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any: ...  # (src, dst)

    def done(self, handle: Any) -> bool: ...  # never waits


class CudaReader:
    """Copies on a side stream of its own (made at the first boundary, not on the failure path),
    into the pinned arena of the checkpointer's pipeline (``pipeline``: it, or None) when it is free
    and large enough, else into pageable memory."""

    def __init__(self, pipeline: Callable[[], Any] = lambda: None) -> None:
        self.stream = torch.cuda.Stream()
        self.pipeline = pipeline

    def moves(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        pipeline = self.pipeline()
        regions = pipeline.borrow(sizes) if pipeline is not None else None
        if regions is None:
            return [torch.empty(size, dtype=torch.uint8) for size in sizes]
        return [torch.frombuffer(r, dtype=torch.uint8) if len(r)
                else torch.empty(0, dtype=torch.uint8)
                for r in regions]

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        with torch.cuda.stream(self.stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def done(self, handle: Any) -> bool:
        return bool(handle.query())


def to_host(state: Any, reader: Reader, read_s: float | None = None,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> Any | str:
    """``state`` with every tensor the reader moves replaced by a host copy of it (one copy per
    storage view, in the state's order), or why not: the copies did not complete within
    ``read_s`` (:data:`READ_S` when None)."""
    read_s = READ_S if read_s is None else read_s
    found: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if reader.moves(value) and id(value) not in index:
                index[id(value)] = len(found)
                found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(state)
    if not found:
        return state
    buffers = reader.buffers([t.numel() * t.element_size() for t in found])
    hosts = [b.view(t.dtype).reshape(t.shape) if t.numel() else torch.empty(t.shape, dtype=t.dtype)
             for b, t in zip(buffers, found)]
    handle = reader.copy([(t.detach(), h) for t, h in zip(found, hosts) if t.numel()])
    deadline = clock() + read_s
    while not reader.done(handle):
        if clock() >= deadline:
            return (f"the copy of this rank's state to host memory ({len(found)} tensors) did not "
                    f"finish within {read_s:g} s on a stream of its own: the device may be hung")
        sleep(POLL_S)
    return _rebuilt(state, {i: hosts[n] for i, n in index.items()})


def _rebuilt(value: Any, hosts: dict[int, torch.Tensor]) -> Any:
    """``value`` with the tensors of ``hosts`` (by id) replaced; containers copied, their types
    kept (an OrderedDict, a defaultdict, a namedtuple)."""
    if isinstance(value, torch.Tensor):
        return hosts.get(id(value), value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = _rebuilt(item, hosts)
        return out
    if isinstance(value, list):
        return [_rebuilt(v, hosts) for v in value]
    if isinstance(value, tuple):
        items = [_rebuilt(v, hosts) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
