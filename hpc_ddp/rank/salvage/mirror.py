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

**Two boundaries held** (issue 55). A failure can leave the survivors at two steps: part of a ring all-reduce
completed before a node froze, so some passed boundary k+1 and the others are still at k. The replicated state
of k is on the survivors at k; the set of k is whole only if every rank's per-rank state of k is somewhere
too. So each rank holds its own state and its ward's (the rank whose buddy this rank is) of its last two
boundaries (of its last two messages, for the ward's: a skipped state is not held), and :meth:`Mirror.held`
gives them all: ``{rank: {step: packed state}}``, newest first.

**Memory, reused.** The sender holds at most :data:`IN_FLIGHT` buffers (the state its buddy holds, the one on
its way, the newest waiting, the one the boundary writes, and the boundary before the last one, which is
never reused while it is that), reused from step to step (a fresh buffer costs page faults: 28 ms to fill
64 MB against 3 ms for a warm one here), and one for deltas (at most half a state). A buddy that is slow or
frozen gets the newest state once it can take it: a newer state replaces the one waiting (``skipped``) and the
step never waits; the mirror of that rank is then older than the state. The receiver keeps its ward's newest
whole state and the one before it in two of three buffers and receives into the third: a whole message is kept
where it arrived and the kept one becomes the one before (the three turn, no copy). A delta is written onto
the kept one, after the old bytes of the leaves it changes were copied into the third buffer (an undo: the
state before is the kept one with them written back, put together only when ``held`` asks; a copy of the
leaves that change, not of the whole state, each step); an "unchanged" message makes the kept bytes the state
of both steps. A refused change alters neither. Both sides use a gloo group of their own, so no collective of
the training waits behind them, and a buddy that dies or freezes stalls only these threads (gloo cannot abort
a transfer: pytorch#130345).

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
from hpc_ddp.rank.salvage.survivor import Survivor
from hpc_ddp.rank.state import tracked

log = logging.getLogger("hpc_ddp.mirror")
END = -1  # the header step that ends the exchange
GROW = -2  # the header step that says the next message is larger
HEADER = 48  # bytes: int64 step, byte count, next size, kind, base step, the state's size (16 | 48: any dtype views)
BYTES, FLAT, UNCHANGED, DELTA = 0, 1, 2, 3  # a body of bytes (torch.save's), salvage/flat.py's layout, none, leaves
WHOLE = -1  # the ward's state before the kept one is a whole body of its own (not the kept one with an undo)
FIRST_SIZE = 4096  # bytes the receiver posts at first (both sides start with it; grown as the state needs)
IN_FLIGHT = 5  # a rank's buffers for its own states at most: a frozen buddy makes it hold this many, never more
FULL_EVERY = 100  # messages: one goes whole at least this often (a refused delta is mended within as many steps)
RECEIVE_TIMEOUT = timedelta(hours=24)  # the mirror group's: no gap between two boundaries is that long
JOIN_S = 10.0  # how long the end of an attempt waits for the threads (a peer that never sends its end)


def new_group() -> dist.ProcessGroup:
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


def open_for(run: Survivor) -> Mirror | None:
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
    ready: list[torch.cuda.Event] | None
    pinned: bool = False

    def body(self) -> torch.Tensor:
        return self.buf[HEADER:HEADER + self.size]


class Mirror:
    """This rank's side of the exchange: ``mark`` at every boundary, ``held`` after a failure, ``close`` at the end."""

    def __init__(self, rank: int, local_world_size: int, world_size: int, group: dist.ProcessGroup) -> None:
        self.rank, self.group = rank, group
        self.buddy = buddy_of(rank, local_world_size, world_size)
        self.ward = ward_of(rank, local_world_size, world_size)
        self.own: Packed | None = None  # this rank's last boundary
        self.before: Packed | None = None  # the one before it (never reused while it is: a failure may need it)
        # the ward's newest whole state: (step, its buffer, kind, size); only the receiver thread replaces it
        self.kept: tuple[int, torch.Tensor, int, int] | None = None
        # the ward's state before that: (step, kind, size, undo); undo WHOLE: its body is in ``_spare``; else it is
        # the kept body with the first ``undo`` bytes of ``_spare`` (a delta: the old bytes of the leaves the last
        # delta changed) written onto a copy of it (0: the kept bytes as they are, "unchanged")
        self.kept_before: tuple[int, int, int, int] | None = None
        self._spare = torch.empty(0, dtype=torch.uint8)  # the receiver's third buffer: that state, or its undo
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

    def mark(self, step: int, state: bytes | dict[str, Any]) -> None:
        """At a boundary (training thread): this step's per-rank state (bytes, or a state as
        :func:`tracked.staged` gives it) is written into a reused buffer (:mod:`hpc_ddp.rank.salvage.flat`: one copy of
        each tensor), which is this rank's own (the one of the boundary before is kept too), and the sender thread
        sends it to the buddy (whole, as a delta, or as "unchanged"); it replaces a state still waiting for the
        sender thread. Never waits."""
        packed = self._pack(step, state)
        with self._lock:
            if self._next is not None:
                self.skipped += 1
                self._free.append(self._next)  # never reused while it is ``before`` (``_take`` skips it)
            if self.own is not None and self.own.step < step:
                self.before = self.own
            self._next = self.own = packed
            self._wake.notify()

    def wait_sent(self, step: int, timeout: float) -> bool:
        """Whether the send of the state of ``step`` (or a later one) completed within ``timeout`` seconds: the
        rehearsal's fault injection kills a rank once its state has left (``--fail-at``). Completed, not posted:
        a CI run killed a rank whose posted send of step 22 never reached its buddy (it held step 21)."""
        with self._posted_changed:
            return self._posted_changed.wait_for(lambda: self.sent >= step or self.broken is not None, timeout)

    def own_bytes(self, step: int) -> bytes | None:
        """This rank's packed state of ``step`` when its last boundary or the one before was that step (a snapshot
        reuses it). The training thread's: only its own ``mark`` reuses these buffers."""
        for packed in (self.own, self.before):
            if packed is not None and packed.step == step:
                return _snapshot_bytes(packed)
        return None

    def _pack(self, step: int, state: bytes | dict[str, Any]) -> Packed:
        """The state written into a buffer from :meth:`_take`. A state :mod:`~hpc_ddp.rank.salvage.flat` cannot give
        back exactly goes as ``torch.save`` bytes. With CUDA tensors in it, the buffer is pinned and its copies from
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
        sixteenth larger (room for a state that grows a little) in place of a free one that does not fit. Never
        this rank's last state nor the one before: ``held`` may read them (under the lock) while this buffer is
        written (outside it), and after this boundary the last one is the one before."""
        with self._lock:
            usable = [i for i, old in enumerate(self._free) if old is not self.own and old is not self.before]
            for i in usable:
                old = self._free[i]
                if old.buf.numel() >= nbytes and old.pinned == pinned and all(e.query() for e in old.ready or ()):
                    return self._free.pop(i).buf
            if usable:
                self._free.pop(usable[0])  # never more than IN_FLIGHT: a new one replaces one that does not fit
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

    def held(self) -> dict[int, dict[int, bytes]]:
        """What a survivor can give a just-in-time snapshot: {rank: {step: packed state}}, newest first, for itself
        and its ward, each at its last two boundaries (the survivors may stand at two steps: issue 55). Each is
        read under the lock (its buffer is neither reused nor written meanwhile), packed outside it."""
        for packed in (self.own, self.before):
            for event in (packed.ready or ()) if packed is not None else ():
                event.synchronize()  # before the lock: the boundary never waits for it behind the GPU
        with self._lock:
            mine = _copies(self._own_bodies())
            theirs = _copies(self._ward_bodies()) if self.ward != self.rank else []
        held: dict[int, dict[int, bytes]] = {}
        for rank, states in ((self.rank, mine), (self.ward, theirs)):
            packed: list[tuple[Any, bytes]] = []  # an "unchanged" state is one copy at two steps: packed once
            for step, got in states:
                if not packed or packed[-1][0] is not got:
                    packed.append((got, got if isinstance(got, bytes) else tracked.pack(got)))
                held.setdefault(rank, {})[step] = packed[-1][1]
        return held

    def _own_bodies(self) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's last state and the one before: (step, kind, body), newest first (under the lock). The last
        one's copies from a GPU are done already unless a boundary came since ``held`` waited for them; the one
        before is left out rather than waited for if its copies are not (enqueued before the last one's, they
        are done in practice)."""
        out = []
        own, before = self.own, self.before
        if own is not None:
            for event in own.ready or ():
                event.synchronize()
            out.append((own.step, own.kind, own.body()))
        if before is not None and all(event.query() for event in before.ready or ()):
            out.append((before.step, before.kind, before.body()))
        return out

    def _ward_bodies(self) -> list[tuple[int, int, torch.Tensor]]:
        """The ward's kept state and the one before it (:attr:`kept_before`): (step, kind, body), newest first
        (under the lock). The one before is put together in a copy where it is the kept one with an undo, and is
        the kept body itself where an "unchanged" message made it the same bytes."""
        kept, before = self.kept, self.kept_before
        if kept is None:
            return []
        newest = kept[1][HEADER:HEADER + kept[3]]
        out = [(kept[0], kept[2], newest)]
        if before is not None:
            step, kind, size, undo = before
            body = self._spare[HEADER:HEADER + size] if undo == WHOLE else newest if undo == 0 else newest.clone()
            if undo > 0:
                flat.apply_delta(body, self._spare[:undo])
            out.append((step, kind, body))
        return out

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
        """Receives into one buffer while the ward's newest whole state is kept in another and the one before it
        in a third (:meth:`_keep`): a whole message is kept where it arrived (the three turn, no copy); a delta
        or "unchanged" applies to the kept one when it is of the step they name, and is refused otherwise
        (``held`` reads both under the same lock)."""
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
            kept = [held[0] for held in (self.kept, self.kept_before) if held is not None] or None
            log.warning("the per-rank mirror of rank %d stopped (%s); it holds rank %d's state of steps %s. A "
                        "survivors' snapshot needs that rank's state of the step it commits: if rank %d is alive, "
                        "a later failure falls back to the periodic snapshot", self.ward, self.broken, self.ward,
                        kept, self.ward)

    def _keep(self, step: int, kind: int, base: int, full: int, got: torch.Tensor, length: int) -> torch.Tensor:
        """Keep what ``got`` brings (under the lock), and the state it replaces as the one before (what that was is
        dropped); returns the buffer to receive the next message into. A refused change changes neither."""
        with self._lock:
            kept = self.kept
            if kind in (BYTES, FLAT):
                self._stale = False
                free = torch.empty(0, dtype=torch.uint8)
                if kept is not None:  # three buffers in turn, no copy: the state before the kept one is dropped
                    free, self._spare = self._spare, kept[1]
                self.kept_before = (kept[0], kept[2], kept[3], WHOLE) if kept is not None else None
                self.kept = (step, got, kind, full)
                return free
            if kept is None or kept[0] != base or kept[3] != full:
                self._refuse(step, base, kept)
                return got
            undo = 0
            if kind == DELTA:
                undo = self._apply(kept[1][HEADER:HEADER + full], got[HEADER:HEADER + length], got.numel())
            self.kept_before = (kept[0], kept[2], kept[3], undo)
            self.kept = (step, *kept[1:])
            return got

    def _apply(self, body: torch.Tensor, delta: torch.Tensor, room: int) -> int:
        """Write ``delta`` onto the kept ``body``, the old bytes of its leaves first kept aside in ``_spare`` (the
        state before it, for ``held``: a copy of the leaves that change, not of the whole state); returns their
        size. A delta whose leaves do not fit raises before anything changed."""
        leaves = flat.delta_leaves(delta, body.numel())
        need = flat.delta_size(leaves)
        self.kept_before = None  # its bytes in ``_spare`` are about to go
        if self._spare.numel() < need:  # as large as a receive buffer: it takes a turn as one after a whole state
            self._spare = torch.empty(max(need, room), dtype=torch.uint8)
        flat.write_delta(self._spare, body, leaves)
        flat.apply_delta(body, delta)
        return need

    def _refuse(self, step: int, base: int, kept: tuple[int, torch.Tensor, int, int] | None) -> None:
        """A change not to the step kept: nothing is written, and one warning per stretch of refusals."""
        if not self._stale:
            log.warning("the per-rank mirror of rank %d refused its state of step %d (a change to step %d; it holds "
                        "step %s): it keeps that until a whole state comes", self.ward, step, base,
                        kept[0] if kept is not None else None)
        self.refused += 1
        self._stale = True


def _grown(nbytes: int) -> int:
    """A buffer size for ``nbytes``: a sixteenth more, in whole 4 KiB pages (a state that grows a little fits)."""
    return -(-nbytes * 17 // 16 // 4096) * 4096


def _copies(bodies: list[tuple[int, int, torch.Tensor]]) -> list[tuple[int, Any]]:
    """(step, a copy of what its body holds) for each, one copy for a body that is the one before it."""
    out: list[tuple[int, Any]] = []
    for i, (step, kind, body) in enumerate(bodies):
        out.append((step, out[-1][1] if i and body is bodies[i - 1][2] else _read(body, kind)))
    return out


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
