"""Liveness: a rank or node that freezes is found in seconds, not after ``dist.timeout_s``.

A killed rank closes its sockets and its peers fail at once; a frozen node (SIGSTOP, a kernel
hang, power lost behind links that stay up) closes nothing, and the others would wait in a
collective until the hang watchdog (:mod:`hpc_ddp.rank.watchdog`) fires. Liveness is not progress
(a 90 s evaluation on rank 0 is slow, not dead), so every rank runs a side thread that, every
``dist.liveness_s / 6``:

1. **beats**: rewrites ``RUN_DIR/liveness/rank-K.json`` in place (open, write a counter, the
   attempt, host, rank, wall time; close). The run dir is shared by every node and needs no
   process group (the training group is what is stuck); NFS's close-to-open consistency makes
   a reader's next open see the new bytes. No mtimes or directory listings (attribute caches
   lie), no rename (a metadata operation per beat, and a reader's cached handle may go stale),
   no fsync (a beat is not durable data). One fixed-width file per rank rather than per
   attempt: the directory never grows, and the attempt inside tells older beats apart.
2. **watches one peer**: rank r reads rank (r+1) % W's file: one write and one read per period
   per rank at any world size, and a node's last rank watches the next node. The peer is judged
   by this rank's own monotonic clock (no change for ``liveness_s``), never by clocks across nodes.

Against false alarms (:class:`Judge`, pure): a peer is not judged before its first beat of the
attempt (ranks start seconds apart; one that never starts is the rendezvous timeout's), nor
after a last beat saying it ``left`` (it ended on its own, with its own exit code; the watcher
moves on to the next rank); and silence this rank could not watch (its thread starved, the file
server stalled, the job suspended by ``scontrol suspend``) is not counted. A thread rather than a
process: it beats while the main thread computes or waits in a collective (both release the GIL)
and dies with the process, as a frozen node's does; C code that holds the GIL for ``liveness_s``
would starve it, hence a default (30 s) far above any such call we know.

When the watched peer is silent for ``liveness_s``, this rank writes
``RUN_DIR/errors/<attempt>-lost-rank-P.json`` (rank, host from its last beat, silence, who saw
it) and a crash marker (a ``train.script`` worker then takes the SIGTERM that follows for a
failure, not a stop), logs the error and exits at once with :data:`EXIT_LOST`, without touching
the process group (a wedged communicator deadlocks a destroy). srun's ``--kill-on-bad-exit`` ends
the step; the batch shell reads :func:`lost_ranks` and leaves the node out.

**Every survivor hears the declaration.** Only the watcher sees the silence; the other survivors
used to learn of the loss when a peer they waited on exited and gloo failed their pending work.
NCCL does not fail it: a survivor blocked in an NCCL collective stays blocked, and the buddies that
hold the lost ranks' per-rank state never wrote it. So the watcher also writes the declaration into
``RUN_DIR/liveness/declared.json`` (one file per run, rewritten in place, the attempt inside; rank 0
creates it before the rendezvous, and the others read it only after, so no node caches its absence),
and every rank's thread reads it each period once the rendezvous is done (:meth:`Liveness.listen`).
A rank that hears it writes what it holds (the survivors' snapshot, from this thread) and exits with
:data:`EXIT_FAILED`, whatever its training thread is waiting for. No torch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.rundir import layout, losses
from hpc_ddp.core.atomic import rewrite_in_place, write_atomic
from hpc_ddp.core.codes import EXIT_FAILED, EXIT_LOST
from hpc_ddp.rundir.ledger import attempt_tag, crash_marker

if TYPE_CHECKING:
    from hpc_ddp.core.slurm_env import DistEnv



log = logging.getLogger("hpc_ddp.liveness")
BEATS_PER_WINDOW = 6  # a live peer beats this often within liveness_s: five late beats are still not a loss
MIN_PERIOD_S = 0.25
WIDTH = 256  # every beat is padded to this many bytes, so each write replaces the last one in place
HINT = ("HINT: the node may be frozen or gone (`scontrol show node HOST`, its kernel log); the batch shell leaves "
        "it out of the next step (slurm.spare_nodes, a slurm.nodes range) or the job takes the requeue path "
        "(slurm.max_failures). A rank that holds the GIL in C code this long looks the same: raise dist.liveness_s")


def period(liveness_s: float) -> float:
    """How often a rank beats and looks at its peer."""
    return max(MIN_PERIOD_S, liveness_s / BEATS_PER_WINDOW)


def effective(liveness_s: float | None, timeout_s: float) -> float | None:
    """The window this run uses; None when liveness is off: ``dist.liveness_s`` null or 0, or more than half
    of ``dist.timeout_s`` (then the hang watchdog would speak first; the config refuses that unless
    ``liveness_s`` is the default, which steps aside for a small ``dist.timeout_s``)."""
    if not liveness_s:
        return None
    return float(liveness_s) if 2 * liveness_s <= timeout_s else None


def host_of(environ: Mapping[str, str], nodelist: Sequence[str] = (), node_rank: int = 0) -> str:
    """This rank's node as Slurm names it (what the batch shell excludes), else as the hostlist does."""
    if environ.get("SLURMD_NODENAME"):
        return environ["SLURMD_NODENAME"]
    return nodelist[node_rank] if 0 <= node_rank < len(nodelist) else socket.gethostname()


