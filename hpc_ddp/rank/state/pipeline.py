"""Device-to-host pipeline for snapshot writes: the node's pieces copied in chunks into host memory
that every snapshot of the attempt reuses, overlapped with the hashing and the writing.

:meth:`Pipeline.stage` starts every chunk's copy (:mod:`hpc_ddp.rank.state.copier`) and returns at
once with host tensors that alias the :class:`Arena`: one buffer, pinned where a device copies into
it, allocated at the attempt's first snapshot and grown only when a state needs more. Each piece is
a storage of its own in the arena (``torch.frombuffer`` on its region), so torch.save writes it as
it would a CPU tensor of that size: the file on disk is the one a CPU state of the same values
gives, with a digest per slice. The writer (:func:`hpc_ddp.rundir.snapshot.write.write_node_file`)
calls :meth:`Staged.ready` before it hashes or writes a chunk: the writer's thread waits for that
chunk's copy alone, while the later chunks are still copying.

Which pieces go through it: a CUDA piece always (a synchronous snapshot too: otherwise torch.save
copies it to pageable memory first); a CPU piece only for an async snapshot (``copy_host``: the
training thread changes it when it goes on), by a memcpy in the step, as the staging before the
pipeline did. A synchronous snapshot of a CPU state writes the live tensors as it always did (B3:
nothing to copy).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hpc_ddp.rundir import snapshot
from hpc_ddp.core.errors import explain
from hpc_ddp.rank.state.copier import Chunk, Copier, HostCopier, copier_for

# bytes per copy: small enough that the first write starts early, large enough to be cheap
CHUNK = 32 << 20
ALIGN = 4096  # each piece starts on its own page of the arena (any dtype's alignment divides it)
HOST = HostCopier()


class Arena:
    """Host memory for the staged pieces, reused snapshot after snapshot (a fresh allocation of
    pinned memory costs more than the copy into it, and of pageable memory its page faults were most
    of a CPU copy's time, B3). ``allocations`` counts the buffers made: the tests check the second
    snapshot makes none."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.pinned = False
        self.allocations = 0

    def regions(self, sizes: list[int], pinned: bool) -> list[memoryview]:
        """One region of ``sizes[i]`` bytes per piece, page-aligned; grows (or pins) the buffer when
        needed."""
        offsets, at = _offsets(sizes)
        if not at:
            return [memoryview(b"") for _ in sizes]
        if self.buffer is None or self.buffer.numel() < at or (pinned and not self.pinned):
            self.buffer = None  # the old buffer goes before the new one is made: never both at once
            self.buffer = torch.empty(at, dtype=torch.uint8, pin_memory=pinned)
            self.pinned, self.allocations = pinned, self.allocations + 1
        view = memoryview(self.buffer.numpy())
        return [view[offset:offset + size] for offset, size in zip(offsets, sizes)]

    def lend(self, sizes: list[int]) -> list[memoryview] | None:
        """:meth:`regions` of the pinned buffer as it is, or None where it is not pinned or too
        small: never allocates (the failure path's read, :meth:`Pipeline.borrow`)."""
        if self.buffer is None or not self.pinned or self.buffer.numel() < _offsets(sizes)[1]:
            return None
        return self.regions(sizes, pinned=True)


class Staged:
    """The host copy of one snapshot's pieces, being filled: ``pieces`` for torch.save,
    :meth:`ready` for the writer, :meth:`release` once the write is over (the arena is then free for
    the next snapshot)."""

    def __init__(self, pieces: dict[int, torch.Tensor], chunks: dict[int, list[list[Any]]]) -> None:
        self.pieces = pieces
        self._chunks = chunks  # piece -> [[start, stop, copier, handle, waited, Chunk]], byte order
        self._lock = threading.Lock()
        self.released = False
        # a chunk is on its way from a device: the writer waits for each (a CPU copy is done)
        self.copying = False

    def ready(self, piece: int, start: int, stop: int) -> None:
        """Block until bytes ``[start, stop)`` of ``piece`` are on the host (the writer's
        thread)."""
        with self._lock:
            for chunk in self._chunks.get(piece, ()):
                if chunk[0] < stop and chunk[1] > start and not chunk[4]:
                    try:
                        chunk[2].wait(chunk[3])
                    # every rank learns of it through the commit (a SnapshotError)
                    except Exception as err:
                        raise snapshot.SnapshotError(explain(
                            f"the copy of bytes {chunk[0]}-{chunk[1]} of snapshot piece {piece} to "
                            "host memory "
                            f"failed ({err!r})", hint="look for a device error in this rank's log; "
                                                      "the "
                            "previous committed snapshot is untouched")) from err
                    chunk[4], chunk[5] = True, None  # its source may go now

    def release(self) -> None:
        """Wait for every copy still in flight (a failed write must not leave one writing into the
        arena the next snapshot fills), then free the arena. Raises the first copy's error, after
        all were waited for."""
        error: BaseException | None = None
        with self._lock:
            for chunks in self._chunks.values():
                for chunk in chunks:
                    if not chunk[4]:
                        try:
                            chunk[2].wait(chunk[3])
                        # re-raised below, once all are waited for
                        except BaseException as err:  # noqa: BLE001
                            error = error or err
                        chunk[4], chunk[5] = True, None
            self.released = True
        if error is not None:
            raise error


class Pipeline:
    """One per attempt (the checkpointer's): its arena and its copiers (a CUDA side stream per
    device)."""

    def __init__(self, copier_of: Callable[[torch.Tensor], Copier | None] | None = None,
                 chunk: int = CHUNK) -> None:
        self._copiers: dict[str, Copier] = {}
        self.copier_of = copier_of or (lambda tensor: copier_for(tensor, self._copiers))
        self.chunk, self.arena = chunk, Arena()
        self._last: Staged | None = None

    def stage(self, pieces: Mapping[int, torch.Tensor], copy_host: bool) -> Staged:
        """Start the copies of ``pieces`` ({index: tensor}, in the order torch.save will write them)
        into the arena; return at once. ``copy_host``: copy CPU pieces too (an async snapshot), else
        write them as they are. The state the copies read is the training stream's at this call."""
        if self._last is not None and not self._last.released:
            raise RuntimeError("a snapshot's staged pieces were reused before its write released "
                               "them")
        routes = {i: self._route(t, copy_host) for i, t in pieces.items()}
        # made contiguous here, on the training stream, before the boundary: the copies read what it
        # holds
        copied = {i: t.detach().contiguous() for i, t in pieces.items() if routes[i] is not None
                  and t.nbytes}
        # a storage tied to two names is one host tensor, as torch.save has it
        same: dict[tuple[Any, ...], int] = {}
        firsts = {i: same.setdefault(_identity(t), i) for i, t in copied.items()}
        own = [i for i, first in firsts.items() if first == i]
        pinned = any(getattr(routes[i], "pins", False) for i in own)
        regions = self.arena.regions([copied[i].nbytes for i in own], pinned)
        hosts = {i: torch.frombuffer(region, dtype=torch.uint8) for i, region in zip(own, regions)}
        out = {i: _whole(t) if routes[i] is None else _host_like(t, hosts.get(firsts.get(i, -1)))
               for i, t in pieces.items()}
        chunks: dict[int, list[list[Any]]] = {}
        # filled as the copies start: a failed start is released at once
        self._last = Staged(out, chunks)
        try:
            self._start({i: (copied[i], hosts[i], routes[i]) for i in own},
                        chunks)  # type: ignore[misc]
        except BaseException:
            with contextlib.suppress(Exception):
                self._last.release()
            raise
        chunks.update({i: chunks[first] for i, first in firsts.items() if first != i})
        self._last.copying = any(c[2] is not HOST for cs in chunks.values() for c in cs)
        return self._last

    def borrow(self, sizes: list[int]) -> list[memoryview] | None:
        """The arena's regions for ``sizes``, for the survivors' snapshot's read of device memory
        (:mod:`hpc_ddp.rank.salvage.device_read`), without allocating: None when the arena is not
        pinned, too small, or a snapshot's write holds it. Kept for good: the process ends after the
        failure path, and a snapshot staged meanwhile (a false alarm's training thread) is refused,
        not written over the read."""
        if self._last is not None and not self._last.released:
            return None
        regions = self.arena.lend(sizes)
        if regions is not None:
            self._last = Staged({}, {})  # never released: stage() refuses to reuse the arena
        return regions

    def _start(self, plan: dict[int, tuple[torch.Tensor, torch.Tensor, Copier]],
               chunks: dict[int, list[list[Any]]]) -> None:
        """Every chunk's copy, started in piece order after each copier's boundary, into ``chunks``;
        then each copier releases the training stream behind its copies. A chunk keeps its source
        alive until it is waited for."""
        used = list({id(copier): copier for _, _, copier in plan.values()}.values())
        for copier in used:
            copier.boundary()
        try:
            for i, (tensor, host, copier) in plan.items():
                flat, chunks[i] = tensor.reshape(-1).view(torch.uint8), []
                for a in range(0, flat.numel(), self.chunk):
                    chunk = Chunk(i, a, min(a + self.chunk, flat.numel()), flat[a:a + self.chunk],
                                  host[a:a + self.chunk])
                    chunks[i].append([chunk.start, chunk.stop, copier, copier.copy_async(chunk),
                                      False, chunk])
        finally:
            for copier in used:
                # even after a failed start: the training stream never runs ahead of a copy
                copier.release()

    def _route(self, tensor: torch.Tensor, copy_host: bool) -> Copier | None:
        copier = self.copier_of(tensor)
        return copier if copier is not None else (HOST if copy_host else None)


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Each piece's offset in the arena (page-aligned) and the bytes they take in all."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // ALIGN) * ALIGN
    return offsets, at


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape),
            tuple(tensor.stride()))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A piece written as it is: itself when it is its storage's only bytes in row-major order, else
    a row-major copy of it (torch.save of a view writes the whole storage it views; a resume reads
    the bytes in the manifest's shape, :func:`hpc_ddp.rundir.slicing.pieces_for`)."""
    tensor = tensor.detach()
    whole = tensor.is_contiguous() and tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.nbytes
    return tensor if whole else tensor.clone(memory_format=torch.contiguous_format)


def _host_like(tensor: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """The host tensor torch.save gets for ``tensor``: its region of the arena, with its dtype and
    shape (an empty piece: a fresh empty tensor, nothing to copy)."""
    if host is None:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    return host.view(tensor.dtype).reshape(tensor.shape)
