"""Each rank's ``per_rank(...)`` state, mirrored every step to a buddy rank on another node (issue 35).

A just-in-time snapshot (:mod:`hpc_ddp.rank.salvage.jit`) takes the replicated state from any survivor, but a
lost rank's own state (a prefetched batch, a per-rank counter, a non-DDP module) died with it. So at
every ``run.boundary`` each rank packs its per-rank objects (the bytes a snapshot would hold for it) and
sends them to its **buddy**: the rank with the same local rank on the next node (ring over
the nodes), so a whole node's loss leaves every one of its ranks' state on the next node. With one node
the buddy is the next rank on it: a crashed rank is covered, a lost node is not.

**Off the critical path.** The training thread writes its per-rank state into a message: one copy of
each tensor beside a JSON skeleton (:mod:`hpc_ddp.rank.salvage.flat`; a CUDA tensor comes to the CPU, which
waits for the GPU); ``torch.save`` bytes only for what that layout cannot give back exactly. A sender
thread posts it with a gloo ``isend`` and waits for it to complete (a gloo wait with a timeout closes the
connection when it expires, so nobody can poll). Measured with B2's 256 KB batch on this machine's two
shared cores (35 ms steps; every CPU cost there is about 5 x what it is alone, the other rank computing
beside it): the boundary's own CPU grows by 0.33 ms; with ``torch.save`` and the ``isend`` on the training
thread it grew by 0.85 ms of CPU, and the ``isend`` alone took 0.3 ms of wall time at the median and over
2 ms for a quarter of them. **The price** is a window: the state leaves when the sender thread has run,
1.2 ms after the boundary at the median there and 6 ms at the 90th percentile (far less on a node with idle
cores); a rank lost inside it takes that step's state with it, like a rank lost between its gradient
all-reduce and its boundary, and the survivors' snapshot falls back rather than mix. Up to
:data:`IN_FLIGHT` states may be on their way; beyond that (the buddy is frozen or slow) the newest waits for
one to complete and older ones are dropped, and the step never waits: the mirror of that rank is then
older than the state. A receiver thread keeps the newest message its ward (the rank whose buddy this
rank is) sent, in one of two buffers in turn (no copy). Both use a gloo group of their own, so no
collective of the training waits behind them, and a buddy that dies or freezes stalls only these threads
(gloo cannot abort a transfer: pytorch#130345).

Each message is one buffer of a size both sides know (4 KiB at first): a header (step, byte count,
next size) and the bytes. One message, not a header and then the bytes, because the receiver must have
its buffer posted when the bytes arrive: gloo drops what came for a buffer not yet posted when the
sender's connection closes, and a sender killed just after posting is the case that matters. A state
that outgrows the size is preceded by a message that says the new size (a sixteenth more than it
needs, so that is rare). Step -1 ends the exchange at the end of an attempt (every rank sends one, so every
receiver leaves its loop and nothing is in flight when the process group is destroyed).
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc_ddp.core.errors import first_line
from hpc_ddp.rank.group import control
from hpc_ddp.rank.salvage import flat
from hpc_ddp.rank.state import tracked

log = logging.getLogger("hpc_ddp.mirror")
END = -1  # the header step that ends the exchange
GROW = -2  # the header step that says the next message is larger
HEADER = 32  # bytes: int64 step, byte count, the next message's size, the body's kind
BYTES, FLAT = 0, 1  # a body of bytes (torch.save's, or given as bytes), or rank/salvage/flat.py's layout
FIRST_SIZE = 4096  # bytes of the first message (both sides start with it; grown as the state needs)
Sent = tuple  # (messages, the CUDA events their copies complete at, or None): what the sender thread posts
IN_FLIGHT = 4  # sends on their way at most: a frozen buddy holds this many states in memory, never more
RECEIVE_TIMEOUT = timedelta(hours=24)  # the mirror group's: no gap between two boundaries is that long
JOIN_S = 10.0  # how long the end of an attempt waits for the threads (a peer that never sends its end)


def new_group() -> Any:
    """Collective: the mirror's own gloo group, whose operations wait up to :data:`RECEIVE_TIMEOUT`. With the
    training group's timeout, a gap between two boundaries longer than ``dist.timeout_s`` (a long evaluation
    that beats but makes no boundary) timed the receive out, which closed the pair for good: every later
    failure then fell back to the periodic snapshot, and only a debug line said so. A lost ward still ends
    the receive at once (its connection closes); a frozen one holds only this thread."""
    return dist.new_group(backend="gloo", timeout=RECEIVE_TIMEOUT)


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
        group = new_group()
    return Mirror(run.rank, run.local_world_size, run.world_size, group).start()


class Mirror:
    """This rank's side of the exchange: ``mark`` at every boundary, ``held`` after a failure, ``close`` at the end."""

    def __init__(self, rank: int, local_world_size: int, world_size: int, group: Any) -> None:
        self.rank, self.group = rank, group
        self.buddy = buddy_of(rank, local_world_size, world_size)
        self.ward = ward_of(rank, local_world_size, world_size)
        # this rank's last boundary: its step, its message, and the CUDA events its copies complete at (or None)
        self.own: tuple[int, torch.Tensor, Any] | None = None
        self.kept: tuple[int, torch.Tensor] | None = None  # the ward's newest message received whole
        self.skipped = 0  # states never sent: a newer one replaced them while a send was on its way
        self.broken: str | None = None  # why the receiver stopped before the end (its ward died)
        self._in_flight = 0  # sends the waiter has not seen complete
        self._pending: Sent | None = None  # a newer state's messages that wait (the sender sends them)
        self._lock = threading.Lock()  # the in-flight count; and the received buffers while ``held`` copies one
        self._closed = False
        self._size = FIRST_SIZE  # of this rank's next message to its buddy
        self.posted = -1  # the newest step the sender thread posted
        self.sent = -1  # the newest step whose send completed (gloo wrote it out: a SIGKILL no longer loses it)
        self._posted_changed = threading.Condition()
        self._sent: queue.SimpleQueue[Sent | None] = queue.SimpleQueue()  # for the sender thread (None: stop)
        self._threads = [threading.Thread(target=self._receive, name="hpc_ddp-mirror-receive", daemon=True),
                         threading.Thread(target=self._run_sends, name="hpc_ddp-mirror-send", daemon=True)]

    def start(self) -> Mirror:
        for thread in self._threads:
            thread.start()
        return self

    def mark(self, step: int, state: Any) -> None:
        """At a boundary (training thread): this step's per-rank state (bytes, or a state as
        :func:`tracked.staged` gives it) is written into its message (:mod:`hpc_ddp.rank.salvage.flat`: one copy of each
        tensor), which is this rank's own, and the sender thread posts it to the buddy unless :data:`IN_FLIGHT`
        are on their way (the newest then waits for one to complete). Never waits."""
        messages, ready = self._messages(step, state)
        self.own = (step, messages[-1], ready)
        with self._lock:
            if self._in_flight >= IN_FLIGHT:
                if self._pending is not None:
                    self.skipped += 1  # a size change it carried still goes first: the buddy's buffer follows it
                    messages = [m for m in self._pending[0] if step_of(m) == GROW] + messages
                self._pending = (messages, ready)
                return
            self._in_flight += 1
        self._sent.put((messages, ready))

    def wait_sent(self, step: int, timeout: float) -> bool:
        """Whether the send of the state of ``step`` (or a later one) completed within ``timeout`` seconds: the
        rehearsal's fault injection kills a rank once its state has left (``--fail-at``). Completed, not posted:
        a CI run killed a rank whose posted send of step 22 never reached its buddy (it held step 21)."""
        with self._posted_changed:
            return self._posted_changed.wait_for(lambda: self.sent >= step or self.broken is not None, timeout)

    def own_bytes(self, step: int) -> bytes | None:
        """This rank's packed state of ``step`` when its last boundary was that step (a snapshot reuses it)."""
        own = self.own
        return _unpacked_own(own) if own is not None and own[0] == step else None

    def _messages(self, step: int, state: Any) -> Sent:
        """The state written into a message of the current size, preceded by a size change when it outgrew it
        (a sixteenth more than it needs: room for a state that grows a little). A state :mod:`~hpc_ddp.rank.salvage.flat`
        cannot give back exactly goes as ``torch.save`` bytes. With CUDA tensors in it, the message is pinned
        and its copies from the GPU only enqueued: the events returned beside it (one per device; else None)
        complete with them, and whoever reads the message waits for them first, never the training thread."""
        layout = None if isinstance(state, bytes) else flat.plan(state)
        blob = b"" if layout is not None else state if isinstance(state, bytes) else tracked.pack(state)
        size = layout.nbytes if layout is not None else len(blob)
        messages = []
        if HEADER + size > self._size:
            grown = -(-(HEADER + size) * 17 // 16 // 4096) * 4096
            messages.append(message(self._size, GROW, b"", grown))
            self._size = grown
        out = message(self._size, step, blob, self._size, pinned=layout is not None and layout.cuda)
        ready = None
        if layout is not None:
            layout.write(out[HEADER:HEADER + size])
            out[:HEADER] = header(step, size, self._size, FLAT)
            if layout.cuda:  # after the copies, on the stream of each device they came from: this boundary's state
                ready = []
                for device in {t.device for t in layout.tensors if t.is_cuda}:
                    ready.append(torch.cuda.Event())
                    ready[-1].record(torch.cuda.current_stream(device))
        return messages + [out], ready

    def _send(self, messages: list[torch.Tensor]) -> list[Any]:
        """Post the messages (non-blocking; gloo's transport thread writes them): their works."""
        works = [dist.isend(m, self.buddy, group=self.group) for m in messages]
        with self._posted_changed:
            self.posted = max(self.posted, step_of(messages[-1]))
            self._posted_changed.notify_all()
        return works

    def _run_sends(self) -> None:
        """The sender thread: posts each state and waits for it, off the training thread (a gloo ``isend`` can
        take milliseconds to return when the pair is busy: a median of 0.3 ms and a quarter over 2 ms on this
        machine's two shared cores)."""
        while (sent := self._sent.get()) is not None:
            messages, ready = sent
            try:
                for event in ready or ():
                    event.synchronize()  # the copies from the GPU are in the message (waits here, GIL released)
                for work in self._send(messages):
                    work.wait()
                with self._posted_changed:
                    self.sent = max(self.sent, step_of(messages[-1]))
                    self._posted_changed.notify_all()
            except Exception as err:  # noqa: BLE001 - the buddy was lost: no more sends (the flag stays up)
                self.broken = first_line(err)
                with self._posted_changed:
                    self._posted_changed.notify_all()
                return
            with self._lock:
                newer, self._pending = self._pending, None
                self._in_flight -= newer is None
            if newer is not None:
                self._sent.put(newer)

    def held(self) -> dict[int, tuple[int, bytes]]:
        """What a survivor can give a just-in-time snapshot: {rank: (step, packed state)} for itself and its ward."""
        held: dict[int, tuple[int, bytes]] = {}
        own = self.own
        if own is not None:
            held[self.rank] = (own[0], _unpacked_own(own))
        with self._lock:  # the receiver does not write into the buffer kept while it is copied
            if self.kept is not None and self.ward != self.rank:
                held[self.ward] = (self.kept[0], unpacked(self.kept[1]))
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
            for work in self._send([message(self._size, END, b"", self._size)]):
                work.wait()
        except Exception as err:  # noqa: BLE001 - the attempt ended cleanly; a mirror that cannot end is a note
            log.warning("the per-rank mirror could not send its end to rank %d: %s", self.buddy, err)
        self._threads[0].join(JOIN_S)
        if self._threads[0].is_alive():
            log.warning("the per-rank mirror's receiver did not end within %g s (rank %d never sent its end); "
                        "leaving it", JOIN_S, self.ward)

    def _receive(self) -> None:
        """Two buffers in turn: the newest whole message is kept where it arrived (no copy) and the next one is
        received into the other (``held`` copies the kept one under the lock the receiver takes to keep another)."""
        size = FIRST_SIZE
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        turn = 0
        try:
            while True:
                if buffers[turn].numel() != size:
                    buffers[turn] = torch.empty(size, dtype=torch.uint8)
                dist.recv(buffers[turn], self.ward, group=self.group)
                step, _, following, _ = (int(v) for v in buffers[turn][:HEADER].view(torch.int64).tolist())
                if step == END:
                    return
                if step == GROW:  # the next message is larger: received into this same (unkept) turn
                    size = following
                    continue
                with self._lock:
                    self.kept = (step, buffers[turn])
                turn = 1 - turn
        except Exception as err:  # noqa: BLE001 - its ward was lost, or the pair broke: a failure can lack its state
            self.broken = first_line(err)
            kept = self.kept[0] if self.kept is not None else None
            log.warning("the per-rank mirror of rank %d stopped (%s); it holds rank %d's state of step %s. A "
                        "survivors' snapshot needs that rank's state of the step it commits: if rank %d is alive, "
                        "a later failure falls back to the periodic snapshot", self.ward, self.broken, self.ward,
                        kept, self.ward)


def step_of(m: torch.Tensor) -> int:
    return int(m[:8].view(torch.int64)[0])


def unpacked(m: torch.Tensor) -> bytes:
    """The state bytes a message carries, as a snapshot holds them (``torch.save``'s; a copy either way)."""
    _, size, _, kind = (int(v) for v in m[:HEADER].view(torch.int64).tolist())
    if kind == FLAT:
        return tracked.pack(flat.read(m[HEADER:HEADER + size]))
    return m[HEADER:HEADER + size].numpy().tobytes()


def _unpacked_own(own: tuple[int, torch.Tensor, Any]) -> bytes:
    """This rank's own message as snapshot bytes, once its copies from the GPU (if any) are in it."""
    for event in own[2] or ():
        event.synchronize()
    return unpacked(own[1])


def header(step: int, size: int, following: int, kind: int = BYTES) -> torch.Tensor:
    return torch.tensor([step, size, following, kind], dtype=torch.int64).view(torch.uint8)


def message(capacity: int, step: int, blob: bytes, following: int, pinned: bool = False) -> torch.Tensor:
    """One buffer of ``capacity`` bytes: the header, then ``blob`` (the rest is never read: left as it was).
    ``pinned``: page-locked (from torch's caching host allocator), so copies from the GPU into it need not wait."""
    out = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
    out[:HEADER] = header(step, len(blob), following)
    out.numpy()[HEADER:HEADER + len(blob)] = np.frombuffer(blob, dtype=np.uint8)  # one copy
    return out