@dataclass(frozen=True)
class Beat:
    tag: str  # the attempt (hpc_ddp.rundir.ledger.attempt_tag)
    rank: int
    host: str
    count: int
    left: bool = False
    wall: float = 0.0  # for people reading the file; never compared across nodes


def encode(beat: Beat) -> bytes:
    text = json.dumps({"attempt": beat.tag, "rank": beat.rank, "host": beat.host, "count": beat.count,
                       "state": "left" if beat.left else "alive", "time": round(beat.wall, 3)})
    return (text.ljust(WIDTH - 1) + "\n").encode()


def decode(raw: bytes, tag: str) -> Beat | None:
    """A beat of attempt ``tag``; None for anything else (no beat yet, another attempt's, a torn read)."""
    try:
        record, _ = json.JSONDecoder().raw_decode(raw.decode().lstrip())
        if record.get("attempt") != tag:
            return None
        return Beat(tag, int(record["rank"]), str(record.get("host") or ""), int(record["count"]),
                    record.get("state") == "left", float(record.get("time") or 0))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class Judge:
    """One watcher's view of one peer, by the watcher's own clock. Pure: ``observe`` is given the time."""

    def __init__(self, liveness_s: float) -> None:
        self.liveness_s = liveness_s
        self.stall_s = liveness_s / 2  # a gap this long between two looks: this rank was not watching
        self.count: int | None = None
        self.changed_at = 0.0
        self.looked_at: float | None = None
        self.left = False
        self.last: Beat | None = None

    def observe(self, beat: Beat | None, now: float) -> float | None:
        """One look at the peer's file (None: nothing readable of this attempt); the silence in seconds once
        it reaches ``liveness_s`` (the peer is lost), else None."""
        if self.looked_at is not None and now - self.looked_at > self.stall_s:
            self.changed_at = now  # the silence this rank missed is not the peer's fault: start again
        self.looked_at = now
        self.left = self.left or (beat is not None and beat.left)
        if self.left:
            return None
        if beat is not None and beat.count != self.count:
            self.count, self.changed_at, self.last = beat.count, now, beat
            return None
        if self.count is None:
            return None  # not beaten yet in this attempt: not judged
        silent = now - self.changed_at
        return silent if silent >= self.liveness_s else None


