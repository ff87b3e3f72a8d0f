"""Each rank's ``per_rank(...)`` state, mirrored every step to a buddy rank on another node (issue 35).

A just-in-time snapshot (:mod:`hpc_ddp.rank.salvage.jit`) takes the replicated state from any survivor, but a
lost rank's own state (a prefetched batch, a per-rank counter, a non-DDP module) died with it. So at
every ``run.boundary`` each rank packs its per-rank objects (the bytes a snapshot would hold for it) and
sends them to its **buddy**: the rank with the same local rank on the next node (ring over
the nodes), so a whole node's loss leaves every one of its ranks' state on the next node. With one node
the buddy is the next rank on it: a crashed rank is covered, a lost node is not.

**Off the critical path.** The training thread writes its per-rank state into a buffer: one copy of
each tensor beside a JSON skeleton (:mod:`hpc_ddp.rank.salvage.flat`; a CUDA tensor comes to the CPU, which
waits for the GPU); ``torch.save`` bytes only for what that layout cannot give back exactly. A sender
thread decides what to send, posts it with a gloo ``isend`` and waits for it to complete (a gloo wait with
a timeout closes the connection when it expires, so nobody can poll). Measured with B2's 256 KB batch on
this machine's two shared cores (35 ms steps; every CPU cost there is about 5 x what it is alone, the other
rank computing beside it): the boundary's own CPU grows by 0.33 ms; with ``torch.save`` and the ``isend`` on
the training thread it grew by 0.85 ms of CPU, and the ``isend`` alone took 0.3 ms of wall time at the median
and over 2 ms for a quarter of them. **The price** is a window: the state leaves when the sender thread has
run, 1.2 ms after the boundary at the median there and 6 ms at the 90th percentile (far less on a node with
idle cores); a rank lost inside it takes that step's state with it, like a rank lost between its gradient
all-reduce and its boundary, and the survivors' snapshot falls back rather than mix.

**What is sent when.** The sender thread compares each state with the one its buddy holds (the last it sent,
kept in its own buffer; :func:`flat.changed`, 4 ms for 64 MB here, far less when a leaf differs in its first
bytes): the same bytes go as a header alone (**unchanged** at step S: the buddy keeps its bytes and records
S); where only some leaves changed and they are at most half the state, as a **delta** of those leaves, which
the buddy writes onto its copy; otherwise **whole**. A delta and an unchanged message name the step they apply
to (their base), and a receiver whose copy is not of that step refuses them and keeps the older whole state
it has (a warning says so) until a whole one comes: a state put together from the wrong base is never held.
The sender's base is only what it sent and saw complete, so a state skipped while another was on its way, a
size change, or a new attempt (both sides start empty) never leave it wrong; and every :data:`FULL_EVERY`
messages one goes whole anyway, so a receiver that refused (a message lost some way this design does not
foresee) is whole again within that many steps.

**Memory, reused.** The sender holds at most :data:`IN_FLIGHT` buffers (the state its buddy holds, the one on
its way, the newest waiting, and the one the boundary writes), reused from step to step (a fresh buffer costs
page faults: 28 ms to fill 64 MB against 3 ms for a warm one here), and one for deltas (at most half a state).
A buddy that is slow or frozen gets the newest state once it can take it: a newer state replaces the one
waiting (``skipped``) and the step never waits; the mirror of that rank is then older than the state. The
receiver keeps its ward's (the rank whose buddy this rank is) newest whole state in one of two buffers and
receives into the other: a whole message swaps them (no copy), a delta is written onto the kept one. Both use
a gloo group of their own, so no collective of the training waits behind them, and a buddy that dies or
freezes stalls only these threads (gloo cannot abort a transfer: pytorch#130345).

Each message is one buffer: a header (step, byte count, next size, kind, base, the state's size) and the
bytes. One message, not a header and then the bytes, because the receiver must have its buffer posted when
the bytes arrive: gloo drops what came for a buffer not yet posted when the sender's connection closes, and a
sender killed just after posting is the case that matters. The receiver posts a buffer of a size both sides
know (4 KiB at first) and a message may be shorter (gloo fills the front of a larger posted buffer: a header
alone is 48 bytes on the wire). A message that would outgrow the size is preceded by a header that says the new
size (a sixteenth more than it needs, so that is rare). Step -1 ends the exchange at the end of an attempt
(every rank sends one, so every receiver leaves its loop and nothing is in flight when the process group is
destroyed).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
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
HEADER = 48  # bytes: int64 step, byte count, next size, kind, base step, the state's size (16 | 48: any dtype views)
BYTES, FLAT, UNCHANGED, DELTA = 0, 1, 2, 3  # a body of bytes (torch.save's), rank/salvage/flat.py's layout, none, leaves
FIRST_SIZE = 4096  # bytes the receiver posts at first (both sides start with it; grown as the state needs)
IN_FLIGHT = 4  # a rank's buffers for its own states at most: a frozen buddy makes it hold this many, never more
FULL_EVERY = 100  # messages: one goes whole at least this often (a refused delta is mended within as many steps)
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


@dataclass
class Packed:
    """One state as the boundary wrote it: ``buf`` holds room for a header, then the body (``size`` bytes of
    ``kind`` BYTES or FLAT, whose leaves are ``leaves``); ``ready``: the CUDA events its copies complete at."""
    step: int
    buf: torch.Tensor
    size: int
    kind: int
    leaves: list[flat.Segment]
    ready: list[Any] | None
    pinned: bool = False

    def body(self) -> torch.Tensor:
        return self.buf[HEADER:HEADER + self.size]


class Mirror:
    """This rank's side of the exchange: ``mark`` at every boundary, ``held`` after a failure, ``close`` at the end."""

    def __init__(self, rank: int, local_world_size: int, world_size: int, group: Any) -> None:
        self.rank, self.group = rank, group
        self.buddy = buddy_of(rank, local_world_size, world_size)
        self.ward = ward_of(rank, local_world_size, world_size)
        self.own: Packed | None = None  # this rank's last boundary
        # the ward's newest whole state: (step, its buffer, kind, size); only the receiver thread replaces it
        self.kept: tuple[int, torch.Tensor, int, int] | None = None
        self.skipped = 0  # states never sent: a newer one replaced them while a send was on its way
        self.refused = 0  # deltas and unchanged messages this receiver did not apply (not on the step it holds)
        self._stale = False  # refusing since the last whole state
        self.sent_kinds = {BYTES: 0, FLAT: 0, UNCHANGED: 0, DELTA: 0}  # messages sent, by kind (tests, benchmarks)
        self.wire_bytes = 0  # bytes this rank's messages put on the wire, headers included
        self.allocated = 0  # buffers the boundary allocated (reused after: at most IN_FLIGHT exist)
        self.broken: str | None = None  # why the receiver or the sender stopped before the end (a peer died)
        self._lock = threading.Lock()  # the sender's buffers and slots; the kept state while ``held`` copies it
        self._wake = threading.Condition(self._lock)  # the sender thread waits on it for a state or the end
        self._next: Packed | None = None  # the newest state the sender thread has not taken yet
        self._base: Packed | None = None  # the state the buddy holds (the last send that completed)
        self._free: list[Packed] = []  # buffers to reuse (a CUDA state's with its events: its copies may be pending)
        self._delta = torch.empty(0, dtype=torch.uint8)  # the sender thread's buffer for deltas
        self._since_full = 0  # messages since the last whole one
        self._closed = self._closing = False
        self._size = FIRST_SIZE  # that the buddy's receiver posts
        self.posted = -1  # the newest step the sender thread posted
        self.sent = -1  # the newest step whose send completed (gloo wrote it out: a SIGKILL no longer loses it)
        self._posted_changed = threading.Condition()
        self._threads = [threading.Thread(target=self._receive, name="hpc_ddp-mirror-receive", daemon=True),
                         threading.Thread(target=self._run_sends, name="hpc_ddp-mirror-send", daemon=True)]

    def start(self) -> Mirror:
        for thread in self._threads:
            thread.start()
        return self

    def mark(self, step: int, state: Any) -> None:
        """At a boundary (training thread): this step's per-rank state (bytes, or a state as
        :func:`tracked.staged` gives it) is written into a reused buffer (:mod:`hpc_ddp.rank.salvage.flat`: one copy of
        each tensor), which is this rank's own, and the sender thread sends it to the buddy (whole, as a delta,
        or as "unchanged"); it replaces a state still waiting for the sender thread. Never waits."""
        packed = self._pack(step, state)
        with self._lock:
            if self._next is not None:
                self.skipped += 1
                self._free.append(self._next)
            self._next = self.own = packed
            self._wake.notify()

    def wait_sent(self, step: int, timeout: float) -> bool:
        """Whether the send of the state of ``step`` (or a later one) completed within ``timeout`` seconds: the
        rehearsal's fault injection kills a rank once its state has left (``--fail-at``). Completed, not posted:
        a CI run killed a rank whose posted send of step 22 never reached its buddy (it held step 21)."""
        with self._posted_changed:
            return self._posted_changed.wait_for(lambda: self.sent >= step or self.broken is not None, timeout)

    def own_bytes(self, step: int) -> bytes | None:
        """This rank's packed state of ``step`` when its last boundary was that step (a snapshot reuses it)."""
        own = self.own
        return _snapshot_bytes(own) if own is not None and own.step == step else None

    def _pack(self, step: int, state: Any) -> Packed:
        """The state written into a buffer from :meth:`_take`. A state :mod:`~hpc_ddp.rank.salvage.flat` cannot give back
        exactly goes as ``torch.save`` bytes. With CUDA tensors in it, the buffer is pinned and its copies from
        the GPU only enqueued: the events beside it (one per device; else None) complete with them, and whoever
        reads it waits for them first, never the training thread."""
        layout = None if isinstance(state, bytes) else flat.plan(state)
        blob = b"" if layout is not None else state if isinstance(state, bytes) else tracked.pack(state)
        size = layout.nbytes if layout is not None else len(blob)
        buf = self._take(HEADER + size, pinned=layout is not None and layout.cuda)
        if layout is None:
            buf.numpy()[HEADER:HEADER + size] = np.frombuffer(blob, dtype=np.uint8)  # one copy
            return Packed(step, buf, size, BYTES, [(0, size)], None)
        layout.write(buf[HEADER:HEADER + size])
        ready = None
        if layout.cuda:  # after the copies, on the stream of each device they came from: this boundary's state
            ready = []
            for device in {t.device for t in layout.tensors if t.is_cuda}:
                ready.append(torch.cuda.Event())
                ready[-1].record(torch.cuda.current_stream(device))
        return Packed(step, buf, size, FLAT, layout.segments(), ready, layout.cuda)

    def _take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` (whose copies from a GPU, if any, are done), or a new one a
        sixteenth larger (room for a state that grows a little) in place of a free one that does not fit."""
        with self._lock:
            for i, old in enumerate(self._free):
                if old.buf.numel() >= nbytes and old.pinned == pinned and all(e.query() for e in old.ready or ()):
                    return self._free.pop(i).buf
            if self._free:
                self._free.pop(0)  # never more than IN_FLIGHT: a new one replaces one that does not fit
            self.allocated += 1
        return torch.empty(_grown(nbytes), dtype=torch.uint8, pin_memory=pinned)

    def _wire(self, packed: Packed) -> list[torch.Tensor]:
        """The messages that bring the buddy from the state it holds (the base) to ``packed``: a header alone when
        the bytes are the same, the changed leaves when they are at most half of it, else the whole state (sent
        from its own buffer: no copy); preceded by a new size when the buddy's buffer is too small for it."""
        base, kind, at = self._base, packed.kind, HEADER + packed.size
        whole = (base is None or self._since_full + 1 >= FULL_EVERY or base.kind != packed.kind
                 or base.size != packed.size or base.leaves != packed.leaves)
        if not whole:
            leaves = flat.changed(packed.body(), base.body(), packed.leaves)  # type: ignore[union-attr]
            if not leaves:
                kind, out, at = UNCHANGED, torch.empty(HEADER, dtype=torch.uint8), HEADER
            elif flat.delta_size(leaves) <= packed.size // 2:
                if self._delta.numel() < HEADER + flat.delta_size(leaves):
                    self._delta = torch.empty(_grown(HEADER + packed.size // 2), dtype=torch.uint8)
                kind, out = DELTA, self._delta
                at = HEADER + flat.write_delta(out[HEADER:], packed.body(), leaves)
            else:
                whole = True
        if whole:
            out = packed.buf
        out[:HEADER] = header(packed.step, at - HEADER, self._size, kind, base.step if base else -1, packed.size)
        self._since_full = 0 if whole else self._since_full + 1
        self.sent_kinds[kind] += 1
        messages = [out[:at]]
        if at > self._size:
            self._size = _grown(at)
            messages.insert(0, header(GROW, 0, self._size))
        self.wire_bytes += sum(m.numel() for m in messages)
        return messages

    def _send(self, messages: list[torch.Tensor]) -> list[Any]:
        """Post the messages (non-blocking; gloo's transport thread writes them): their works. The seam the
        tests count messages through and drop one at."""
        works = [dist.isend(m, self.buddy, group=self.group) for m in messages]
        with self._posted_changed:
            self.posted = max(self.posted, step_of(messages[-1]))
            self._posted_changed.notify_all()
        return works

    def _run_sends(self) -> None:
        """The sender thread: takes the newest state, compares it with what the buddy holds, posts what the buddy
        needs and waits for it, off the training thread (a gloo ``isend`` can take milliseconds to return when
        the pair is busy: a median of 0.3 ms and a quarter over 2 ms on this machine's two shared cores). At the
        end it sends the state still waiting, then leaves."""
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._next is not None or self._closing)
                packed, self._next = self._next, None
            if packed is None:
                return
            try:
                for event in packed.ready or ():
                    event.synchronize()  # the copies from the GPU are in the buffer (waits here, GIL released)
                for work in self._send(self._wire(packed)):
                    work.wait()
                with self._posted_changed:
                    self.sent = max(self.sent, packed.step)
                    self._posted_changed.notify_all()
            except Exception as err:  # noqa: BLE001 - the buddy was lost: no more sends (the flag stays up)
                self.broken = first_line(err)
                with self._posted_changed:
                    self._posted_changed.notify_all()
                return
            with self._lock:  # the buddy holds this one now: the base of the next comparison
                if self._base is not None:
                    self._free.append(self._base)
                self._base = packed

    def held(self) -> dict[int, tuple[int, bytes]]:
        """What a survivor can give a just-in-time snapshot: {rank: (step, packed state)} for itself and its ward.
        Each is read under the lock (its buffer is neither reused nor written meanwhile), packed outside it."""
        held: dict[int, tuple[int, bytes]] = {}
        own = self.own
        for event in (own.ready or ()) if own is not None else ():
            event.synchronize()  # before the lock: the boundary never waits for it behind the GPU
        with self._lock:
            own = self.own
            for event in (own.ready or ()) if own is not None else ():
                event.synchronize()  # done already unless a boundary came between (not while the training waits)
            mine = (own.step, _read(own.body(), own.kind)) if own is not None else None
            kept = self.kept if self.ward != self.rank else None
            theirs = (kept[0], _read(kept[1][HEADER:HEADER + kept[3]], kept[2])) if kept is not None else None
        for rank, got in ((self.rank, mine), (self.ward, theirs)):
            if got is not None:
                held[rank] = (got[0], got[1] if isinstance(got[1], bytes) else tracked.pack(got[1]))
        return held

    def close(self) -> None:
        """End of a clean attempt (every rank; once, later calls do nothing): send the end once the last state was
        sent, and wait for the receiver's end, so nothing is in flight when the process group goes (a receive
        left waiting aborts the process when the group is destroyed)."""
        if self._closed:
            return
        self._closed = True
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._threads[1].join(JOIN_S)
        try:
            if self._threads[1].is_alive() or self.broken:
                raise RuntimeError(self.broken or "the last send did not complete")
            for work in self._send([header(END, 0, self._size)]):
                work.wait()
        except Exception as err:  # noqa: BLE001 - the attempt ended cleanly; a mirror that cannot end is a note
            log.warning("the per-rank mirror could not send its end to rank %d: %s", self.buddy, err)
        self._threads[0].join(JOIN_S)
        if self._threads[0].is_alive():
            log.warning("the per-rank mirror's receiver did not end within %g s (rank %d never sent its end); "
                        "leaving it", JOIN_S, self.ward)

    def _receive(self) -> None:
        """Receives into one buffer while the ward's newest whole state is kept in the other: a whole message is
        kept where it arrived (the two swap, no copy); a delta or "unchanged" applies to the kept one when it is
        of the step they name, and is refused otherwise (``held`` reads the kept one under the same lock)."""
        size, into = FIRST_SIZE, torch.empty(FIRST_SIZE, dtype=torch.uint8)
        try:
            while True:
                if into.numel() < size:
                    into = torch.empty(size, dtype=torch.uint8)
                dist.recv(into, self.ward, group=self.group)
                step, length, following, kind, base, full = into[:HEADER].view(torch.int64).tolist()
                if step == END:
                    return
                if step == GROW:  # the next message is larger: received into a larger buffer
                    size = following
                    continue
                into = self._keep(step, kind, base, full, into, length)
        except Exception as err:  # noqa: BLE001 - its ward was lost, or the pair broke: a failure can lack its state
            self.broken = first_line(err)
            kept = self.kept[0] if self.kept is not None else None
            log.warning("the per-rank mirror of rank %d stopped (%s); it holds rank %d's state of step %s. A "
                        "survivors' snapshot needs that rank's state of the step it commits: if rank %d is alive, "
                        "a later failure falls back to the periodic snapshot", self.ward, self.broken, self.ward,
                        kept, self.ward)

    def _keep(self, step: int, kind: int, base: int, full: int, got: torch.Tensor, length: int) -> torch.Tensor:
        """Keep what ``got`` brings (under the lock); returns the buffer to receive the next message into."""
        with self._lock:
            kept = self.kept
            if kind in (BYTES, FLAT):
                self._stale = False
                self.kept = (step, got, kind, full)
                return kept[1] if kept is not None else torch.empty(0, dtype=torch.uint8)
            if kept is None or kept[0] != base or kept[3] != full:
                if not self._stale:  # one warning per stretch of refusals
                    log.warning("the per-rank mirror of rank %d refused its state of step %d (a change to step %d; "
                                "it holds step %s): it keeps that until a whole state comes", self.ward, step,
                                base, kept[0] if kept is not None else None)
                self.refused += 1
                self._stale = True
                return got
            if kind == DELTA:
                flat.apply_delta(kept[1][HEADER:HEADER + full], got[HEADER:HEADER + length])
            self.kept = (step, *kept[1:])
            return got


def _grown(nbytes: int) -> int:
    """A buffer size for ``nbytes``: a sixteenth more, in whole 4 KiB pages (a state that grows a little fits)."""
    return -(-nbytes * 17 // 16 // 4096) * 4096


def _read(body: torch.Tensor, kind: int) -> Any:
    """A copy of what a body holds (a state with tensors of its own, or bytes): made under the lock."""
    return flat.read(body) if kind == FLAT else body.numpy().tobytes()


def _snapshot_bytes(packed: Packed) -> bytes:
    """This rank's own state as snapshot bytes (``torch.save``'s), once its copies from the GPU are in it."""
    for event in packed.ready or ():
        event.synchronize()
    got = _read(packed.body(), packed.kind)
    return got if isinstance(got, bytes) else tracked.pack(got)


def step_of(m: torch.Tensor) -> int:
    return int(m[:8].view(torch.int64)[0])


def header(step: int, size: int, following: int, kind: int = BYTES, base: int = -1, full: int = 0) -> torch.Tensor:
    """A message's header, alone a message (its end, a new size, "unchanged") or the front of one."""
    return torch.tensor([step, size, following, kind, base, full], dtype=torch.int64).view(torch.uint8)
