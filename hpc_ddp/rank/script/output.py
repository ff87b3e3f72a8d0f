"""Rank 0's ``train.script`` output, read as it comes: passed on unchanged, its progress lines
noted.

A wrapped script is a black box except for what it prints. Rank 0's worker reads the
script's stdout and stderr through pipes (the child gets ``PYTHONUNBUFFERED=1``, so its
lines arrive when they are printed, not in 8 KiB blocks), writes every byte on to its
own stream, and notes each line that ``train.script_progress`` matches.

From those lines the worker judges whether the script went on after it was sent a stop
signal. A script that acts on one prints at most the line of the step in flight before
it exits; :data:`IGNORED_AFTER` progress lines after the signal show that it did not.
That judgment decides what an exit 0 after the signal means (the script ran to its end:
finished, not a stop to requeue) and what the ledger says when Slurm kills it. No torch.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import IO

IGNORED_AFTER = 2  # progress lines after a forwarded stop that prove the script went on
CHUNK = 65536
# a script is hung after this many times its longest gap between progress lines (if longer)
GAP_FACTOR = 3


@dataclass
class Progress:
    """What rank 0's script has printed so far, as ``train.script_progress`` reads it."""

    pattern: re.Pattern[str] | None
    step: int | None = None
    line: str = ""
    lines: int = 0  # progress lines seen
    seen_at: float | None = None  # time.monotonic() of the last progress line
    longest_gap: float = 0.0  # the longest time between two progress lines so far
    at_stop: int | None = None  # progress lines seen when the stop was forwarded
    step_at_stop: int | None = None
    first_step: int | None = None  # the attempt's first progress line's step, and that line
    first_line: str = ""
    last_output: str = ""  # the last non-blank line the script printed, progress or not
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def feed(self, text: str) -> None:
        if text.strip():
            self.last_output = text.strip()[:300]
        found = self.pattern.search(text) if self.pattern is not None else None
        if found is None or not found.groups():
            return
        try:
            step = int(found.group(1))
        except (TypeError, ValueError):
            return  # the group matched something that is not a number: not a step
        now = time.monotonic()
        with self._lock:
            if self.seen_at is not None:
                self.longest_gap = max(self.longest_gap, now - self.seen_at)
            self.step, self.line, self.lines, self.seen_at = step, text.strip(), self.lines + 1, now
            if self.first_step is None:
                self.first_step, self.first_line = step, self.line

    def stop_forwarded(self) -> None:
        with self._lock:
            if self.at_stop is None:
                self.at_stop, self.step_at_stop = self.lines, self.step

    def quiet_for(self, now: float | None = None) -> float | None:
        """Seconds since the last progress line; None before the second one (start-up and the first
        interval are not watched: until then nothing says how often the script prints)."""
        if self.seen_at is None or self.lines < 2:
            return None
        return (time.monotonic() if now is None else now) - self.seen_at

    def hang_limit(self, timeout_s: float) -> float:
        """Quiet time that means hung: ``timeout_s``, or 3 x the longest gap so far if that is
        longer (a script that prints once per 20-minute epoch is not hung after 10 quiet
        minutes)."""
        return max(timeout_s, GAP_FACTOR * self.longest_gap)

    @property
    def after_stop(self) -> int:
        """Progress lines printed since the stop was forwarded (0 before one was)."""
        return 0 if self.at_stop is None else self.lines - self.at_stop

    @property
    def ignored(self) -> bool:
        return self.after_stop >= IGNORED_AFTER

    def went_on(self, signame: str) -> str:
        """'the script went on after SIGUSR2: 5 progress lines since (step 30 -> 80)'."""
        since = (f"step {self.step_at_stop} -> {self.step}" if self.step_at_stop is not None
                 else f"to step {self.step}")
        return (f"the script went on after {signame}: {self.after_stop} progress lines since "
                f"({since})")


def relay(source: IO[bytes], sink: IO[bytes], progress: Progress) -> None:
    """Copy ``source`` to ``sink`` as bytes arrive until it closes, feeding each line to
    ``progress``.

    Chunks, not lines, are passed on: a progress bar that redraws itself with ``\r`` shows
    as it did without us. For reading, ``\r`` ends a line too.
    """
    pending = b""
    while True:
        chunk = source.read1(CHUNK)  # type: ignore[attr-defined]
        if not chunk:
            break
        try:
            sink.write(chunk)
            sink.flush()
        except (OSError, ValueError):
            # our own stream is gone (a closed pipe): keep reading, or the script blocks on a full
            # pipe
            pass
        *lines, pending = re.split(rb"[\r\n]", pending + chunk)
        # a script that never ends a line does not grow this without bound
        pending = pending[-CHUNK:]
        for line in lines:
            progress.feed(line.decode(errors="replace"))
    if pending:
        progress.feed(pending.decode(errors="replace"))


def start_relays(pairs: list[tuple[IO[bytes], IO[bytes]]],
                 progress: Progress) -> list[threading.Thread]:
    threads = [threading.Thread(target=relay, args=(source, sink, progress), daemon=True)
               for source, sink in pairs]
    for thread in threads:
        thread.start()
    return threads
