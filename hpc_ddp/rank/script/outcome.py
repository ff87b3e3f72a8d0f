"""How an attempt of a ``train.script`` ended, judged by what the script and the other ranks did.

The worker sees only its child's exit code, the stop signals it got, rank 0's progress
lines and what the other ranks left in the run dir. From those: a crash on another rank
(its marker in ``RUN_DIR/errors/``) is a failure, not the stop it looks like here; a
script that went on after the stop and exited 0 ran to its end; a later stop signal while
it still runs is Slurm ending the job, so rank 0 records the attempt at once; a script
that went quiet for ``dist.timeout_s`` is hung. Rank 0 writes the ledger line; the other
ranks wait for it (:func:`wait_for_ledger`). No torch.

The marks (a rank's crash, the stop it forwarded) live on a shared filesystem, which on NFS
caches directory listings and failed lookups for up to ``acdirmax`` (30-60 s): a mark found by
listing the directory, or by looking up a name that did not exist a moment ago, may be missed
(a stop read as a crash, or a crash as a stop). So no mark is ever found by a listing or needs a
new name to appear: each rank creates its own mark files, empty, when its attempt starts
(:func:`prepare_marks`); a mark is written into that file in place, and peers read every rank's
file by its known name (the world size is known). ``open()`` revalidates the file (close-to-open
consistency), so a reader sees the content its writer closed.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.core.stopping import term_reason
from hpc_ddp.rundir.ledger import attempt_key, crash_marker, read_attempts
from hpc_ddp.core.slurm_jobs import job_fields, job_spec
from hpc_ddp.rank.script.output import Progress
from hpc_ddp.rank.attempt.context import Attempt
from hpc_ddp.rank.attempt.conclude import conclude, ledger_line
from hpc_ddp.core.codes import EXIT_HUNG

log = logging.getLogger("hpc_ddp.script")

# how long a stopped rank looks for another rank's crash marker (a shared filesystem's lag)
CRASH_WAIT_S = 1.0
STOP_SKEW_S = 5.0  # how long a rank whose script died after a peer's stop waits for its own signal
IGNORED_HINT = ("HINT: on the signal, save and exit (docs/own-loop.md, tier 2), or raise "
                "slurm.signal_delay_s if "
                "the script saves only at an epoch end; after saving on a stop, exit non-zero: "
                "exit 0 after a "
                "signal that was not acted on means the script ran to its end")



def wait_for_ledger(attempt: Attempt, timeout_s: float = 60.0) -> dict[str, Any] | None:
    """A stopped rank other than 0 leaves only once rank 0 has recorded the attempt (and requeued).

    There is no process group among the workers of a script (the script has its own), so
    no closing barrier: without this wait, the first rank to exit with EXIT_REQUEUE would
    make srun's --kill-on-bad-exit end rank 0 while it writes the ledger. Returns rank 0's line
    (it may say ``finished``: the scripts ignored the signal and ran to their end), or None.
    """
    deadline = time.monotonic() + timeout_s
    env = attempt.env
    mine = (env.job_id, env.restart_count, env.in_job)
    while time.monotonic() < deadline:
        for line in read_attempts(attempt.run_dir):
            if attempt_key(line) == mine:
                return line
        time.sleep(0.2)
    return None


MARK_KINDS = ("crash", "stop")


def _marker(attempt: Attempt, kind: str, rank: int) -> Path:
    """This attempt's ``kind`` mark of ``rank``."""
    env = attempt.env
    return crash_marker(attempt.run_dir, env.job_id, env.restart_count, env.in_job, rank, kind)


def prepare_marks(attempt: Attempt) -> None:
    """Before the script starts: this rank's mark files, created empty, so that marking later writes
    into a name that has existed since the attempt began (a peer never waits for a new name to show
    up on NFS)."""
    for kind in MARK_KINDS:
        marker = _marker(attempt, kind, attempt.env.rank)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o666))
        except OSError:
            # an unwritable run dir: _mark fails the same way, and peers judge by their own signals
            pass


def _mark(attempt: Attempt, kind: str, text: str) -> None:
    """Write this rank's mark into its file in place (same inode, no rename): a reader's open() sees
    it whole once it is closed; a reader that comes before sees an empty file, which is no mark."""
    marker = _marker(attempt, kind, attempt.env.rank)
    data = (text.rstrip("\n") + "\n").encode()
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            os.write(fd, data)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        # an unwritable run dir: the error is printed all the same, and peers judge by their own
        # signals
        pass


