"""Liveness: a rank or node that freezes is found in seconds, not after ``dist.timeout_s``.

A killed rank closes its sockets and its peers fail at once; a frozen node (SIGSTOP, a kernel hang,
power lost behind links that stay up) closes nothing, and the others would wait in a collective
until the hang watchdog (:mod:`hpc_ddp.rank.watch.watchdog`) fires. Liveness is not progress (a 90 s
evaluation on rank 0 is slow, not dead), so every rank runs a side thread that beats every
``dist.liveness_s / 6`` on its node (``/dev/shm``) and watches the next rank there; one beat per
node goes to the run dir (``RUN_DIR/liveness/node-N.json``), watched by the node before it: O(nodes)
on the file server at any ranks per node (issue 45; :mod:`hpc_ddp.rundir.beats` has the files). The
node's beat and the next node are the node's watcher process's
(:mod:`hpc_ddp.rank.watch.node_watch`, issue 60), which needs no rank's GIL and watches the node's
ranks through the kernel; this thread does all that only while no watcher runs.

Each peer is judged by the watcher's own clock (:class:`Judge`, pure): not before its first beat
of the attempt, nor after a last beat saying it ``left``, and silence the watcher could not watch
(its thread starved, the file server stalled, ``scontrol suspend``) is not counted. A rank's own
thread cannot beat while C code holds its GIL, hence a default (30 s) far above any such call.

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

from hpc_ddp.rank.watch import declaration, watcher_marker
from hpc_ddp.rank.watch.declaration import rewrite
from hpc_ddp.rank.watch.next_node import NextNode
from hpc_ddp.rank.watch.node_watch import Plan, Watcher, spawn
from hpc_ddp.rundir import beats, layout, node_local
from hpc_ddp.rundir.beats import Beat, Judge, decode, encode  # noqa: F401 (here first)
from hpc_ddp.core.codes import EXIT_FAILED, EXIT_LOST
from hpc_ddp.rundir.ledger import attempt_tag

log = logging.getLogger("hpc_ddp.liveness")
# a live peer beats this often within liveness_s: five late beats are still not a loss
BEATS_PER_WINDOW = 6
MIN_PERIOD_S = 0.25
HEAR_S = 0.5  # between two checks, how often a rank looks at its node's relay of a declaration


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
    toward: str = "127.0.0.1"  # MASTER_ADDR: the node's watcher pings from the address reaching it


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
                 wall: Callable[[], float] = time.time, node_watch: bool = False) -> None:
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
        self.local_peer = (self.place.local_rank + 1) % self.place.local_size
        self.local_judge = Judge(liveness_s)
        self.next_node = NextNode(self.run_dir, self.tag, self.place.node, self.place.nodes,
                                  liveness_s)
        # the leader's: the node's watcher process (node_watch.py), which beats for the node and
        # watches the next one while it is on duty (``watched``); started by start()
        self.node_watch, self.watcher = node_watch and self.leader, Watcher(None)
        self.watched, self._left, self._warned = False, False, False
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
        if self.node_watch:
            self.watcher = spawn(self._plan())
        self._thread.start()
        return self

    def _plan(self) -> Plan:
        return Plan(str(self.run_dir), self.ids, self.tag, self.local_tag, str(self.folder),
                    self.place.node, self.place.nodes, self.rank - self.place.local_rank,
                    self.place.local_size, self.host, self.liveness_s, self.period_s,
                    toward=self.place.toward)

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
        self.watcher.stop()  # before the node's last beat: nothing beats for the node after it
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
        # the node's watcher is on duty (its marker, its process alive): it beats for the node
        self.watched = watcher_marker.watching(self.folder, self.local_tag)
        self.beat()
        if not self._left:
            heard = self._hear()
            if heard is not None:
                self._act_on(heard)
                return None
        if self.leader and len(self.seen) < self.place.local_size:
            self._gather_ranks()
        silent = None
        if self.local_peer != self.place.local_rank and not self.watched:
            silent = self._watch_local()
        if silent is None and self.leader and not self.watched:
            silent = self._watch_node()
        return silent

    def _run(self) -> None:
        """A check every period; in between, every :data:`HEAR_S`, a look at the node's relay
        (node-local storage), where the node's watcher posts what it declared: its node's ranks
        hear it within half a second, not a period."""
        due = self.clock() + self.period_s
        while not self._stopped.wait(max(0.0, min(HEAR_S, due - self.clock()))):
            try:
                if self.clock() < due:
                    self._hear_on_node()
                    continue
                due = self.clock() + self.period_s
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
        """The next node's beat in the run dir (while the node's watcher does not run): a node
        silent for ``liveness_s`` is lost with all its ranks."""
        lost = self.next_node.look(self.clock())
        if lost is None:
            return None
        silent, last = lost
        self._declare(silent, list(last.ranks or (last.rank,)), last)
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
        mine = Beat(self.local_tag, self.rank, self.host, self.count, left, wall, pid=os.getpid())
        writes = [(beats.local_beat(self.folder, self.place.local_rank), encode(mine))]
        if self.leader and (left or not self.watched):
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
        """Another rank's declaration in this attempt, or None (:class:`declaration.Board`); before
        the rendezvous (a wrapped script's worker never passes one), its node's relay only."""
        return self.board.hear(self.rank, self.leader) if self.listening else self._hear_relay()

    def _hear_on_node(self) -> None:
        if not self._left and (record := self._hear_relay()) is not None:
            self._act_on(record)

    def _hear_relay(self) -> dict[str, Any] | None:
        record = declaration.heard_on_node(self.folder, self.local_tag)
        return None if record is None or record.get("by_rank") == self.rank else record

    def _act_on(self, record: dict[str, Any]) -> None:
        message = declaration.heard(self.rank, record)
        log.error("%s", message)
        self.leave()
        if self.before_exit is not None and not declaration.fenced(self.rank, record):
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
