"""What the local rehearsal injects: stop signals at chosen steps, a lost node (``--fail-at``), a
frozen node (``--freeze-at``); and why an injection never fired. The launcher
(:mod:`hpc_ddp.rehearsal.local`) calls
:func:`injector`'s function with each step rank 0 reports. No torch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

# (step, which node's ranks) of --fail-at, --freeze-at
Injection = tuple[int, Callable[[], tuple[str, list[int]]]]

# fault injection: rank 0 gets an injected stop at most this late
SIGNAL_SKEW_VAR = "HPC_DDP_LOCAL_SIGNAL_SKEW_S"
WATCHER = "hpc_ddp.rank.watch.node_watch"  # a node's watcher's module, in its command line
# fault injection: --fail-at's SIGKILL lands this long after the step
KILL_DELAY_VAR = "HPC_DDP_LOCAL_KILL_DELAY_S"
# --fail-at's ranks kill themselves after their step; the launcher's SIGKILL follows this late
BACKSTOP_S = 5.0


def injector(procs: list[subprocess.Popen[bytes]], events: list[tuple[int, int]],
             err: IO[str], watch: dict[str, object] | None = None,
             kills: list[Injection] | None = None,
             skew_s: float = 0.0, freezes: list[Injection] | None = None,
             frozen: list[int] | None = None, kill_delay_s: float = 0.0,
             self_kill: bool = False) -> Callable[[int], None]:
    """Send each (step, signal) event to every rank once rank 0 has finished that step (0: started);
    each (step, kill) of ``kills`` SIGKILLs the ranks of the node that ``kill()`` names
    (``--fail-at``); each of ``freezes`` SIGSTOPs them and what they started (``--freeze-at``),
    noting their ranks in ``frozen``.

    ``skew_s`` > 0 signals the other ranks first and rank 0 once the processes rank 0 started (its
    wrapped script) have ended and it has reaped them, at most ``skew_s`` later, as a cluster's
    signal reaches its nodes apart and a script dies of its peer's first (a test of the race it
    opens; ``HPC_DDP_LOCAL_SIGNAL_SKEW_S``). A fixed delay lost that race on a loaded machine, where
    the script could take longer than the delay to die.

    ``self_kill``: the lost node's ranks kill themselves right after their own boundary of the step
    (``HPC_DDP_LOCAL_DIE_AT``), so what they send there has left, and rank 0 may be a few
    milliseconds ahead of them without the kill landing inside their step; the launcher's SIGKILL is
    a backstop, ``BACKSTOP_S`` later. ``kill_delay_s`` (B11's random points,
    ``HPC_DDP_LOCAL_KILL_DELAY_S``) kills from the launcher that long after rank 0 reported the
    step."""
    def on_step(step: int) -> None:
        if watch is not None:
            # the furthest, across healed job steps
            watch["step"] = max(step, int(watch.get("step") or 0))
        _lose_nodes(step, procs, kills, err, watch, self_kill=self_kill, kill_delay_s=kill_delay_s)
        _freeze_nodes(step, procs, freezes, err, frozen)
        _send_stops(step, procs, events, err, skew_s)
    return on_step


def _lose_nodes(step: int, procs: list[subprocess.Popen[bytes]], kills: list[Injection] | None,
                err: IO[str], watch: dict[str, object] | None, *, self_kill: bool,
                kill_delay_s: float) -> None:
    """``--fail-at``: SIGKILL the ranks of each node whose step rank 0 has reached (see
    :func:`injector`)."""
    while kills and step >= kills[0][0]:
        at, kill = kills.pop(0)
        node, ranks = kill()
        how = f"SIGKILL to its {ranks_text(ranks)}" + (
            f" right after their own step {at}" if self_kill else f" {kill_delay_s:.3f} s later"
            if kill_delay_s
            else "")
        err.write(f"[local] rank 0 reached step {step}: losing {node} (--fail-at {at}): {how}\n")
        if watch is not None:
            watch["lost"] = (node, ranks)
        if kill_delay_s or self_kill:  # the rank 0 reader thread must not wait
            threading.Timer(BACKSTOP_S if self_kill else kill_delay_s, _kill,
                            args=(procs, ranks)).start()
        else:
            _kill(procs, ranks)


def _freeze_nodes(step: int, procs: list[subprocess.Popen[bytes]],
                  freezes: list[Injection] | None, err: IO[str],
                  frozen: list[int] | None) -> None:
    """``--freeze-at``: SIGSTOP the ranks of each node whose step rank 0 has reached, and what
    they started, noting them in ``frozen``."""
    while freezes and step >= freezes[0][0]:
        at, freeze = freezes.pop(0)
        node, ranks = freeze()
        err.write(f"[local] rank 0 reached step {step}: freezing {node} (--freeze-at {at}): "
                  "SIGSTOP to its "
                  f"{ranks_text(ranks)} and their children\n")
        for rank in ranks:
            if procs[rank].poll() is None:
                _freeze(procs[rank].pid)
        if frozen is not None:
            frozen.extend(ranks)


def _send_stops(step: int, procs: list[subprocess.Popen[bytes]], events: list[tuple[int, int]],
                err: IO[str], skew_s: float) -> None:
    """The injected stop signals whose step rank 0 has reached, to every rank (rank 0 last with
    ``skew_s``: see :func:`injector`)."""
    while events and step >= events[0][0]:
        at, signum = events.pop(0)
        err.write(f"[local] rank 0 reached step {step}: sending {signal.Signals(signum).name} "
                  "to every rank "
                  f"(injected at {at})\n")
        started = _children(procs[0].pid) if skew_s > 0 else []
        for proc in procs[1:] if skew_s > 0 else procs:
            _signal(proc, signum)
        if skew_s > 0:
            _until_they_end(procs[0], started, skew_s)
            _signal(procs[0], signum)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started itself (a wrapped script, a forkserver), but its node's watcher
    (:mod:`hpc_ddp.rank.watch.node_watch`, which ends with the rank, not with its script)."""
    return [member for member in family(pid) if member != pid and _parent(member) == pid
            and not _watcher(member)]


