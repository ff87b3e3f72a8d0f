"""The seam between a snapshot's writer and the device that holds the state: a *copier* moves bytes
to the host.

A snapshot of a CUDA state used to be serialised from the CUDA tensors: torch.save copied each
storage into fresh pageable memory, synchronously, before writing it (0.38 x ``dd`` for 2 GB on an
H100, B2-GPU). The pipeline (:mod:`hpc_ddp.rank.state.pipeline`) instead cuts the state into chunks
and asks a copier to move each into pinned host memory, so the writer can hash and write chunk k
while chunk k+1 is still crossing the bus. The copier is the only part that talks to the device, so
the pipeline's chunking, ordering and error handling are tested on the CPU with a fake copier
(tests/rank/test_snapshot_pipeline.py) and the real one is only a few lines of CUDA streams and
events.

The protocol, in the order the pipeline calls it:

- :meth:`Copier.boundary`: the state as the training stream has it now is what every later copy
  reads (CUDA: an event recorded on the training stream, which the side stream waits for: no
  device-wide sync);
- :meth:`Copier.copy_async` ``(chunk) -> handle``: start one chunk's copy; returns at once;
- :meth:`Copier.release`: the training stream's later work waits for every copy started (CUDA: the
  training stream waits for an event on the side stream), so a step run right after the boundary
  cannot change bytes a copy has not read yet, and the host never waits;
- :meth:`Copier.wait` ``(handle)``: the writer's thread blocks until that chunk is on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, stop)`` of piece ``piece``: ``src`` (flat uint8 on the device) into ``dst``
    (host)."""

    piece: int
    start: int
    stop: int
    src: torch.Tensor
    dst: torch.Tensor


class Copier(Protocol):
    # the host memory it copies into should be pinned (a device's DMA needs it to run
    # asynchronously)
    pins: bool

    def boundary(self) -> None: ...

    def copy_async(self, chunk: Chunk) -> Any: ...

    def release(self) -> None: ...

    # the copier's own handle: a CUDA event, None on the host
    def wait(self, handle: Any) -> None: ...


class HostCopier:
    """A CPU state: the copy is a memcpy made at once (the training thread changes the tensors when
    it goes on, so nothing can be left for later); its handle is None and there is nothing to wait
    for."""

    pins = False

    def boundary(self) -> None:
        pass

    def copy_async(self, chunk: Chunk) -> Any:
        chunk.dst.copy_(chunk.src)
        return None

    def release(self) -> None:
        pass

    def wait(self, handle: Any) -> None:
        pass


class CudaCopier:
    """Copies from one CUDA device on a side stream of its own, into pinned memory, ordered by
    events.

    Made once per pipeline (per attempt): the side stream is reused by every snapshot. A chunk's
    handle is an event recorded on the side stream after its copy; :meth:`wait` synchronises that
    event alone (the writer's thread waits for its chunk, not for the device)."""

    pins = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.training: torch.cuda.Stream | None = None

    def boundary(self) -> None:
        self.training = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(self.training)
        self.stream.wait_event(event)  # the side stream runs no copy before the step's work is done

    def copy_async(self, chunk: Chunk) -> Any:
        with torch.cuda.stream(self.stream):
            chunk.dst.copy_(chunk.src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def release(self) -> None:
        copied = torch.cuda.Event()
        copied.record(self.stream)
        (self.training or torch.cuda.current_stream(self.device)).wait_event(copied)

    def wait(self, handle: Any) -> None:
        handle.synchronize()


def copier_for(tensor: torch.Tensor, copiers: dict[str, Copier]) -> Copier | None:
    """The copier that moves ``tensor`` to the host (one per device, kept in ``copiers``); None for
    a CPU tensor, which a synchronous snapshot writes as it is."""
    if tensor.device.type != "cuda":
        return None
    key = str(tensor.device)
    if key not in copiers:
        copiers[key] = CudaCopier(tensor.device)
    return copiers[key]