def read_mark(path: Path) -> str | None:
    """A mark's text, read by name; None when the file is missing, empty or not yet whole (no final
    newline)."""
    try:
        text = path.read_text()
    except (OSError, ValueError):
        return None
    return text.strip() if text.endswith("\n") and text.strip() else None


def _marked(attempt: Attempt, kind: str, first: bool = False) -> list[str]:
    """The ``kind`` marks of every rank of this attempt (``first``: stop at the first one found),
    read by name, rank by rank, never by listing the directory (see the module's docstring)."""
    found = []
    for rank in range(attempt.env.world_size):
        text = read_mark(_marker(attempt, kind, rank))
        if text is not None:
            found.append(text)
            if first:
                break
    return found


def mark_crash(attempt: Attempt, path: Path, code: int) -> None:
    """Before this worker exits 1 (and srun ends the other tasks): say which rank's script
    crashed."""
    _mark(attempt, "crash", f"train.script {path} exited with code {code} on rank "
                            f"{attempt.env.rank}")


def mark_stop(attempt: Attempt, signum: int | None = None) -> None:
    """Before this worker forwards a stop to its script (or once its script died of one, ``signum``,
    which Slurm sent it directly): say so, for a peer whose script dies of it first."""
    if signum is not None:
        _mark(attempt, "stop", f"rank {attempt.env.rank}'s script died of "
                               f"{signal.Signals(signum).name}")
        return
    _mark(attempt, "stop", f"rank {attempt.env.rank} forwarded "
                           f"{signal.Signals(attempt.flag.signum or 15).name}")


def stopped_late(attempt: Attempt, code: int, wait_s: float = STOP_SKEW_S) -> bool:
    """After the script exited ``code`` != 0 with no stop signal here: is this a stop that has not
    arrived yet?

    A stop reaches the nodes (and, under torchrun, each node's workers) some milliseconds apart. An
    unmodified script dies of the forwarded signal on the rank it reached first, and its peers'
    scripts die of the broken collective before the signal reaches them. Judged at once, such a rank
    recorded a crash and the stop became a failure and an in-job restart (seen in CI, the torchrun
    template). A rank that forwards a stop marks it first (:func:`mark_stop`), so a peer's marker is
    there before this script died; with one, this rank waits up to ``wait_s`` for its own signal. A
    crash (no marker) pays nothing.
    """
    if not _marked(attempt, "stop", first=True):
        return False
    deadline = time.monotonic() + wait_s
    while not attempt.flag.is_set and time.monotonic() < deadline:
        time.sleep(0.05)
    if attempt.flag.is_set:
        log.info("the script exited with code %s just before %s reached this rank: another rank's "
                 "script was "
                 "ended by the stop first; this is a stop, not a crash", code,
                 signal.Signals(attempt.flag.signum or signal.SIGTERM).name)
    return attempt.flag.is_set


def crashes(attempt: Attempt, wait_s: float = CRASH_WAIT_S) -> list[str]:
    """What another rank's crash mark of this attempt says (the first found); waits up to ``wait_s``
    for one.

    Each pass opens one file per rank: the passes are spaced by the world size (0.1 s up to 500
    ranks), so that a large job's ranks do not flood the shared filesystem when they all look at
    once."""
    deadline, pause = time.monotonic() + wait_s, max(0.1, attempt.env.world_size / 5000)
    while True:
        found = _marked(attempt, "crash", first=True)
        left = deadline - time.monotonic()
        if found or left <= 0:
            return found
        time.sleep(min(pause, left))


def record_crash(attempt: Attempt, crashed: list[str]) -> int:
    """The attempt failed on another rank: rank 0 writes the one ``failed`` line (the settle step
    caps and requeues it by slurm.max_failures); nobody requeues it as a stop."""
    if attempt.env.is_main:
        ledger_line(attempt, "failed", exit_code=1,
                    message=f"{crashed[0]}; the other ranks were ended by the job step")
    log.error("%s: this rank's script was ended because of it; the attempt is a failure "
              "(slurm.max_failures), "
              "not a stop", crashed[0])
    return 1


