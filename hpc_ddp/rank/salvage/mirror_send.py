"""The per-rank mirror's sender (:mod:`hpc_ddp.rank.salvage.mirror`): each boundary's state packed
into a reused buffer on the training thread, and what the buddy needs of it sent by a thread of its
own.

Apart from the receiver (:mod:`~hpc_ddp.rank.salvage.mirror_receive`): the two share a lock and the
message format (:mod:`~hpc_ddp.rank.salvage.mirror_wire`), nothing else; a :class:`Sender` is one
side of a :class:`~hpc_ddp.rank.salvage.mirror.Mirror`.

**What is sent when.** The sender thread compares each state with the one its buddy holds (the last
it sent, kept in its own buffer; :func:`flat.changed`, 4 ms for 64 MB here, far less when a leaf
differs in its first bytes): the same bytes go as a header alone (**unchanged** at step S: the buddy
keeps its bytes and records S); where only some leaves changed and they are at most half the state,
as a **delta** of those leaves, which the buddy writes onto its copy; otherwise **whole**. A delta
and an unchanged message name the step they apply to (their base), and a receiver whose copy is not
of that step refuses them and keeps the older whole state it has (a warning says so) until a whole
one comes: a state put together from the wrong base is never held. The sender's base is only what it
sent and saw complete, so a state skipped while another was on its way, a size change, or a new
attempt (both sides start empty) never leave it wrong; and every :data:`FULL_EVERY` messages one
goes whole anyway, so a receiver that refused (a message lost some way this design does not foresee)
is whole again within that many steps.

**Memory, reused.** The sender holds at most :data:`IN_FLIGHT` buffers (the state its buddy holds,
the one on its way, the newest waiting, the one the boundary writes, and the boundary before the
last one, which is never reused while it is that), reused from step to step (a fresh buffer costs
page faults: 28 ms to fill 64 MB against 3 ms for a warm one here), and one for deltas (at most half
a state). A buddy that is slow or frozen gets the newest state once it can take it: a newer state
replaces the one waiting (``skipped``) and the step never waits; the mirror of that rank is then
older than the state.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc_ddp.core.errors import first_line
from hpc_ddp.rank.salvage import flat
from hpc_ddp.rank.salvage.mirror_wire import (BYTES, DELTA, FIRST_SIZE, FLAT, GROW, HEADER,
                                              UNCHANGED, Packed, grown, header, snapshot_bytes,
                                              step_of)
from hpc_ddp.rank.state import tracked

# a rank's buffers for its own states at most: a frozen buddy makes it hold this many, never more
IN_FLIGHT = 5
# messages: one goes whole at least this often (a refused delta is mended within as many steps)
FULL_EVERY = 100

log = logging.getLogger("hpc_ddp.mirror")


class Sender:
    """The sending side of a mirror: ``mark`` at every boundary (the training thread), the sender
    thread (:meth:`_run_sends`), and this rank's own last two states for ``held``. The mirror sets
    the fields it shares with the receiver (``buddy``, ``group``, ``_lock``, ``broken``) before
    :meth:`__init__`."""

    buddy: int
    group: dist.ProcessGroup
    # pack and send a state when it is this many steps newer than the last (per_rank's mirror=N)
    every = 1
    _lock: threading.Lock  # the sender's buffers and slots; the kept state while ``held`` copies it
    broken: str | None  # why the receiver or the sender stopped before the end (a peer died)

    def __init__(self) -> None:
        self.own: Packed | None = None  # this rank's last boundary
        # the one before it (never reused while it is: a failure may need it)
        self.before: Packed | None = None
        self.skipped = 0  # states never sent: a newer one replaced them while a send was on its way
        # messages sent, by kind (tests, benchmarks)
        self.sent_kinds = {BYTES: 0, FLAT: 0, UNCHANGED: 0, DELTA: 0}
        self.wire_bytes = 0  # bytes this rank's messages put on the wire, headers included
        self.allocated = 0  # buffers the boundary allocated (reused after: at most IN_FLIGHT exist)
        self.warned = False  # a state the flat format cannot carry was named once
        # the sender thread waits on it for a state or the end
        self._wake = threading.Condition(self._lock)
        self._next: Packed | None = None  # the newest state the sender thread has not taken yet
        self._base: Packed | None = None  # the state the buddy holds (the last send that completed)
        # buffers to reuse (a CUDA state's with its events: its copies may be pending)
        self._free: list[Packed] = []
        self._delta = torch.empty(0, dtype=torch.uint8)  # the sender thread's buffer for deltas
        self._since_full = 0  # messages since the last whole one
        self._closing = False
        self._size = FIRST_SIZE  # that the buddy's receiver posts
        self.posted = -1  # the newest step the sender thread posted
        # the newest step whose send completed (gloo wrote it out: a SIGKILL no longer loses it)
        self.sent = -1
        # the newest boundary not packed (``every``: the last state packed is recent enough)
        self.passed = -1
        # this rank's last two boundaries, packed or not, newest last
        self.boundaries: list[int] = []
        self._posted_changed = threading.Condition()

    def due(self, step: int) -> bool:
        """Whether the boundary of ``step`` packs and sends this rank's state: always at a cadence
        of 1; at ``every`` N, when it is at least N steps newer than the last state packed (or none
        is). A boundary that does not (:meth:`skip`) copies nothing: with ``mirror=N`` the copy, not
        the link, is what the mirror costs (B2-MIRROR-NODES)."""
        return self.every <= 1 or self.own is None or step - self.own.step >= self.every

    def skip(self, step: int) -> None:
        """A boundary that is not :meth:`due` (training thread): its state stays with the loop; this
        rank's last packed state, and its buddy's copy, stand for it after a failure, older."""
        self.boundaries = [*self.boundaries[-1:], step]
        with self._posted_changed:
            self.passed = max(self.passed, step)
            self._posted_changed.notify_all()

    def mark(self, step: int, state: bytes | dict[str, Any]) -> None:
        """At a boundary (training thread): this step's per-rank state (bytes, or a state as
        :func:`tracked.staged` gives it) is written into a reused buffer
        (:mod:`hpc_ddp.rank.salvage.flat`: one copy of each tensor), which is this rank's own (the
        one of the boundary before is kept too), and the sender thread sends it to the buddy (whole,
        as a delta, or as "unchanged"); it replaces a state still waiting for the sender thread.
        Never waits."""
        packed = self._pack(step, state)
        self.boundaries = [*self.boundaries[-1:], step]
        with self._lock:
            if self._next is not None:
                self.skipped += 1
                # never reused while it is ``before`` (``_take`` skips it)
                self._free.append(self._next)
            if self.own is not None and self.own.step < step:
                self.before = self.own
            self._next = self.own = packed
            self._wake.notify()

    def wait_sent(self, step: int, timeout: float) -> bool:
        """Whether the send of the state of ``step`` (or a later one) completed within ``timeout``
        seconds: the rehearsal's fault injection kills a rank once its state has left
        (``--fail-at``). Completed, not posted: a CI run killed a rank whose posted send of step 22
        never reached its buddy (it held step 21)."""
        with self._posted_changed:
            return self._posted_changed.wait_for(
                lambda: max(self.sent, self.passed) >= step or self.broken is not None, timeout)

    def own_bytes(self, step: int) -> bytes | None:
        """This rank's packed state of ``step`` when its last boundary or the one before was that
        step (a snapshot reuses it). The training thread's: only its own ``mark`` reuses these
        buffers."""
        for packed in (self.own, self.before):
            if packed is not None and packed.step == step:
                return snapshot_bytes(packed)
        return None

    def _pack(self, step: int, state: bytes | dict[str, Any]) -> Packed:
        """The state written into a buffer from :meth:`_take`. A state
        :mod:`~hpc_ddp.rank.salvage.flat` cannot give back exactly goes as ``torch.save`` bytes.
        With CUDA tensors in it, the buffer is pinned and its copies from the GPU only enqueued: the
        events beside it (one per device; else None) complete with them, and whoever reads it waits
        for them first, never the training thread."""
        layout = None if isinstance(state, bytes) else flat.plan(state)
        if layout is None and not isinstance(state, bytes) and not self.warned:
            self.warned = True
            log.warning("the per-rank state holds %s, which the mirror cannot copy as it copies "
                        "tensors: it is packed with torch.save at every boundary, on the training "
                        "thread (with a CUDA tensor inside, a device sync per step).\nHINT: keep "
                        "tensors, numbers, strings, lists and dicts in it (a namedtuple or a "
                        "dataclass as a dict, a NumPy array as a tensor)", flat.unsupported(state))
        blob = (b"" if layout is not None else state if isinstance(state, bytes)
                else tracked.pack(state))
        size = layout.nbytes if layout is not None else len(blob)
        buf = self._take(HEADER + size, pinned=layout is not None and layout.cuda)
        if layout is None:
            buf.numpy()[HEADER:HEADER + size] = np.frombuffer(blob, dtype=np.uint8)  # one copy
            return Packed(step, buf, size, BYTES, [(0, size)], None)
        layout.write(buf[HEADER:HEADER + size])
        ready = None
        # after the copies, on the stream of each device they came from: this boundary's state
        if layout.cuda:
            ready = []
            for device in {t.device for t in layout.tensors if t.is_cuda}:
                ready.append(torch.cuda.Event())
                ready[-1].record(torch.cuda.current_stream(device))
        return Packed(step, buf, size, FLAT, layout.segments(), ready, layout.cuda)

    def _take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A free buffer of at least ``nbytes`` (whose copies from a GPU, if any, are done), or a
        new one a sixteenth larger (room for a state that grows a little) in place of a free one
        that does not fit. Never this rank's last state nor the one before: ``held`` may read them
        (under the lock) while this buffer is written (outside it), and after this boundary the last
        one is the one before."""
        with self._lock:
            usable = [i for i, old in enumerate(self._free)
                      if old is not self.own and old is not self.before]
            for i in usable:
                old = self._free[i]
                if (old.buf.numel() >= nbytes and old.pinned == pinned
                        and all(e.query() for e in old.ready or ())):
                    return self._free.pop(i).buf
            if usable:
                # never more than IN_FLIGHT: a new one replaces one that does not fit
                self._free.pop(usable[0])
            self.allocated += 1
        return torch.empty(grown(nbytes), dtype=torch.uint8, pin_memory=pinned)

    def _wire(self, packed: Packed) -> list[torch.Tensor]:
        """The messages that bring the buddy from the state it holds (the base) to ``packed``: a
        header alone when the bytes are the same, the changed leaves when they are at most half of
        it, else the whole state (sent from its own buffer: no copy); preceded by a new size when
        the buddy's buffer is too small for it."""
        base, kind, at = self._base, packed.kind, HEADER + packed.size
        whole = (base is None or self._since_full + 1 >= FULL_EVERY or base.kind != packed.kind
                 or base.size != packed.size or base.leaves != packed.leaves)
        if not whole:
            leaves = flat.changed(packed.body(), base.body(),  # type: ignore[union-attr]
                                  packed.leaves)
            if not leaves:
                kind, out, at = UNCHANGED, torch.empty(HEADER, dtype=torch.uint8), HEADER
            elif flat.delta_size(leaves) <= packed.size // 2:
                if self._delta.numel() < HEADER + flat.delta_size(leaves):
                    self._delta = torch.empty(grown(HEADER + packed.size // 2), dtype=torch.uint8)
                kind, out = DELTA, self._delta
                at = HEADER + flat.write_delta(out[HEADER:], packed.body(), leaves)
            else:
                whole = True
        if whole:
            out = packed.buf
        out[:HEADER] = header(packed.step, at - HEADER, self._size, kind, base.step if base else -1,
                              packed.size)
        self._since_full = 0 if whole else self._since_full + 1
        self.sent_kinds[kind] += 1
        messages = [out[:at]]
        if at > self._size:
            self._size = grown(at)
            messages.insert(0, header(GROW, 0, self._size))
        self.wire_bytes += sum(m.numel() for m in messages)
        return messages

    def _send(self, messages: list[torch.Tensor]) -> list[Any]:
        """Post the messages (non-blocking; gloo's transport thread writes them): their works. The
        seam the tests count messages through and drop one at."""
        works = [dist.isend(m, self.buddy, group=self.group) for m in messages]
        with self._posted_changed:
            self.posted = max(self.posted, step_of(messages[-1]))
            self._posted_changed.notify_all()
        return works

    def _run_sends(self) -> None:
        """The sender thread: takes the newest state, compares it with what the buddy holds, posts
        what the buddy needs and waits for it, off the training thread (a gloo ``isend`` can take
        milliseconds to return when the pair is busy: a median of 0.3 ms and a quarter over 2 ms on
        this machine's two shared cores). At the end it sends the state still waiting, then
        leaves."""
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._next is not None or self._closing)
                packed, self._next = self._next, None
            if packed is None:
                return
            try:
                for event in packed.ready or ():
                    # the copies from the GPU are in the buffer (waits here, GIL released)
                    event.synchronize()
                for work in self._send(self._wire(packed)):
                    work.wait()
                with self._posted_changed:
                    self.sent = max(self.sent, packed.step)
                    self._posted_changed.notify_all()
            except Exception as err:  # noqa: BLE001
                # the buddy was lost: no more sends (the flag stays up)
                self.broken = first_line(err)
                with self._posted_changed:
                    self._posted_changed.notify_all()
                return
            with self._lock:  # the buddy holds this one now: the base of the next comparison
                if self._base is not None:
                    self._free.append(self._base)
                self._base = packed

    def _own_bodies(self) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's last state and the one before: (step, kind, body), newest first (under the
        lock). Each is left out rather than waited for when its copies from a GPU are not done
        (``held`` gave them a bounded time first: a copy behind a wedged collective never is)."""
        out = []
        own, before = self.own, self.before
        if own is not None and all(event.query() for event in own.ready or ()):
            out.append((own.step, own.kind, own.body()))
        if before is not None and all(event.query() for event in before.ready or ()):
            out.append((before.step, before.kind, before.body()))
        return out
