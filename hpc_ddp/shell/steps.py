"""One job step of the batch shell: what it was, running it with srun, and what srun said of it.

srun's own stderr lines name the node whose task died first (``srun: error: n2: task 3:
Killed``) or the node that was lost, so they are relayed to the shell's log and kept for
the healer. A step that starts inside Slurm's one-time warning window gets the warning
from here (srun forwards the signal to every task). No torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Step:
    """One step of the job: the nodes it ran on, how it ended and what srun said."""

    nodes: list[str]
    index: int = 0  # the in-job restart it is (0: the job's first step)
    code: int = 0
    srun_lines: list[str] = field(default_factory=list)
    start: float | None = None  # when the batch shell started it (None: submitit's own step)
    # how it came to be (an in-job restart), for its ledger line
    healed: dict[str, Any] | None = None
    # when the batch shell saw it end (srun returned): "detected" in a heal's timeline
    ended: float | None = None
    # the batch shell's part of its timeline (hpc_ddp.core.timeline.encode_shell), as its ranks got
    # it
    times: str = ""


Srun = Callable[[Sequence[str], Mapping[str, str], "float | None"], tuple[int, list[str]]]
# given srun's lines so far and whether it still runs, why the shell stops waiting for it, or None
# once it ended (:func:`hpc_ddp.shell.lost_wait.watch`)
Until = Callable[[Callable[[], list[str]], Callable[[], bool]], "str | None"]


def run_srun(argv: Sequence[str], environ: Mapping[str, str], warn_in: float | None = None,
             warning: int = signal.SIGUSR2, until: Until | None = None) -> tuple[int, list[str]]:
    """Run a step; srun's stderr is relayed line by line (it names the failed task's node) and kept.
    With ``warn_in``, srun gets the stop warning that many seconds from now (srun forwards it to
    every task). With ``until``, a side thread may end the wait: srun is killed once it says why
    (the tasks srun still waits for are on nodes the survivors declared lost), and the code is
    137, as the shell's ``$?`` would be."""
    proc = subprocess.Popen(list(argv), env=dict(environ), stderr=subprocess.PIPE, text=True,
                            errors="replace")
    timer = None
    if warn_in is not None:
        timer = threading.Timer(warn_in, lambda: proc.poll() is None and proc.send_signal(warning))
        timer.daemon = True
        timer.start()
    lines: list[str] = []
    ended: list[str] = []  # why the shell ended srun, if it did
    if until is not None:
        threading.Thread(target=_end_when, args=(until, proc, lines, ended), daemon=True,
                         name="hpc_ddp-lost-wait").start()
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.startswith("srun:"):
            lines.append(line.rstrip("\n"))
    code = proc.wait()
    if timer is not None:
        timer.cancel()
    return (137 if ended else code), lines


def _end_when(until: Until, proc: subprocess.Popen[str], lines: list[str],
              ended: list[str]) -> None:
    why = until(lambda: list(lines), lambda: proc.poll() is None)
    if why and proc.poll() is None:
        print(f"hpc_ddp.supervise: {why}", file=sys.stderr, flush=True)
        ended.append(why)
        proc.kill()


def tail_of(path: Path, nbytes: int) -> bytes | None:
    """The last ``nbytes`` of a file that grows with the job (a log, metrics.jsonl), or None when it
    cannot be read; its first line may be cut."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read()
    except OSError:
        return None


def srun_lines_before(stderr: Path, marker: str = "hpc_ddp.supervise:",
                      tail_bytes: int = 1 << 16) -> list[str]:
    """srun's own lines in this shell's stderr file since the last supervise line: what srun said of
    the step submitit ran before handing over (its srun writes there; a requeued job appends to the
    same file)."""
    tail = tail_of(stderr, tail_bytes)
    if tail is None:
        return []
    lines = tail.decode(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.startswith(marker)), default=-1)
    return [line for line in lines[last + 1:] if line.startswith("srun:")]
