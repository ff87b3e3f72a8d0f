"""The hang watchdog: a rank that makes no progress for ``dist.timeout_s`` ends the job, saying who
is stuck.

A rank stuck outside a collective (a deadlocked data loader, a sleep, an
infinite loop in the loss) leaves every other rank waiting inside one, until the
walltime runs out. Each rank therefore runs this thread. The training loop
calls :meth:`Watchdog.beat` with its step and phase (cheap: two assignments and
a clock read); the thread publishes the newest beat in the process group's store.

Who is stuck must not depend on timing (which rank's thread looked first, whether a
beat was published yet, how slow the machine is), so the verdict is rank 0's alone,
from every rank's *final* position:

1. A rank whose own beat is older than the timeout is quiet: it publishes where it
   stays (step, phase, and from torch's flight recorder the last collective it entered
   on each process group) and waits for rank 0's verdict (a beat that moves on takes
   it back: it was slow, not stuck).
2. Rank 0, once quiet, reads the positions. The ranks that never entered a
   collective the others wait in are stuck; without a flight recorder, the ranks
   behind in (step, phase) (:func:`laggards`). A rank that looks behind is named only
   once its position is final (a stale one would name a rank that has moved on) and the
   ranks ahead are final too: one that got ahead a moment ago (past the end of a start-up
   the rank behind is slower in) waits for nobody yet.
3. When every rank is at the same place, the evidence is weak (a start-up or a
   snapshot write that every rank is slow in looks the same), so rank 0 gives the job
   twice the timeout before it says so; the collectives' own timeout (2 x this + 30 s)
   still comes later.
4. Every rank dumps its stacks and calls ``on_hang`` with rank 0's verdict (by
   default: exit with :data:`EXIT_HUNG`); rank 0 records it, once the quiet ranks have
   said they saw the verdict (the store lives in rank 0's process: it goes when rank 0 exits).

The verdict itself is :mod:`hpc_ddp.rank.watch.hang` (pure). No torch import: the store is passed
in, and the flight recorder is read lazily.
"""

from __future__ import annotations

from hpc_ddp.core.codes import EXIT_HUNG

import faulthandler
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Protocol

from hpc_ddp.rank.watch.hang import (PHASES, UNREADABLE, Issued, Position, describe_hang, laggards,
                                     never_entered, places, verdict)

__all__ = ["EXIT_HUNG", "PHASES", "UNREADABLE", "Position", "Watchdog", "describe_hang", "laggards",
           "never_entered", "poll_interval", "recorded_collectives", "verdict"]

log = logging.getLogger("hpc_ddp.watchdog")
BEAT_KEY, VERDICT_KEY, SEEN_KEY = "hpc_ddp/beat/", "hpc_ddp/hang/verdict", "hpc_ddp/hang/seen/"


def poll_interval(timeout_s: float) -> float:
    """How often the watchdog looks: a tenth of the timeout, between 0.05 s and 5 s."""
    return max(0.05, min(5.0, timeout_s / 10))


class Store(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def recorded_collectives() -> dict[str, int] | None:
    """This rank's last collective per process group, from torch's flight recorder; None without
    one."""
    try:
        import torch

        c10d = torch._C._distributed_c10d
        reader = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d,
                                                                       "_dump_nccl_trace_json",
                                                                       None)
        if reader is None:
            return None
        status = json.loads(reader(includeCollectives=False)).get("pg_status") or {}
        return {str(g): int(s["last_enqueued_collective"]) for g, s in status.items()} or None
    except Exception:  # a diagnosis only: without it the phases decide
        return None


