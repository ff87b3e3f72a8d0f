"""Rank 0's output in a rehearsal: copied to its log and to the launcher's streams, its progress
marks turned into steps for the injector.

Apart from :mod:`hpc_ddp.rehearsal.local`, which starts and ends the ranks, because it runs in a
thread of its own that may outlive the launch (a child that still holds rank 0's pipe): everything
it touches is passed in. No torch.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from hpc_ddp.core.codes import PROGRESS_MARK

# where a rank's error starts
ERROR_LINE = re.compile(r"error: |Traceback |\[rank \d+\] [\d:]+ (ERROR|CRITICAL) ")
# rank 0's progress mark, wherever another thread's write put it in a line (a tee that read
# "... step 0[rank 0] ..." as a number died, and no injected stop fired)
MARK = re.compile(re.escape(PROGRESS_MARK) + r"(\d+)\n?")
# hpc_ddp's own log lines in a rank's output (rank/attempt/start.py's format): not the program's
OWN_LINE = re.compile(r"\[rank \d+\] [\d:]+ [A-Z]+ hpc_ddp[.:]")


def tee(source: IO[bytes], log_path: Path, stream: IO[str], err: IO[str],
        on_step: Callable[[int], None],
        progress: re.Pattern[str] | None = None, watch: dict[str, object] | None = None,
        quiet: threading.Event | None = None) -> None:
    """Copy rank 0's output to its log and to ``stream``; progress marks go to ``on_step`` instead.

    ``progress`` (``train.script_progress``) finds the step in an unmodified script's own lines.

    From rank 0's first error line on (``error: ...``, a traceback, an ERROR log record) its lines
    go to ``err``: errors reach stderr, and the launcher's summary need not print them again.

    Once ``quiet`` is set (the launch returned while a process that outlived rank 0 still held its
    pipe), lines go to the log only: ``stream`` and ``err`` may be closed by then (a test's captured
    output), and a write to them would raise in this thread.
    """
    erring = False
    with open(log_path, "ab") as log:
        for line in iter(source.readline, b""):
            text = line.decode(errors="replace")
            mark = MARK.search(text)
            if mark:
                on_step(int(mark.group(1)))
                # a line another thread's write landed in: the rest is the program's
                text = text[:mark.start()] + text[mark.end():]
                if not text.strip():
                    continue
                line = text.encode()
            found = progress.search(text) if progress is not None else None
            if found:
                on_step(int(found.group(1)))
            if watch is not None and text.strip() and not OWN_LINE.match(text):
                # rank 0's program's last line: says why an injected stop never fired (not a warning
                # of hpc_ddp's about it)
                watch["line"] = text.strip()
            log.write(line)
            log.flush()
            erring = erring or bool(ERROR_LINE.match(text))
            if quiet is not None and quiet.is_set():
                continue
            out = err if erring else stream
            try:
                out.write(text)
                out.flush()
            except (ValueError, OSError):  # closed under us: the log keeps every line
                pass
