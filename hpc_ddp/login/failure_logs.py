"""Which log says why an attempt failed: the first rank's own exception, not a survivor's view of
it.

When one rank crashes, every other rank fails too, a moment later, in whatever collective it
was waiting in: gloo says "Connection closed by peer", NCCL that a remote process exited or
the communicator was aborted. Those survivors write their tracebacks last, so the newest log
with a traceback is nearly always one that blames a peer. ``python -m hpc_ddp.status`` shows
instead the earliest log of the newest attempt whose error is not such a symptom, and a
survivor's only when no rank left anything else (a rank killed outright writes no traceback).

Login node: no torch, files only.
"""

from __future__ import annotations

import re
from pathlib import Path

from hpc_ddp.core import codes
from hpc_ddp.core.mismatch import mismatch_line

# What a rank says when a peer died under it: never the cause. Matched in the log's last lines.

# attempt-0-rank-3.log, 1234_3_log.err (submitit, task 3)
_RANK_PART = re.compile(r"rank-\d+|_\d+_log")


def has_error(lines: list[str]) -> bool:
    """A traceback, an ``error:`` line, or gloo's abort for a collective mismatch (no traceback:
    SIGABRT)."""
    return any("Traceback" in line or "error:" in line.lower()
               for line in lines) or mismatch_line(lines) is not None


def blames_a_peer(lines: list[str]) -> bool:
    """The log ends in a peer's failure (a survivor's view), not in an exception of its own."""
    return any(codes.blames_a_peer(line) for line in lines)


def attempt_of(log: Path) -> str:
    """The log's name without its rank: the logs of one attempt (or of one submitit job) share
    it."""
    return _RANK_PART.sub("", log.name)


def pick(logs: list[tuple[Path, float, list[str]]],
         lines: int = 15) -> tuple[Path, list[str]] | None:
    """Pure: from (path, mtime, its lines), the log to show and its tail. Among the newest attempt's
    logs that hold an error, the earliest written whose tail blames no peer; else the newest (a
    survivor's)."""
    failed = sorted(((path, when, text) for path, when, text in logs if has_error(text)),
                    key=lambda c: c[1])
    if not failed:
        return None
    newest = failed[-1]
    same = [c for c in failed if attempt_of(c[0]) == attempt_of(newest[0])]
    own = [c for c in same if not blames_a_peer(c[2][-lines:])]
    path, _, text = own[0] if own else newest
    return path, text[-lines:]


def last_errors(run_dir: Path, slurm_logs: Path, lines: int = 15) -> list[str]:
    """The tail of the log that says why the newest failed attempt failed, headed by its path; [] if
    none."""
    found = []
    for log in [*slurm_logs.glob("*.err"), *run_dir.glob("logs/*.log")]:
        try:
            found.append((log, log.stat().st_mtime, log.read_text(errors="replace").splitlines()))
        except OSError:
            continue
    chosen = pick(found, lines)
    if chosen is None:
        return []
    path, tail = chosen
    return [f"{path}:", *tail]
