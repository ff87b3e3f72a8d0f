"""Liveness: a rank or node that freezes is found in seconds, not after ``dist.timeout_s``.

A killed rank closes its sockets and its peers fail at once; a frozen node (SIGSTOP, a kernel hang,
power lost behind links that stay up) closes nothing, and the others would wait in a collective
until the hang watchdog (:mod:`hpc_ddp.rank.watch.watchdog`) fires. Liveness is not progress (a 90 s
evaluation on rank 0 is slow, not dead), so every rank runs a side thread that, every
``dist.liveness_s / 6``:

Per node, not per rank (issue 45): at 512 nodes x 8 GPUs a file per rank would be 800 writes a
second, forever, in one directory of the shared filesystem. So (:mod:`hpc_ddp.rundir.beats`):

1. **Every rank beats on its node**: it rewrites its own beat (a counter, the attempt, host, rank,
   wall time) in place in the node's folder on node-local storage (``/dev/shm``), and watches the
   next rank on its node there: a rank of a live node that freezes is found and named by rank,
   with no byte on the shared filesystem.
2. **The node's first rank beats for the node**: it rewrites ``RUN_DIR/liveness/node-N.json`` in
   place (the node's ranks and host inside) and watches the next node's file: one write and two
   reads (the next node, the declaration) per period per node, at any ranks per node. A node that
   freezes whole is found by the node before it and declared with every rank on it. No mtimes or
   directory listings (attribute caches lie), no rename (a metadata operation per beat, and a
   reader's cached handle may go stale), no fsync (a beat is not durable data); NFS's close-to-open
   consistency makes a reader's next open see the new bytes. One file per node index, not per
   attempt: the directory never grows, and the attempt inside tells older beats apart.

Each peer is judged by the watcher's own monotonic clock (no change for ``liveness_s``), never by
clocks across nodes. Against false alarms (:class:`Judge`, pure): a peer is not judged before its
first beat of the attempt (ranks start seconds apart; one that never starts is the rendezvous
timeout's), nor after a last beat saying it ``left`` (it ended on its own, with its own exit code;
the watcher moves on to the next rank); and silence this rank could not watch (its thread starved,
the file server stalled, the job suspended by ``scontrol suspend``) is not counted. A thread rather
than a process: it beats while the main thread computes or waits in a collective (both release the
GIL) and dies with the process, as a frozen node's does; C code that holds the GIL for
``liveness_s`` would starve it, hence a default (30 s) far above any such call we know.

When the watched peer is silent for ``liveness_s``, this rank declares it lost (the markers in
``RUN_DIR/errors/``, the batch shell's :func:`lost_ranks`) and exits at once with :data:`EXIT_LOST`;
every survivor hears the declaration (:meth:`Liveness.listen`), writes what it holds and exits with
:data:`EXIT_FAILED`: :mod:`hpc_ddp.rank.watch.declaration` writes and reads it. No torch. The
session starts the thread with :func:`hpc_ddp.rank.watch.liveness_start.start`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.rank.watch import declaration
from hpc_ddp.rank.watch.declaration import rewrite
from hpc_ddp.rundir import beats, layout, node_local
# Judge, decode and encode were here first
from hpc_ddp.rundir.beats import Beat, Judge, decode, encode  # noqa: F401
from hpc_ddp.core.codes import EXIT_FAILED, EXIT_LOST
from hpc_ddp.rundir.ledger import attempt_tag

log = logging.getLogger("hpc_ddp.liveness")
# a live peer beats this often within liveness_s: five late beats are still not a loss
BEATS_PER_WINDOW = 6
MIN_PERIOD_S = 0.25


def period(liveness_s: float) -> float:
    """How often a rank beats and looks at its peer."""
    return max(MIN_PERIOD_S, liveness_s / BEATS_PER_WINDOW)


@dataclass(frozen=True)
class Place:
    """Where a rank sits for liveness: its index on its node, and its node's index in the step."""
    local_rank: int = 0
    local_size: int = 1
    node: int = 0
    nodes: int = 1


