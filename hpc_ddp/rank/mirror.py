"""Each rank's ``per_rank(...)`` state, mirrored every step to a buddy rank on another node (issue 35).

A just-in-time snapshot (:mod:`hpc_ddp.rank.jit`) takes the replicated state from any survivor, but a
lost rank's own state (a prefetched batch, a per-rank counter, a non-DDP module) died with it. So at
every ``run.boundary`` each rank packs its per-rank objects (the bytes a snapshot would hold for it) and
sends them to its **buddy**: the rank with the same local rank on the next node (ring over
the nodes), so a whole node's loss leaves every one of its ranks' state on the next node. With one node
the buddy is the next rank on it: a crashed rank is covered, a lost node is not.

**Off the critical path.** The training thread packs (a ``torch.save`` into memory: microseconds for
small objects) and posts the bytes with a non-blocking ``isend``: gloo's own transport thread writes
them to the socket, so they leave at once (a Python thread would wait for the GIL while the next forward
runs, and a rank killed a few milliseconds after its boundary would take its state with it). A waiter
thread waits for each send to complete (a gloo wait with a timeout closes the connection when it
expires, so the training thread cannot poll). Up to :data:`IN_FLIGHT` sends may be on their way (the
waiter may not have had the GIL yet); beyond that (the buddy is frozen or slow) a boundary sends
nothing, keeps its state for the waiter to send once one completes, and never waits: the mirror of that
rank is then older than the state, and the survivors' snapshot falls back rather than mix. A receiver
thread keeps the newest state its ward (the rank whose buddy this rank is) sent. Both use a gloo group
of their own, so no collective of the training waits behind them, and a buddy that dies or freezes
stalls only the receiver thread (gloo cannot abort a transfer: pytorch#130345): the step goes on.

Each message is one buffer of a size both sides know (64 KiB at first): a header (step, byte count,
next size) and the bytes. One message, not a header and then the bytes, because the receiver must have
its buffer posted when the bytes arrive: gloo drops what came for a buffer not yet posted when the
sender's connection closes, and a sender killed just after its boundary is the case that matters. A
state that outgrows the size is preceded by a message that says the new size (a quarter more than it
needs, so that is rare). Step -1 ends the exchange at the end of an attempt (every rank sends one, so every
receiver leaves its loop and nothing is in flight when the process group is destroyed).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc_ddp.rank import control

log = logging.getLogger("hpc_ddp.mirror")
END = -1  # the header step that ends the exchange
GROW = -2  # the header step that says the next message is larger
HEADER = 24  # bytes: int64 step, byte count, the next message's size
FIRST_SIZE = 64 * 1024  # bytes of the first message (both sides start with it)
IN_FLIGHT = 4  # sends on their way at most: a frozen buddy holds this many states in memory, never more
JOIN_S = 10.0  # how long the end of an attempt waits for the threads (a peer that never sends its end)


def buddy_of(rank: int, local_world_size: int, world_size: int) -> int:
    """Whom ``rank`` sends its per-rank state to: same local rank on the next node (the next rank on one node)."""
    step = local_world_size if world_size > local_world_size else 1
    return (rank + step) % world_size


def ward_of(rank: int, local_world_size: int, world_size: int) -> int:
    """Whose state ``rank`` keeps: the rank whose buddy it is."""
    step = local_world_size if world_size > local_world_size else 1
    return (rank - step) % world_size


def open_for(run: Any) -> Mirror | None:
    """Collective at resume: this rank's mirror when the run tracks ``per_rank`` objects and may write a
    just-in-time snapshot (``snapshot.jit``, more than one rank), else None. Every rank decides alike (the
    group is made by all or by none)."""
    if run.held is None or run.world_size == 1:
        return None
    if not control.to_main_and_back(bool(run.per_rank), merge=any):
        return None
    with control.lazily():  # each rank connects to its buddy and its ward only, on the first message
        group = dist.new_group(backend="gloo", timeout=control.timeout())
    return Mirror(run.rank, run.local_world_size, run.world_size, group).start()


class Mirror:
    """This rank's side of the exchange: ``mark`` at every boundary, ``held`` after a failure, ``close`` at the end."""

    def __init__(self, rank: int, local_world_size: int, world_size: int, group: Any) -> None:
        self.rank, self.group = rank, group
        self.buddy = buddy_of(rank, local_world_size, world_size)
        self.ward = ward_of(rank, local_world_size, world_size)
        self.own: tuple[int, bytes] | None = None  # this rank's state at its last boundary
        self.kept: tuple[int, bytes] | None = None  # the ward's newest state received whole
        self.skipped = 0  # states never sent: a newer one replaced them while a send was on its way
        self.broken: str | None = None  # why the receiver stopped before the end (its ward died)
        self._in_flight = 0  # sends the waiter has not seen complete
        self._pending: tuple[int, bytes] | None = None  # a newer state that waits for it (the waiter sends it)
        self._lock = threading.Lock()
        self._closed = False
        self._size = FIRST_SIZE  # of this rank's messages to its buddy
        self._sent: queue.SimpleQueue[Any] = queue.SimpleQueue()  # sends for the waiter (works and their tensors)
        self._threads = [threading.Thread(target=self._receive, name="hpc_ddp-mirror-receive", daemon=True),
                         threading.Thread(target=self._wait, name="hpc_ddp-mirror-wait", daemon=True)]

    def start(self) -> Mirror:
        for thread in self._threads:
            thread.start()
        return self

    def mark(self, step: int, blob: bytes) -> None:
        """At a boundary (training thread): this step's packed state is this rank's own, and goes to the buddy
        unless the previous one is still on its way (never waits)."""
        self.own = (step, blob)
        with self._lock:
            if self._in_flight >= IN_FLIGHT:  # the waiter sends it (the newest only) when a send completes
                self.skipped += self._pending is not None
                self._pending = (step, blob)
                return
            self._in_flight += 1
        self._sent.put(self._send(step, blob))

    def _send(self, step: int, blob: bytes) -> tuple[list[Any], list[torch.Tensor]]:
        """Post the message (and a size change before it when the state outgrew the size; non-blocking): the
        works and the tensors they send from."""
        messages = []
        if HEADER + len(blob) > self._size:  # a quarter more than it needs: room for a state that grows a little
            grown = -(-(HEADER + len(blob)) * 5 // 4 // 4096) * 4096
            messages.append(message(self._size, GROW, b"", grown))
            self._size = grown
        messages.append(message(self._size, step, blob, self._size))
        return [dist.isend(m, self.buddy, group=self.group) for m in messages], messages

    def _wait(self) -> None:
        while (sent := self._sent.get()) is not None:
            try:
                for work in sent[0]:
                    work.wait()
            except Exception as err:  # noqa: BLE001 - the buddy was lost: no more sends (the flag stays up)
                self.broken = str(err).splitlines()[0] if str(err) else type(err).__name__
                return
            with self._lock:
                newer, self._pending = self._pending, None
                self._in_flight -= newer is None
            if newer is not None:
                self._sent.put(self._send(*newer))

    def held(self) -> dict[int, tuple[int, bytes]]:
        """What a survivor can give a just-in-time snapshot: {rank: (step, packed state)} for itself and its ward."""
        held: dict[int, tuple[int, bytes]] = {}
        if self.own is not None:
            held[self.rank] = self.own
        if self.kept is not None and self.ward != self.rank:
            held[self.ward] = self.kept
        return held

    def close(self) -> None:
        """End of a clean attempt (every rank; once, later calls do nothing): send the end once the last send
        completed, and wait for the receiver's end, so nothing is in flight when the process group goes (a
        receive left waiting aborts the process when the group is destroyed)."""
        if self._closed:
            return
        self._closed = True
        self._sent.put(None)
        self._threads[1].join(JOIN_S)
        try:
            if self._threads[1].is_alive() or self.broken:
                raise RuntimeError(self.broken or "the last send did not complete")
            for work in self._send(END, b"")[0]:
                work.wait()
        except Exception as err:  # noqa: BLE001 - the attempt ended cleanly; a mirror that cannot end is a note
            log.warning("the per-rank mirror could not send its end to rank %d: %s", self.buddy, err)
        self._threads[0].join(JOIN_S)
        if self._threads[0].is_alive():
            log.warning("the per-rank mirror's receiver did not end within %g s (rank %d never sent its end); "
                        "leaving it", JOIN_S, self.ward)

    def _receive(self) -> None:
        buffer = torch.empty(FIRST_SIZE, dtype=torch.uint8)
        try:
            while True:
                dist.recv(buffer, self.ward, group=self.group)
                step, size, following = (int(v) for v in buffer[:HEADER].view(torch.int64).tolist())
                if step == END:
                    return
                if step == GROW:
                    buffer = torch.empty(following, dtype=torch.uint8)
                    continue
                self.kept = (step, buffer[HEADER:HEADER + size].numpy().tobytes())
        except Exception as err:  # noqa: BLE001 - its ward was lost: the training thread's collective says so
            self.broken = str(err).splitlines()[0] if str(err) else type(err).__name__
            log.debug("per-rank mirror receiver ended: %s", self.broken)


def header(step: int, size: int, following: int) -> torch.Tensor:
    return torch.tensor([step, size, following], dtype=torch.int64).view(torch.uint8)


def message(capacity: int, step: int, blob: bytes, following: int) -> torch.Tensor:
    """One buffer of ``capacity`` bytes: the header, then ``blob`` (the rest is never read: left as it was)."""
    out = torch.empty(capacity, dtype=torch.uint8)
    out[:HEADER] = header(step, len(blob), following)
    out.numpy()[HEADER:HEADER + len(blob)] = np.frombuffer(blob, dtype=np.uint8)  # one copy
    return out
