"""What an attempt of a rehearsal ended with: its code, and each distinct failure told once.

When ranks fail, the launcher (:mod:`hpc_ddp.rehearsal.local`) has ended the others; this decides
the attempt's code and what the user reads: an injected node loss or a rank declared lost in one
line, else each distinct error once, with the ranks that failed that way. Apart from the launcher
because it starts nothing and waits for nothing: it only reads the ranks' codes and logs.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import IO

from hpc_ddp.core.codes import EXIT_LOST, EXIT_SLOW, exit_words
from hpc_ddp.rehearsal.local_inject import ranks_text
from hpc_ddp.rundir import layout, losses


def attempt_code(procs: list[subprocess.Popen[bytes]], codes: list[int | None], failed: list[int],
                 paths: list[Path], attempt: tuple[Path, int, int, int],
                 watch: dict[str, object] | None, err: IO[str]) -> int:
    """The code of an attempt that was not interrupted: rank 0's when none failed, else the
    failure's (``watch["failed"]``: the ranks that failed, the first one first; a rank declared
    lost comes first). ``attempt``: the run dir, job id, requeue and job step."""
    logs = layout.logs(attempt[0])
    if watch is not None:
        watch["failed"] = list(failed)
    if not failed:
        return int(codes[0] or 0)
    if codes[failed[0]] == EXIT_SLOW:  # a stop of rank 0's own to leave out a slow node: no culprit
        err.write(f"[local] every rank stopped at a boundary with a snapshot to leave out a slow "
                  f"node (exit {EXIT_SLOW}); every rank's log is in {logs}\n")
        if watch is not None:
            watch["failed"] = []
        return EXIT_SLOW
    lost = watch.pop("lost", None) if watch is not None else None
    if lost:  # an injected node loss, not an error of the program: one line, not the tracebacks
        err.write(f"[local] {lost[0]} was lost ({ranks_text(lost[1])} killed); the other ranks "
                  f"were ended as srun would end them; every rank's log is in {logs}\n")
        watch["failed"] = list(lost[1])  # type: ignore[index]
        return -int(signal.SIGKILL)
    declared = losses.lost_ranks(*attempt)
    if declared:  # a rank stopped beating (frozen, --freeze-at): one line, not the tracebacks
        err.write(f"[local] {losses.describe(*attempt)}: the rank that saw it ended the step (exit "
                  f"{EXIT_LOST}) and the others were ended as srun would end them; every rank's "
                  f"log is in {logs}\n")
        if watch is not None:
            watch["failed"] = sorted(declared) + [rank for rank in failed if rank not in declared]
        return EXIT_LOST
    # ranks that fail the same way (a bad config fails everywhere) are shown together;
    # the first one decides
    final = [p.poll() for p in procs]
    failed += [rank for rank, code in enumerate(final)
               if code == codes[failed[0]] and rank not in failed]
    report_failures(sorted(failed), final, paths, err)
    stopped = "the other ranks were stopped; " if len(failed) < len(procs) else ""
    err.write(f"{stopped}every rank's log is in {logs}\n")
    return int(codes[failed[0]] or 1)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` of a rank's log (what to show when it printed no ``error: ...``)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def error_text(path: Path) -> str:
    """What a failed rank said: its ``error: ...`` message when it printed one, else its log's
    tail."""
    text = tail(path)
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    return "\n".join(lines[starts[-1]:]) if starts else text


def report_failures(failed: list[int], codes: list[int | None], paths: list[Path],
                    err: IO[str]) -> None:
    """Each distinct error once, with the ranks that failed that way (rank 0's was streamed
    already)."""
    groups: dict[tuple[int | None, str], list[int]] = {}
    for rank in failed:
        groups.setdefault((codes[rank], error_text(paths[rank])), []).append(rank)
    for (code, text), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        if 0 in ranks:
            err.write(f"\n{who} failed: {exit_words(code)} (the error above)\n")
        else:
            err.write(f"\n{who} failed: {exit_words(code)}; from {paths[ranks[0]]}:\n{text}\n")
