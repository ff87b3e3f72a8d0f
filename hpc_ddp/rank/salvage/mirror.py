"""Each rank's ``per_rank(...)`` state, mirrored every step to a buddy rank on another node (issue
35).

A just-in-time snapshot (:mod:`hpc_ddp.rank.salvage.jit`) takes the replicated state from any
survivor, but a lost rank's own state (a prefetched batch, a per-rank counter, a non-DDP module)
died with it. So at every ``run.boundary`` each rank packs its per-rank objects (the bytes a
snapshot would hold for it) and sends them to its **buddy**: the rank with the same local rank on
the next node (ring over the nodes), so a whole node's loss leaves every one of its ranks' state on
the next node. With one node the buddy is the next rank on it: a crashed rank is covered, a lost
node is not.

This module pairs the ranks and runs the exchange (:class:`Mirror`: start, ``held``, ``close``); its
two sides are modules of their own, the sender (:mod:`~hpc_ddp.rank.salvage.mirror_send`: what is
sent when, its buffers) and the receiver (:mod:`~hpc_ddp.rank.salvage.mirror_receive`: how the
ward's states are kept), and the messages they exchange are
:mod:`~hpc_ddp.rank.salvage.mirror_wire`'s.

**Off the critical path.** The training thread writes its per-rank state into a buffer: one copy of
each tensor beside a JSON skeleton (:mod:`hpc_ddp.rank.salvage.flat`; a CUDA tensor comes to the
CPU, which waits for the GPU); ``torch.save`` bytes only for what that layout cannot give back
exactly. A sender thread decides what to send, posts it with a gloo ``isend`` and waits for it to
complete (a gloo wait with a timeout closes the connection when it expires, so nobody can poll).
Measured with B2's 256 KB batch on this machine's two shared cores (35 ms steps; every CPU cost
there is about 5 x what it is alone, the other rank computing beside it): the boundary's own CPU
grows by 0.33 ms; with ``torch.save`` and the ``isend`` on the training thread it grew by 0.85 ms of
CPU, and the ``isend`` alone took 0.3 ms of wall time at the median and over 2 ms for a quarter of
them. **The price** is a window: the state leaves when the sender thread has run, 1.2 ms after the
boundary at the median there and 6 ms at the 90th percentile (far less on a node with idle cores); a
rank lost inside it takes that step's state with it, like a rank lost between its gradient
all-reduce and its boundary, and the survivors' snapshot falls back rather than mix.

**Two boundaries held** (issue 55). A failure can leave the survivors at two steps: part of a ring
all-reduce completed before a node froze, so some passed boundary k+1 and the others are still at k.
The replicated state of k is on the survivors at k; the set of k is whole only if every rank's
per-rank state of k is somewhere too. So each rank holds its own state and its ward's (the rank
whose buddy this rank is) of its last two boundaries (of its last two messages, for the ward's: a
skipped state is not held), and :meth:`Mirror.held` gives them all: ``{rank: {step: packed
state}}``, newest first.

**A cadence** (``per_rank(..., mirror=N)``, issue 59): a boundary copies and sends the state only
when it is N steps past the last one that did
(:meth:`~hpc_ddp.rank.salvage.mirror_send.Sender.due`); the copy is most of what the mirror costs.
After a failure the last state copied stands for the boundaries since, and ``stale`` says which (the
ledger names them).

Both sides use a gloo group of their own, so no collective of the training waits behind them, and a
buddy that dies or freezes stalls only these threads (gloo cannot abort a transfer: pytorch#130345).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hpc_ddp.rank.group import control
from hpc_ddp.rank.salvage.mirror_receive import Receiver
from hpc_ddp.rank.salvage.mirror_send import Sender
from hpc_ddp.rank.salvage.mirror_wire import END, copies, header
from hpc_ddp.rank.salvage.survivor import Survivor
from hpc_ddp.rank.state import tracked

log = logging.getLogger("hpc_ddp.mirror")
# the mirror group's timeout: no gap between two boundaries is that long
RECEIVE_TIMEOUT = timedelta(hours=24)
# how long the end of an attempt waits for the threads (a peer that never sends its end)
JOIN_S = 10.0
# how long a failure waits for a GPU's copies into this rank's last states (queried, never synced)
HELD_WAIT_S = 2.0


def new_group() -> dist.ProcessGroup:
    """Collective: the mirror's own gloo group, whose operations wait up to :data:`RECEIVE_TIMEOUT`.
    With the training group's timeout, a gap between two boundaries longer than ``dist.timeout_s``
    (a long evaluation that beats but makes no boundary) timed the receive out, which closed the
    pair for good: every later failure then fell back to the periodic snapshot, and only a debug
    line said so. A lost ward still ends the receive at once (its connection closes); a frozen one
    holds only this thread."""
    return dist.new_group(backend="gloo", timeout=RECEIVE_TIMEOUT)


def buddy_of(rank: int, local_world_size: int, world_size: int) -> int:
    """Whom ``rank`` sends its per-rank state to: same local rank on the next node (the next rank on
    one node)."""
    step = local_world_size if world_size > local_world_size else 1
    return (rank + step) % world_size


def ward_of(rank: int, local_world_size: int, world_size: int) -> int:
    """Whose state ``rank`` keeps: the rank whose buddy it is."""
    step = local_world_size if world_size > local_world_size else 1
    return (rank - step) % world_size


def open_for(run: Survivor) -> Mirror | None:
    """Collective at resume: this rank's mirror when the run tracks ``per_rank`` objects a buddy
    keeps (not ``mirror="derive"``'s) and may write a just-in-time snapshot (``snapshot.jit``, more
    than one rank), else None. Every rank decides alike (the group is made by all or by none)."""
    if run.held is None or run.world_size == 1:
        return None
    # the smallest cadence any rank keeps (0: none keeps any): every rank sends alike
    every = control.to_main_and_back(tracked.cadence(run.per_rank),
                                     merge=lambda all_: min((c for c in all_ if c), default=0))
    if not every:
        return None
    # each rank connects to its buddy and its ward only, on the first message
    with control.lazily():
        group = new_group()
    return Mirror(run.rank, run.local_world_size, run.world_size, group, every).start()


def covered(states: dict[int, bytes], steps: list[int], every: int) -> dict[int, int]:
    """With a cadence of ``every`` steps, the state a rank's ``states`` ({step: packed}) can give
    at each of this rank's last boundaries (``steps``) they hold no copy of: the newest of an
    earlier step, at most ``2 every - 1`` steps older (the ward's next send may have been on its
    way): {step: the held step}."""
    found = {}
    for step in steps:
        older = [held for held in states if held <= step]
        if step not in states and older and step - max(older) < 2 * every:
            found[step] = max(older)
    return found


class Mirror(Sender, Receiver):
    """This rank's side of the exchange: ``mark`` at every boundary, ``held`` after a failure,
    ``close`` at the end. The sending (:class:`~hpc_ddp.rank.salvage.mirror_send.Sender`) and the
    receiving (:class:`~hpc_ddp.rank.salvage.mirror_receive.Receiver`) are its two sides, each on a
    thread of its own."""

    def __init__(self, rank: int, local_world_size: int, world_size: int,
                 group: dist.ProcessGroup, every: int = 1) -> None:
        self.rank, self.group, self.every = rank, group, max(1, every)
        # after ``held``: the states it gave at a step they are not of ({rank: {step: their step}})
        self.stale: dict[int, dict[int, int]] = {}
        self.buddy = buddy_of(rank, local_world_size, world_size)
        self.ward = ward_of(rank, local_world_size, world_size)
        # why the receiver or the sender stopped before the end (a peer died)
        self.broken: str | None = None
        # the sender's buffers and slots; the kept state while ``held`` copies it
        self._lock = threading.Lock()
        Sender.__init__(self)
        Receiver.__init__(self)
        self._closed = False
        self._threads = [
            threading.Thread(target=self._receive, name="hpc_ddp-mirror-receive", daemon=True),
            threading.Thread(target=self._run_sends, name="hpc_ddp-mirror-send", daemon=True)]

    def start(self) -> Mirror:
        for thread in self._threads:
            thread.start()
        return self

    def held(self) -> dict[int, dict[int, bytes]]:
        """What a survivor can give a just-in-time snapshot: {rank: {step: packed state}}, newest
        first, for itself and its ward, each at its last two boundaries (the survivors may stand at
        two steps: issue 55). Each is read under the lock (its buffer is neither reused nor written
        meanwhile), packed outside it. A GPU's copy into a state's buffer not done within
        :data:`HELD_WAIT_S` leaves that state out (it was enqueued behind a wedged collective)."""
        # before the lock (the boundary never waits for it behind the GPU), queried, never
        # synchronized: a copy behind a wedged collective never completes (issue 58)
        deadline = time.monotonic() + HELD_WAIT_S
        for own in (self.own, self.before):
            for event in (own.ready or ()) if own is not None else ():
                while not event.query() and time.monotonic() < deadline:
                    time.sleep(0.001)
        with self._lock:
            mine = copies(self._own_bodies())
            theirs = copies(self._ward_bodies()) if self.ward != self.rank else []
        held: dict[int, dict[int, bytes]] = {}
        for rank, states in ((self.rank, mine), (self.ward, theirs)):
            # an "unchanged" state is one copy at two steps: packed once
            packed: list[tuple[Any, bytes]] = []
            for step, got in states:
                if not packed or packed[-1][0] is not got:
                    packed.append((got, got if isinstance(got, bytes) else tracked.pack(got)))
                held.setdefault(rank, {})[step] = packed[-1][1]
        if self.every > 1:  # a boundary that packed nothing: the last packed state stands for it
            self.stale = {r: c for r, states in held.items()
                          if (c := covered(states, self.boundaries, self.every))}
            for rank, given in self.stale.items():
                got = {**held[rank], **{s: held[rank][older] for s, older in given.items()}}
                held[rank] = dict(sorted(got.items(), reverse=True))  # newest first
        return held

    def close(self) -> None:
        """End of a clean attempt (every rank; once, later calls do nothing): send the end once the
        last state was sent, and wait for the receiver's end, so nothing is in flight when the
        process group goes (a receive left waiting aborts the process when the group is
        destroyed)."""
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
        except Exception as err:  # noqa: BLE001
            # the attempt ended cleanly; a mirror that cannot end is a note
            log.warning("the per-rank mirror could not send its end to rank %d: %s", self.buddy,
                        err)
        self._threads[0].join(JOIN_S)
        if self._threads[0].is_alive():
            log.warning("the per-rank mirror's receiver did not end within %g s (rank %d never "
                        "sent its end); leaving it", JOIN_S, self.ward)