class Liveness:
    """This rank's beat-and-watch thread: ``start()`` when the attempt opens, ``leave()`` on every
    way out that this process controls (then its watcher never takes it for lost). Without a
    ``place`` every rank is a node of its own (the unit tests' pairs)."""

    def __init__(self, run_dir: Path | str, job_id: int | str | None, restart_count: int,
                 in_job: int, rank: int,
                 world_size: int, host: str, liveness_s: float, *, place: Place | None = None,
                 node_base: Path | None = None, on_lost: Callable[[str], Any] | None = None,
                 on_heard: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.run_dir, self.ids = Path(run_dir), (job_id, restart_count, in_job)
        self.tag = attempt_tag(job_id, restart_count, in_job)
        self.rank, self.world_size, self.host, self.liveness_s = rank, world_size, host, liveness_s
        self.place = place or Place(0, 1, rank, world_size)
        # beats for the node to the run dir and watches the next node
        self.leader = self.place.local_rank == 0
        self.folder = beats.node_dir(self.run_dir, self.tag, self.place.node, node_base)
        # what a record in self.folder must carry
        self.local_tag = beats.local_tag(self.run_dir, self.tag)
        # where this rank posts a declaration and hears one
        self.board = declaration.Board(self.run_dir, self.ids, self.tag, self.folder,
                                       self.local_tag)
        self.period_s = period(liveness_s)
        self.on_lost = on_lost or _exit_lost
        self.on_heard = on_heard or _exit_heard
        # set by the session once the run exists
        self.before_exit: Callable[[str], Any] | None = None
        self.listening = False  # reads the declaration once the rendezvous is done (:meth:`listen`)
        self.clock, self.wall = clock, wall
        self.count = 0
        # the leader's: the node's ranks, named in the node's beat; Slurm's and torchrun's block
        # layout until every rank of the node has beaten on it (then what they say: another
        # distribution numbers them otherwise)
        self.on_node = {rank - self.place.local_rank + i for i in range(self.place.local_size)}
        self.seen: set[int] = {rank}
        self.local_peer, self.local_judge = (self.place.local_rank
                                             + 1) % self.place.local_size, Judge(liveness_s)
        self.node_peer, self.node_judge = (self.place.node
                                           + 1) % self.place.nodes, Judge(liveness_s)
        self._left, self._warned = False, False
        self._lock = threading.Lock()  # a beat and the last ("left") beat never interleave
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc_ddp-liveness", daemon=True)

    def start(self) -> Liveness:
        if self.rank == 0:  # before the rendezvous: no rank reads the declaration before it exists
            path = layout.declared(self.run_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        # private, checked: a planted folder is refused here, before any beat
        node_local.ensure(self.folder)
        if self.leader:
            beats.clear_other_attempts(self.folder, self.tag)
        self.beat()
        self._thread.start()
        return self

    def listen(self) -> None:
        """After the rendezvous (rank 0 has created the declaration's file): hear declarations from
        now on."""
        self.listening = True

    def beat(self) -> None:
        with self._lock:
            if not self._left:
                self.count += 1
                self._write(left=False)

    def leave(self) -> None:
        """Stop beating, with a last beat that says ``left``. Idempotent; safe from the thread
        itself."""
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.period_s + 1)
        with self._lock:
            if self._left:
                return
            self._left = True
            self.count += 1
            self._write(left=True)
        beats.clear_when_all_left(self.folder, self.local_tag, self.place.local_size)

    def check(self) -> float | None:
        """One period: beat, hear a declaration, look at the next rank on this node and (the node's
        leader) at the next node; declare what was silent for ``liveness_s``. Returns that silence
        (None: none declared)."""
        self.beat()
        if self.listening and not self._left:
            heard = self._hear()
            if heard is not None:
                self._act_on(heard)
                return None
        if self.leader and len(self.seen) < self.place.local_size:
            self._gather_ranks()
        silent = None
        if self.local_peer != self.place.local_rank:
            silent = self._watch_local()
        if silent is None and self.leader and self.node_peer != self.place.node:
            silent = self._watch_node()
        return silent

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            try:
                self.check()
            # a thread that dies stops beating: its watcher would cry wolf
            except Exception as err:  # noqa: BLE001
                log.warning("liveness check failed (this rank goes on beating): %s", err)

    def _watch_local(self) -> float | None:
        """The next rank on this node, through the node's own storage: a frozen rank is named by
        rank."""
        judge = self.local_judge
        beat = beats.read(beats.local_beat(self.folder, self.local_peer), self.local_tag, own=True)
        silent = judge.observe(beat, self.clock())
        if judge.left:  # watch the next one instead, one per period
            self.local_peer = (self.local_peer + 1) % self.place.local_size
            self.local_judge = Judge(self.liveness_s)
            return None
        if silent is not None and judge.last is not None:
            self._declare(silent, [judge.last.rank], judge.last)
        return silent

    def _watch_node(self) -> float | None:
        """The next node's beat in the run dir: a node silent for ``liveness_s`` is lost with all
        its ranks."""
        judge = self.node_judge
        silent = judge.observe(beats.read(beats.node_beat(self.run_dir, self.node_peer), self.tag),
                               self.clock())
        if judge.left:
            self.node_peer, self.node_judge = (self.node_peer
                                               + 1) % self.place.nodes, Judge(self.liveness_s)
            return None
        if silent is not None and judge.last is not None:
            self._declare(silent, list(judge.last.ranks or (judge.last.rank,)), judge.last)
        return silent

    def _gather_ranks(self) -> None:
        """The leader learns its node's ranks from their local beats (no assumption on Slurm's
        distribution)."""
        for local in range(1, self.place.local_size):
            found = beats.read(beats.local_beat(self.folder, local), self.local_tag, own=True)
            if found is not None:
                self.seen.add(found.rank)
        if len(self.seen) == self.place.local_size:
            self.on_node = set(self.seen)

    def _write(self, left: bool) -> None:
        wall = self.wall()
        mine = Beat(self.local_tag, self.rank, self.host, self.count, left, wall)
        writes = [(beats.local_beat(self.folder, self.place.local_rank), encode(mine))]
        if self.leader:
            node = Beat(self.tag, min(self.on_node), self.host, self.count, left, wall,
                        self.place.node,
                        tuple(sorted(self.on_node)))
            writes.append((beats.node_beat(self.run_dir, self.place.node), encode(node)))
        for path, data in writes:
            try:
                rewrite(path, data)
            except OSError as err:
                if not self._warned:
                    self._warned = True
                    log.warning("rank %d cannot write its liveness beat to %s (%s): the rank "
                                "watching it will "
                                "declare it lost after %gs. HINT: RUN_DIR must be writable from "
                                "every node, and "
                                "/dev/shm or TMPDIR on each node", self.rank, path, err,
                                self.liveness_s)

    def _hear(self) -> dict[str, Any] | None:
        """Another rank's declaration in this attempt, or None
        (:meth:`hpc_ddp.rank.watch.declaration.Board.hear`)."""
        return self.board.hear(self.rank, self.leader)

    def _act_on(self, record: dict[str, Any]) -> None:
        message = declaration.heard(self.rank, record)
        log.error("%s", message)
        self.leave()
        if self.before_exit is not None:
            # what this rank holds, from this thread (rank/salvage/jit.py)
            self.before_exit(message)
        self.on_heard(message)

    def _declare(self, silent: float, ranks: list[int], last: Beat) -> None:
        message, record = declaration.lost(self.rank, self.host, self.liveness_s, silent, ranks,
                                           last, self.wall())
        self.board.post(record, silent)
        log.error("%s", message)
        self.leave()
        if self.before_exit is not None:
            # the survivors' just-in-time snapshot (rank/salvage/jit.py), from this thread
            self.before_exit(message)
        self.on_lost(message)


def _exit_heard(message: str) -> None:
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(EXIT_FAILED)


def _exit_lost(message: str) -> None:
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(EXIT_LOST)