class Liveness:
    """This rank's beat-and-watch thread: ``start()`` when the attempt opens, ``leave()`` on every way out
    that this process controls (then its watcher never takes it for lost)."""

    def __init__(self, run_dir: Path | str, job_id: int | str | None, restart_count: int, in_job: int, rank: int,
                 world_size: int, host: str, liveness_s: float, *, on_lost: Callable[[str], Any] | None = None,
                 on_heard: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.run_dir, self.ids = Path(run_dir), (job_id, restart_count, in_job)
        self.tag = attempt_tag(job_id, restart_count, in_job)
        self.rank, self.world_size, self.host, self.liveness_s = rank, world_size, host, liveness_s
        self.period_s = period(liveness_s)
        self.on_lost = on_lost or _exit_lost
        self.on_heard = on_heard or _exit_heard
        self.before_exit: Callable[[str], Any] | None = None  # set by the session once the run exists
        self.listening = False  # reads the declaration once the rendezvous is done (:meth:`listen`)
        self.clock, self.wall = clock, wall
        self.count = 0
        self.peer = (rank + 1) % world_size
        self.judge = Judge(liveness_s)
        self._left, self._warned = False, False
        self._lock = threading.Lock()  # a beat and the last ("left") beat never interleave
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc_ddp-liveness", daemon=True)

    def start(self) -> Liveness:
        if self.rank == 0:  # before the rendezvous: no rank reads the declaration before it exists
            path = layout.declared(self.run_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        self.beat()
        self._thread.start()
        return self

    def listen(self) -> None:
        """After the rendezvous (rank 0 has created the declaration's file): hear declarations from now on."""
        self.listening = True

    def beat(self) -> None:
        with self._lock:
            if not self._left:
                self.count += 1
                self._write(Beat(self.tag, self.rank, self.host, self.count, wall=self.wall()))

    def leave(self) -> None:
        """Stop beating, with a last beat that says ``left``. Idempotent; safe from the thread itself."""
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.period_s + 1)
        with self._lock:
            if self._left:
                return
            self._left = True
            self.count += 1
            self._write(Beat(self.tag, self.rank, self.host, self.count, left=True, wall=self.wall()))

    def check(self) -> float | None:
        """One period: beat, look at the peer, declare it lost once silent for ``liveness_s``; returns that
        silence (None: nothing declared)."""
        self.beat()
        if self.listening and not self._left:
            heard = self._hear()
            if heard is not None:
                self._act_on(heard)
                return None
        if self.peer == self.rank:
            return None  # alone, or every other rank has left
        silent = self.judge.observe(self._read(self.peer), self.clock())
        if self.judge.left:  # watch the next rank instead, one per period (O(1) reads per rank as all leave)
            self.peer, self.judge = (self.peer + 1) % self.world_size, Judge(self.liveness_s)
            return None
        if silent is not None:
            self._declare(silent)
        return silent

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            try:
                self.check()
            except Exception as err:  # noqa: BLE001 - a thread that dies stops beating: its watcher would cry wolf
                log.warning("liveness check failed (this rank goes on beating): %s", err)

    def _write(self, beat: Beat) -> None:
        path = layout.beat(self.run_dir, self.rank)
        try:
            try:
                rewrite_in_place(path, encode(beat))
            except FileNotFoundError:  # the first beat of the run dir
                path.parent.mkdir(parents=True, exist_ok=True)
                rewrite_in_place(path, encode(beat))
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning("rank %d cannot write its liveness beat (%s): the rank watching it will declare it "
                            "lost after %gs. HINT: RUN_DIR must be writable from every node", self.rank, err,
                            self.liveness_s)

    def _write_declaration(self, record: dict[str, Any]) -> None:
        """In place, one fixed width (a second declarer overwrites the first whole); created if rank 0 had not."""
        rewrite_in_place(layout.declared(self.run_dir),
                         (json.dumps(record, sort_keys=True).ljust(4 * WIDTH - 1) + "\n").encode())

    def _read(self, rank: int) -> Beat | None:
        try:
            with open(layout.beat(self.run_dir, rank), "rb") as beat_file:
                return decode(beat_file.read(4 * WIDTH), self.tag)
        except OSError:
            return None

    def _hear(self) -> dict[str, Any] | None:
        """Another rank's declaration of a lost rank in this attempt, or None."""
        record = losses.declaration(self.run_dir, self.tag)
        return None if record is None or record.get("by_rank") == self.rank else record

    def _act_on(self, record: dict[str, Any]) -> None:
        message = (f"rank {self.rank}: rank {record.get('by_rank')} declared rank {record.get('rank')} on "
                   f"{record.get('host') or '?'} lost; this rank ends the step now instead of waiting in a "
                   "collective for the process group to fail")
        log.error("%s", message)
        self.leave()
        if self.before_exit is not None:
            self.before_exit(message)  # what this rank holds, from this thread (rank/jit.py)
        self.on_heard(message)

    def _declare(self, silent: float) -> None:
        last = self.judge.last
        host = last.host if last is not None and last.host else "?"
        message = (f"rank {self.rank}: rank {self.peer} on {host} is lost: no liveness beat for {silent:.0f}s "
                   f"(dist.liveness_s={self.liveness_s:g}); its last beat was #{last.count if last else '?'}. "
                   f"Ending this step now instead of waiting in a collective for dist.timeout_s.\n{HINT}")
        record = {"rank": self.peer, "host": host, "silent_s": round(silent, 1), "liveness_s": self.liveness_s,
                  "by_rank": self.rank, "by_host": self.host, "last_beat": last.count if last else None,
                  "last_beat_time": last.wall if last else None, "time": round(self.wall(), 3)}
        try:
            marker = layout.lost_marker(self.run_dir, self.tag, self.peer)
            marker.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, json.dumps(record, sort_keys=True) + "\n")
            write_atomic(crash_marker(self.run_dir, *self.ids, self.peer),
                         f"rank {self.peer} on {host} was lost: no liveness beat for {silent:.0f}s\n")
            self._write_declaration({**record, "attempt": self.tag})
        except OSError as err:
            log.error("the lost-rank marker could not be written: %s", err)
        log.error("%s", message)
        self.leave()
        if self.before_exit is not None:
            self.before_exit(message)  # the survivors' just-in-time snapshot (rank/jit.py), from this thread
        self.on_lost(message)


def start(run_dir: Path, dist: Any, env: DistEnv, environ: Mapping[str, str]) -> Liveness | None:
    """This rank's beats for the attempt, started; None when liveness is off (rank 0 says why when the
    config asked for it) or the rank is alone."""
    window = effective(dist.liveness_s, dist.timeout_s)
    if window is None and dist.liveness_s and env.is_main:  # only the default can be off this way (config checks)
        log.info("dist.liveness_s=%g is more than half of dist.timeout_s=%s: liveness is off for this run, and a "
                    "frozen node is found by the hang watchdog after dist.timeout_s.\nHINT: dist.liveness_s=%g "
                    "turns it on", dist.liveness_s, dist.timeout_s, max(1, dist.timeout_s // 4))
    if window is None or env.world_size < 2:
        return None
    return Liveness(run_dir, env.job_id, env.restart_count, env.in_job, env.rank, env.world_size,
                    host_of(environ, env.nodelist, env.node_rank), window).start()


def _exit_heard(message: str) -> None:
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(EXIT_FAILED)


def _exit_lost(message: str) -> None:
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(EXIT_LOST)