def _watcher(pid: int) -> bool:
    try:
        return WATCHER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _until_they_end(proc: subprocess.Popen[bytes], children: list[int], limit_s: float) -> None:
    """Wait, at most ``limit_s``, until ``proc`` has ended or ``children`` are gone: reaped, so
    ``proc`` has seen its script end (a zombie's parent has not yet)."""
    deadline = time.monotonic() + limit_s
    while children and proc.poll() is None and time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in children):
            return
        time.sleep(0.02)


def _kill(procs: list[subprocess.Popen[bytes]], ranks: list[int]) -> None:
    for rank in ranks:
        if procs[rank].poll() is None:
            os.killpg(procs[rank].pid, signal.SIGKILL)


def family(pid: int) -> list[int]:
    """A rank and every process it started, children first (a script runs in a session of its own, a
    forkserver's loader workers are its grandchildren): what Slurm's process tracking signals on a
    node. One pass over /proc/*/stat (the parent of every process), so the signal follows rank 0's
    step closely."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(parent, []).append(int(stat.parent.name))
    members, at = [pid], 0
    while at < len(members):
        members.extend(child for child in parents.get(members[at], []) if child not in members)
        at += 1
    return members[::-1]


def signal_family(pid: int, signum: int) -> None:
    """``signum`` to a rank's process group and every process it started, as Slurm signals every
    process of a step (DataLoader workers included), not the rank alone."""
    # once each: a second SIGTERM means something to a wrapped script's worker
    for member in family(pid):
        try:
            os.kill(member, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _freeze(pid: int) -> None:
    """SIGSTOP a rank and everything it started, as a frozen node stops everything on it at once;
    SIGKILL still ends them when the step ends."""
    signal_family(pid, signal.SIGSTOP)


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    if proc.poll() is None:
        signal_family(proc.pid, signum)


def ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def node_ranks(training: Sequence[str], tasks_per_node: int,
               node: int | None) -> tuple[str, list[int]]:
    """A training node (its index; None: the last one) and its ranks."""
    index = len(training) - 1 if node is None else min(node, len(training) - 1)
    return training[index], list(range(index * tasks_per_node, (index + 1) * tasks_per_node))


def freeze_problem(freeze_at: Sequence[tuple[int, int | None]], nodes: int) -> str | None:
    """Why a --freeze-at names a node the rehearsal does not train on (None: it is fine)."""
    for step, node in freeze_at:
        if node is not None and node >= nodes:
            return (f"--freeze-at {step}:{node} names training node {node}, but the rehearsal "
                    f"trains on {nodes} "
                    f"node(s), numbered 0..{nodes - 1}. HINT: --freeze-at {step}:{nodes - 1}, or "
                    f"--freeze-at {step} "
                    "for the last one")
    return None


def unfired(events: list[tuple[int, int]], watch: Mapping[str, object],
            progress: re.Pattern[str] | None,
            kills: Sequence[int] = (), freezes: Sequence[int] = ()) -> str:
    """Why the injected stops left in ``events`` never fired, naming each flag: the rehearsal did
    not happen."""
    flags = ", ".join([f"{'--preempt-at' if signum == signal.SIGTERM else '--timeout-at'} {step}"
                       for step, signum in events] + [f"--fail-at {step}" for step in kills]
                      + [f"--freeze-at {step}" for step in freezes])
    step = watch.get("step")
    if progress is not None and not step:
        why = (f"no line of rank 0's output matched train.script_progress ({progress.pattern!r}), "
               "so the "
               "rehearsal never learned the script's step; its last line was "
               f"{watch.get('line')!r}. HINT: set "
               "train.script_progress to a regex whose first group is the step in that line")
    elif not step:
        why = ("rank 0 reported no step after the start: a loop reports its step in "
               "run.boundary(step), which is "
               "also where it acts on a stop. HINT: call `if run.boundary(step): return` after "
               "every optimizer step")
    else:
        why = f"the run finished at step {step} first. HINT: choose steps below the run's last step"
    what = "stop" if events else "failure"
    return f"error: {flags} never fired: {why}. The run finished, but the {what} was not rehearsed."
