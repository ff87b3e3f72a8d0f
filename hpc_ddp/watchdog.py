"""The hang watchdog: a rank that makes no progress for ``dist.timeout_s`` ends the job, saying who is stuck.

A rank stuck outside a collective (a deadlocked data loader, a sleep, an
infinite loop in the loss) leaves every other rank waiting inside one, until the
walltime runs out. Each rank therefore runs this thread. The training loop
calls :meth:`Watchdog.beat` with its step and phase (cheap: two assignments and
a clock read). The thread publishes the newest beat in the process group's
store. When the rank's own beat is older than the timeout, the thread:

1. dumps every thread's stack with ``faulthandler`` into the rank's log;
2. reads every rank's last beat from the store and names the ranks that are
   behind (the stuck ones; the others wait for them in a collective);
3. calls ``on_hang`` (by default: exit the process with :data:`EXIT_HUNG`).

The process group's own timeout is set above this one, so the watchdog
speaks first. No torch import: the store is passed in.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, Protocol

log = logging.getLogger("hpc_ddp.watchdog")
EXIT_HUNG = 4
# Order within a step: a rank in a later phase is waiting for the ones in earlier phases.
PHASES = ("start", "data", "forward", "backward", "optimizer", "boundary", "snapshot", "finish")


def poll_interval(timeout_s: float) -> float:
    """How often the watchdog looks: a tenth of the timeout, between 0.05 s and 5 s."""
    return max(0.05, min(5.0, timeout_s / 10))


class Store(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def laggards(beats: Sequence[tuple[int, str] | None]) -> list[int]:
    """The ranks whose (step, phase) is behind the rest; every rank that never beat counts as behind.

    Empty when all ranks are at the same place (then a collective itself hangs, or all are stuck).
    """
    keys = [(-1, -1) if beat is None else (beat[0], PHASES.index(beat[1])) for beat in beats]
    lowest = min(keys)
    behind = [rank for rank, key in enumerate(keys) if key == lowest]
    return [] if len(behind) == len(keys) else behind


def describe_hang(rank: int, timeout_s: float, beats: Sequence[tuple[int, str] | None]) -> str:
    """The message every watchdog logs; it names the stuck ranks."""
    mine = beats[rank]
    where = f"step {mine[0]} phase {mine[1]}" if mine else "start-up"
    stuck = laggards(beats)
    if not stuck:
        return (f"rank {rank}: no progress for {timeout_s:g}s at {where}; every rank is at the same place, so a "
                "collective itself is stuck (network, NCCL) or every rank is stuck.\nHINT: the stacks below "
                "show where; NCCL_DEBUG=INFO (dist.nccl_env) logs the collectives")
    places = ", ".join(f"rank {r} at " + (f"step {beats[r][0]} {beats[r][1]}" if beats[r] else "start-up")
                       for r in stuck[:16])
    more = f" and {len(stuck) - 16} more" if len(stuck) > 16 else ""
    return (f"rank {rank}: no progress for {timeout_s:g}s at {where}. Stuck: {places}{more}; the other ranks "
            "wait for them in a collective.\nHINT: the faulthandler stacks in the stuck ranks' logs show "
            "where they are (a data loader, I/O, code in the task, or a collective only some ranks call, such as "
            "a forward of the DDP model on rank 0 alone: docs/troubleshooting.md); `python -m hpc_ddp.status "
            "RUN_DIR` names the collective where the ranks parted")


class Watchdog:
    """One thread per rank; ``beat`` from the training loop, ``stop`` before a clean exit."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, *, store: Store | None = None,
                 on_hang: Callable[[str, list[int]], Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 stream: IO[str] | None = None, poll_s: float | None = None) -> None:
        self.timeout_s, self.rank, self.world_size, self.store = timeout_s, rank, world_size, store
        self.on_hang = on_hang or _exit_hung
        self.clock, self.stream = clock, stream
        self.poll_s = poll_s if poll_s is not None else poll_interval(timeout_s)
        self.step, self.phase, self.last = 0, "start", clock()
        self._published: tuple[int, str] | None = None
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
        """Publish the newest beat; fire if it is too old. True when it fired (for tests)."""
        self._publish()
        if self.clock() - self.last <= self.timeout_s:
            return False
        self._fire()
        return True

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            if self.check():
                return

    def _publish(self) -> None:
        beat = (self.step, self.phase)
        if self.store is None or beat == self._published:
            return
        try:
            self.store.set(f"hpc_ddp/beat/{self.rank}", f"{beat[0]}:{beat[1]}")
            self._published = beat
        except Exception as err:  # the store lives on rank 0's node: it may be gone with it
            log.debug("heartbeat not published: %s", err)

    def beats(self) -> list[tuple[int, str] | None]:
        """Every rank's last published beat (None when unknown); this rank's own from memory."""
        found: list[tuple[int, str] | None] = []
        for rank in range(self.world_size):
            if rank == self.rank:
                found.append((self.step, self.phase))
                continue
            found.append(self._read(rank))
        return found

    def _read(self, rank: int) -> tuple[int, str] | None:
        key = f"hpc_ddp/beat/{rank}"
        try:
            if self.store is None or not self.store.check([key]):
                return None
            step, phase = self.store.get(key).decode().split(":", 1)
            return (int(step), phase) if phase in PHASES else None
        except Exception:
            return None

    def _fire(self) -> None:
        stream = self.stream or sys.stderr
        beats = self.beats()
        message = describe_hang(self.rank, self.timeout_s, beats)
        log.error("%s", message)
        stream.write(f"[rank {self.rank}] hpc_ddp watchdog: stacks of every thread of this rank:\n")
        stream.flush()
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stream without a file descriptor (tests)
            pass
        self.on_hang(message, laggards(beats))


def _exit_hung(message: str, stuck: list[int]) -> None:
    from hpc_ddp.shutdown import exit_fast

    exit_fast(EXIT_HUNG)