def later_stop(attempt: Attempt, progress: Progress | None,
               outcome: dict[str, int]) -> Callable[[], None]:
    """On a cluster: a second stop signal while the script still runs after the first one was
    forwarded means Slurm is ending the job (the time limit's SIGTERM; KillWait later, SIGKILL).
    Rank 0 records the attempt now, saying that the script did not act on the stop, and requeues it
    within the caps: a script that also saves on its own (every N steps) goes on from there."""
    def record() -> None:
        flag = attempt.flag
        first, now = signal.Signals(flag.signum
                                    or signal.SIGTERM).name, signal.Signals(flag.last or 15).name
        went = progress.went_on(first) if progress is not None and progress.ignored else \
            f"the script did not act on {first}"
        waited = time.time() - (flag.received_at or time.time())
        note = (f"{went}; it was still running when {now} came {waited:.0f} s later, and Slurm "
                "kills it with "
                "nothing saved since its own last checkpoint")
        attempt.record.update(stop_ignored=first, note=note, end=round(time.time(), 3),
                              **({"last_step": progress.step} if progress is not None
                                 and progress.step else {}))
        log.error("%s. %s", note, IGNORED_HINT)
        if flag.last == signal.SIGTERM and _cancelled_now(attempt):
            ledger_line(attempt, "cancelled")
            outcome["code"] = 0
        else:
            outcome["code"] = conclude(attempt, stopped=True, step=None)
    return record


def _cancelled_now(attempt: Attempt) -> bool:
    """The later SIGTERM is scancel's (never requeue), not the time limit's nor the end of a
    preemption's grace time: all three leave the job COMPLETING (measured on 22.05); Slurm's fields
    tell them apart."""
    return term_reason(job_fields(job_spec(attempt.environ)),
                       attempt.env.restart_count) == "cancelled"


def hung(attempt: Attempt, progress: Progress, outcome: dict[str, int]) -> Callable[[float], None]:
    """Rank 0's script printed no progress line for dist.timeout_s: record ``hung`` (requeued within
    slurm.max_failures by the settle step, as any hang) before the worker ends the script."""
    def record(quiet: float) -> None:
        limit = progress.hang_limit(attempt.cfg.dist.timeout_s)
        bound = (f"dist.timeout_s={attempt.cfg.dist.timeout_s}"
                 if limit == attempt.cfg.dist.timeout_s
                 else f"3 x its longest gap between progress lines ({progress.longest_gap:.0f} s)")
        message = (f"train.script printed no progress line (train.script_progress) for {quiet:.0f} "
                   "s, more than "
                   f"{bound}; its last was {progress.line!r}")
        attempt.record.update(end=round(time.time(), 3), last_step=progress.step)
        ledger_line(attempt, "hung", message=message)
        log.error("%s: the script is taken to be hung (a deadlocked collective, a stuck data "
                  "loader) and is "
                  "ended.\nHINT: if it goes quiet this long on purpose (an evaluation, a "
                  "checkpoint), raise "
                  "dist.timeout_s", message)
        outcome["code"] = EXIT_HUNG
    return record


def ran_to_its_end(attempt: Attempt, progress: Progress | None, code: int) -> bool:
    """The script went on after the stop it was sent and exited 0: it finished, it did not stop."""
    if code != 0 or progress is None or not progress.ignored:
        return False
    first = signal.Signals(attempt.flag.signum or signal.SIGTERM).name
    note = f"{progress.went_on(first)} and exited 0: recorded as finished, not as a stop"
    attempt.record.update(stop_ignored=first, note=note)
    log.warning("%s. %s", note, IGNORED_HINT)
    return True


EARLY_S = 5.0  # a script that exits 0 this soon, with no progress line, most likely did not train


def exited_early(attempt: Attempt, progress: Progress | None, ran_s: float) -> str | None:
    """Rank 0, after the script exited 0: a warning when it may have exited early rather than
    trained (an unmodified minGPT prints "Unable to locate sufficient 2 gpus ... Exiting." and exits
    0): no progress line matching ``train.script_progress`` when that is set, else none at all
    within :data:`EARLY_S`. Still a finished run (the script said it was done); the note goes into
    the ledger line, which status shows."""
    pattern = attempt.cfg.train.script_progress
    if progress is None or progress.lines or (not pattern and ran_s >= EARLY_S):
        return None
    said = (f"its last output line: {progress.last_output!r}" if progress.last_output
            else "it printed nothing")
    why = (f"printed no line matching train.script_progress={pattern!r}" if pattern
           else f"ended after {ran_s:.1f} s")
    note = f"train.script exited 0 but {why}: it may have exited early, without training ({said})"
    attempt.record["note"] = "; ".join(filter(None, [attempt.record.get("note"), note]))
    log.warning("%s. HINT: check its output above; hpc_ddp records the run as finished because the "
                "script "
                "exited 0", note)
    return note
