"""The script's child process on a rank: started in its own session, the first stop forwarded to
it, a later stop reported, a hung one ended.

:func:`supervise` polls the child until it exits and returns its exit code; what that code means
for the attempt (a stop, a finish, a crash) is :mod:`hpc_ddp.rank.script.wrapper`'s, which calls
it once per attempt. Apart from it because this is only the process: no ledger, no run dir. It
logs as the script wrapper (``hpc_ddp.script``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from hpc_ddp.core.shutdown import die_with_parent
from hpc_ddp.core.stopping import StopFlag
from hpc_ddp.rank.script.outcome import IGNORED_HINT
from hpc_ddp.rank.script.output import Progress, start_relays

log = logging.getLogger("hpc_ddp.script")
POLL_S = 0.05
Later = Callable[[], None] | None  # on_later_stop: called once, then None


def supervise(cmd: list[str], environ: Mapping[str, str], flag: StopFlag,
              progress: Progress | None = None,
              on_later_stop: Later = None, hang_after_s: float | None = None,
              on_hang: Callable[[float], None] | None = None,
              before_forward: Callable[[], None] | None = None,
              on_poll: Callable[[], None] | None = None) -> int:
    """Run the child to its end, forwarding the first stop signal this process receives; its exit
    code.

    With ``progress`` (rank 0), the child's output comes through pipes and is read for progress
    lines. ``on_later_stop`` is called once if another stop signal arrives while the child still
    runs after the first: Slurm's SIGTERM at the time limit, which the worker does not outlive by
    more than KillWait. ``before_forward`` is called just before the first stop is forwarded (the
    peers' scripts may die of it before the signal reaches their workers). ``on_hang`` is called
    when the child, after its second progress line and before any stop, prints none for
    ``hang_after_s`` seconds (or 3 x its longest gap so far, if longer); the child's process group
    is then ended. ``on_poll`` is called at every poll (rank 0's
    :class:`~hpc_ddp.rank.script.publish.Publisher`).
    """
    pipe = subprocess.PIPE if progress is not None else None
    child = subprocess.Popen(cmd, env=dict(environ), start_new_session=True,
                             preexec_fn=die_with_parent,
                             stdout=pipe, stderr=pipe)
    relays = [] if progress is None else start_relays(
        [(child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer)],
        progress)  # type: ignore[list-item]
    seen, warned = 0, False
    while child.poll() is None:
        if on_poll is not None:
            on_poll()
        seen, on_later_stop = forward(child, flag, seen, progress, before_forward, on_later_stop)
        quiet = progress.quiet_for() if progress is not None and not seen else None
        if on_hang is not None and hang_after_s is not None and quiet is not None and \
                quiet > progress.hang_limit(hang_after_s):  # type: ignore[union-attr]
            on_hang(quiet)
            end_group(child)
            break
        if progress is not None and progress.ignored and not warned:
            warned = True
            warn_ignored(progress, flag)
        time.sleep(POLL_S)
    for relay in relays:
        relay.join(timeout=5)
    code = int(child.wait())
    # the stop came in the same poll as the script's exit: nothing to forward
    if flag.is_set and not seen:
        log.info("the script exited with code %s just before %s reached this rank (not forwarded: "
                 "it had ended)", code, signal.Signals(flag.signum or signal.SIGTERM).name)
    return code


def forward(child: subprocess.Popen[bytes], flag: StopFlag, seen: int, progress: Progress | None,
            before_forward: Callable[[], None] | None, on_later_stop: Later) -> tuple[int, Later]:
    """A stop signal received since the last poll: the first is forwarded to the child, a later one
    calls ``on_later_stop`` once. Returns the signals seen so far and ``on_later_stop`` (None once
    called)."""
    if flag.count > seen and flag.signum is not None:
        if not seen:
            log.info("forwarding %s to the script", signal.Signals(flag.signum).name)
            if before_forward is not None:
                before_forward()
            child.send_signal(flag.signum)
            if progress is not None:
                progress.stop_forwarded()
        elif on_later_stop is not None:
            on_later_stop()
            on_later_stop = None
        seen = flag.count
    return seen, on_later_stop


def warn_ignored(progress: Progress, flag: StopFlag) -> None:
    """Once: the script went on printing progress after the forwarded stop, so it did not act on
    it."""
    log.warning("%s, so it took no snapshot of its own at the signal; on a cluster it is killed at "
                "the time limit or the end of the grace period. %s", progress.went_on(
                    signal.Signals(flag.signum or signal.SIGTERM).name), IGNORED_HINT)


def end_group(child: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the child's process group (the script and what it started), SIGKILL what is left."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
