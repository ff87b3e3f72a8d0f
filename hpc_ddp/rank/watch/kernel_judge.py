"""A node's ranks as the kernel sees them: which one is stopped (a frozen rank), named by rank in
seconds, whatever it holds (issue 60).

A rank's own beats come from a thread of its Python process: a rank that holds the GIL in one long C
call (a large ``torch.save``, a compile, a loader's collate) cannot beat, and that is why
``dist.liveness_s`` is 30 s. The kernel's process table needs no GIL: a rank stopped by SIGSTOP is
in state ``T`` however busy it was, and a busy rank is never in it. So the node's watcher
(:mod:`hpc_ddp.rank.watch.node_watch`, a process of its own) looks at each rank of its node through
``/proc`` and this judge says when one is lost:

- **stopped** (``T``) for :data:`STOPPED_S` of the watcher's own watching: lost. A debugger's stop
  (``t``: gdb, py-spy dump) is someone looking at the rank, never a loss; ``scontrol suspend``
  stops the watcher too, and on resume the silence it could not watch is not counted (as
  :class:`hpc_ddp.rundir.beats.Judge` does), so the instant between its own SIGCONT and its ranks'
  is no loss.
- **exited** without a last beat that says ``left`` (killed, OOM): named at once in the log
  (:attr:`Look.gone`), and declared lost only after ``gone_s`` (``dist.liveness_s``, as its
  silent beats were before): on gloo its peers' sockets close and they fail at once with the cause,
  and the batch shell reads their offers for who raised
  (:func:`hpc_ddp.shell.shell_rules.raised_first`); a declaration is for peers that wait on (NCCL).
- a rank that said it ``left``, or has not beaten with its pid yet: not judged.

Pure: :meth:`KernelJudge.observe` is given what was read and the time. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_ddp.core.processes import Seen
from hpc_ddp.rundir.beats import Beat

# a rank stopped this long by the watcher's own clock is lost (a frozen rank: SIGSTOP)
STOPPED_S = 2.0


@dataclass
class Look:
    """What one look found: the ranks to declare (stopped, or gone, long enough), with the seconds
    each was, and the ranks whose process was newly found gone without leaving."""

    stopped: dict[int, float] = field(default_factory=dict)
    gone_long: dict[int, float] = field(default_factory=dict)
    gone: list[int] = field(default_factory=list)


@dataclass
class _Rank:
    pid: int
    started: int | None = None
    stopped_since: float | None = None
    gone_since: float | None = None


class KernelJudge:
    """One node watcher's view of its node's ranks, by its own monotonic clock."""

    def __init__(self, stopped_s: float = STOPPED_S, gone_s: float = 30.0,
                 stall_s: float = 1.0) -> None:
        self.stopped_s, self.gone_s = stopped_s, gone_s
        # a gap this long between two looks: the watcher was not watching (suspended, starved)
        self.stall_s = stall_s
        self.ranks: dict[int, _Rank] = {}
        self.looked_at: float | None = None

    def observe(self, beats: dict[int, Beat | None], seen: dict[int, Seen | None],
                now: float) -> Look:
        """One look: ``beats`` by rank (its last beat on the node), ``seen`` by pid (the kernel's
        answer for each beat's pid)."""
        stalled = self.looked_at is not None and now - self.looked_at > self.stall_s
        self.looked_at = now
        look = Look()
        for rank, beat in sorted(beats.items()):
            if beat is None or beat.pid is None or beat.left:
                self.ranks.pop(rank, None)
                continue
            known = self.ranks.get(rank)
            if known is None or known.pid != beat.pid:
                known = self.ranks[rank] = _Rank(beat.pid)
            process = seen.get(beat.pid)
            if known.started is None and process is not None:
                known.started = process.started
            if process is None or process.exited or process.started != known.started:
                if known.gone_since is None:
                    known.gone_since = now
                    look.gone.append(rank)
                elif now - known.gone_since >= self.gone_s:
                    look.gone_long[rank] = now - known.gone_since
                continue
            if not process.stopped:
                known.stopped_since = None
            elif known.stopped_since is None or stalled:
                known.stopped_since = now
            elif now - known.stopped_since >= self.stopped_s:
                look.stopped[rank] = now - known.stopped_since
        return look