class Watchdog:
    """One thread per rank; ``beat`` from the training loop, ``stop`` before a clean exit."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, *, store: Store | None = None,
                 on_hang: Callable[[str, list[int]], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 stream: IO[str] | None = None, poll_s: float | None = None,
                 collectives: Callable[[], Issued | None] | None = recorded_collectives) -> None:
        self.timeout_s, self.rank, self.world_size, self.store = timeout_s, rank, world_size, store
        self.on_hang = on_hang or _exit_hung
        self.clock, self.stream, self.collectives = clock, stream, collectives
        self.poll_s = poll_s if poll_s is not None else poll_interval(timeout_s)
        self.step, self.phase, self.last = 0, "start", clock()
        self._published: str | None = None
        self._final: Position | None = None  # this rank's final position while it is quiet
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc_ddp-watchdog", daemon=True)

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase, self.last = step, phase, self.clock()

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def check(self) -> bool:
        """Publish this rank's position; quiet for the timeout, judge (rank 0) or wait for rank 0's
        verdict.

        Fires once there is a verdict; True when it fired (for tests)."""
        last, quiet = self.last, self.clock() - self.last
        if quiet <= self.timeout_s:
            self._final = None
            self._publish(Position(self.step, self.phase))
            return False
        if self._final is None or (self._final.step, self._final.phase) != (self.step, self.phase):
            self._final = Position(self.step, self.phase, True, self.collectives()
                                   if self.collectives else None)
        self._publish(self._final)
        found = self._judge(quiet, last) if self.rank == 0 else self._verdict_of_rank_0(quiet)
        if found is None:  # no verdict yet (or rank 0 moved on before it gave one)
            return False
        if self.rank == 0:
            self._wait_until_seen()
        self._fire(*found)
        return True

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            if self.check():
                return

    def _publish(self, position: Position) -> None:
        text = position.encode()
        if self.store is None or text == self._published:
            return
        try:
            self.store.set(f"{BEAT_KEY}{self.rank}", text)
            self._published = text
        except Exception as err:  # the store lives on rank 0's node: it may be gone with it
            log.debug("heartbeat not published: %s", err)

    def positions(self) -> list[Position | str | None]:
        """Every rank's last published position (None: never published; UNREADABLE); this rank's own
        from memory."""
        return [self._final or Position(self.step, self.phase) if rank == self.rank
                else self._read(rank)
                for rank in range(self.world_size)]

    def beats(self) -> list[tuple[int, str] | None]:
        """Every rank's last published (step, phase), None when unknown; this rank's own from
        memory."""
        return places(self.positions())

    def _read(self, rank: int) -> Position | str | None:
        key = f"{BEAT_KEY}{rank}"
        try:
            if self.store is None or not self.store.check([key]):
                return None
            return Position.decode(self.store.get(key).decode())
        except Exception:
            return UNREADABLE

    def _judge(self, quiet: float, last: float) -> tuple[str, list[int]] | None:
        """Rank 0: the verdict from every rank's position, published for the others; None to wait
        (or when rank 0's own beat moved on meanwhile: it was slow, not stuck)."""
        positions = self.positions()
        stuck = verdict(positions, quiet, self.timeout_s)
        if stuck is None or self.last != last:
            return None
        message = describe_hang(self.rank, self.timeout_s, places(positions), stuck, quiet)
        if self.store is not None:
            try:
                self.store.set(VERDICT_KEY, json.dumps({"stuck": stuck, "message": message}))
            except Exception as err:
                log.debug("hang verdict not published: %s", err)
        return message, stuck

    def _wait_until_seen(self) -> None:
        """Rank 0: before it records and exits (taking the store along), every quiet rank has read
        the verdict and dumped its stacks; at most two polls and 2 s more (a rank that cannot answer
        is not waited for)."""
        waiting = {r for r, p in enumerate(self.positions()) if r != self.rank
                   and isinstance(p, Position) and p.final}
        deadline = time.monotonic() + 2 * self.poll_s + 2
        while waiting and time.monotonic() < deadline and self.store is not None:
            try:
                waiting = {r for r in waiting if not self.store.check([f"{SEEN_KEY}{r}"])}
            except Exception:
                return
            time.sleep(min(0.05, self.poll_s))

    def _verdict_of_rank_0(self, quiet: float) -> tuple[str, list[int]] | None:
        """Another rank: rank 0's verdict once it is published; its own view if none comes before
        the collectives' own timeout (2 x the timeout + 30 s: rank 0 is gone, or makes progress)."""
        try:
            if self.store is not None and self.store.check([VERDICT_KEY]):
                found = json.loads(self.store.get(VERDICT_KEY).decode())
                said = found["message"].removeprefix("rank 0: ")
                return f"rank {self.rank}: rank 0's verdict: {said}", list(found["stuck"])
        except Exception:
            pass
        if quiet < 2 * self.timeout_s + 30:
            return None
        beats = self.beats()
        described = describe_hang(self.rank, self.timeout_s, beats, quiet_s=quiet)
        return f"rank 0 gave no verdict; {described}", laggards(beats)

    def _fire(self, message: str, stuck: list[int]) -> None:
        stream = self.stream or sys.stderr
        log.error("%s", message)
        stream.write(f"[rank {self.rank}] hpc_ddp watchdog: stacks of every thread of this rank:\n")
        stream.flush()
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stream without a file descriptor (tests)
            pass
        if self.rank != 0 and self.store is not None:
            try:
                self.store.set(f"{SEEN_KEY}{self.rank}", "1")  # rank 0 may record and exit now
            except Exception:
                pass
        self.on_hang(message, stuck)


def _exit_hung(message: str, stuck: list[int]) -> None:
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(EXIT_HUNG)
