"""A slow node named (issue 60): each rank's busy time per step, carried by the boundary's agreement
once a window, and a node well above the others' for windows in a row named by rank 0.

Why busy time and not step time: in DDP every rank's step lasts as long as the slowest's (the
gradient all-reduce waits for it), so the host-side time between two boundaries is the same on
every rank. What differs is how long each rank's threads wanted a CPU: their time on one plus their
time waiting in a run queue for one (the kernel's ``/proc/self/task/*/schedstat``; a cgroup's
throttling counts as waiting). A fast rank spends the rest of its step asleep in the collective,
neither on a CPU nor queued for one; a rank on a slow node (a CPU capped or shared, a noisy
neighbour, a loop that needs more cores than it has) is busy the whole step. Read once a window:
a few dozen small procfs reads, no device sync, no file in the run dir.

What it cannot see: a slow GPU (the host waits for it asleep, on every rank alike), and a data
loader's worker processes (their time is theirs, not the rank's). A train.script has no boundary.

Rank 0 judges (:class:`Judge`): a node's figure is its ranks' mean, compared with the median of the
*other* nodes' (with two nodes, the median of all would halve the gap). A node named is said in the
log, the attempt's ledger line (``slow_nodes``), ``RUN_DIR/liveness/slow.json`` (``status`` of a
running job) and the metrics (``slow_node_x``, merged into the loop's next logged line: a line
of its own would add a step the loop never logged). With ``slurm.straggler.action: replace`` rank 0
also raises a flag of its own in the agreement (one more integer at every boundary): every rank
stops at the same boundary with a snapshot, the ledger line says ``slow`` and names the node
(``replace``), every rank exits :data:`hpc_ddp.core.codes.EXIT_SLOW`, and the batch shell goes on
without it (:func:`hpc_ddp.shell.heal.replaced`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rundir import layout

log = logging.getLogger("hpc_ddp.straggler")
MOST = 2**31 - 1  # the agreement's int32
# a node is slow only when what it adds is a part of the step that matters: a tenth of a
# millisecond more of a 20 ms step, 1.5 x the others', is noise, not a straggler
MATERIAL = 0.05


def thread_demand(task_dir: str = "/proc/self/task") -> dict[int, int]:
    """Each thread's nanoseconds on a CPU plus waiting in a run queue for one (the first two fields
    of its schedstat), by thread id; a thread that ended between the listing and its read is left
    out, and so is every thread where the kernel keeps no schedstat."""
    demand: dict[int, int] = {}
    try:
        entries = list(os.scandir(task_dir))
    except OSError:
        return demand
    for entry in entries:
        try:
            with open(os.path.join(entry.path, "schedstat"), "rb") as file:
                on_cpu, waiting = file.read().split()[:2]
            demand[int(entry.name)] = int(on_cpu) + int(waiting)
        except (OSError, ValueError):
            continue
    return demand


class Demand:
    """This process's busy nanoseconds since the last :meth:`take`: a thread begun since counts
    whole, one that ended takes its last part with it (a window's figure, not an account)."""

    def __init__(self, read: Callable[[], dict[int, int]] = thread_demand) -> None:
        self._read = read
        self._last = read()

    def take(self) -> int:
        now = self._read()
        spent = sum(ns - self._last.get(tid, 0) for tid, ns in now.items())
        self._last = now
        return max(0, spent)


@dataclass
class Slow:
    """A node named slow: how much busier per step than the others' median, since which step."""

    node: int
    host: str
    x: float
    since_step: int
    until_step: int | None = None  # when it was said to be well again
    kept: str | None = None  # with action replace: why it was not left out


def node_figures(per_rank: Sequence[int], local_size: int) -> dict[int, float]:
    """Each node's mean figure over its ranks (ranks are numbered node by node); a node with a rank
    that sent none (0: its first window, or no schedstat) is left out of this window."""
    figures: dict[int, float] = {}
    for node in range(len(per_rank) // max(1, local_size)):
        mine = per_rank[node * local_size:(node + 1) * local_size]
        if mine and all(value > 0 for value in mine):
            figures[node] = sum(mine) / len(mine)
    return figures


class Judge:
    """Rank 0's verdict, window by window; pure (the figures in, the messages out).

    Evidence is summed, not counted in a row (a cumulative sum, CUSUM): each window adds
    ``log(x / ratio)`` to the node's excess (``x``: its figure over the median of the other nodes'),
    at most ``log(ratio)`` (one window far above, an evaluation or a compile, is one window's
    worth), never below 0; a window whose extra is under :data:`MATERIAL` of the step adds nothing
    above 0. The node is named when its excess reaches ``windows x log(ratio)``: a node busy
    ``ratio**2`` x the others' after ``windows`` windows, one barely above ``ratio`` much later,
    one at or under it never. On the local cluster (2 cores shared by 4 ranks) a healthy node's
    10-step windows reach 1.7 x now and then, but its excess stayed under half the bar; a node
    capped at 70 % of its CPU ran at about 1.9 x and was named in about 40 steps (B17)."""

    def __init__(self, ratio: float, windows: int, hosts: Sequence[str]) -> None:
        self.ratio, self.windows, self.hosts = ratio, windows, list(hosts)
        self.excess: dict[int, float] = {}  # by node
        self.calm: dict[int, int] = {}  # of a named node: windows in a row with no excess
        self.named: dict[int, Slow] = {}

    @property
    def bar(self) -> float:
        """The excess that names a node."""
        return self.windows * math.log(self.ratio) - 1e-9

    def host(self, node: int) -> str:
        return self.hosts[node] if node < len(self.hosts) else f"node {node}"

    def observe(self, step: int, figures: Mapping[int, float], step_us: float) -> list[str]:
        """Messages for what changed at this window (``step_us``: its wall time per step): a node
        named slow, a named node well again."""
        said: list[str] = []
        if len(figures) < 2:
            return said
        most, bar = math.log(self.ratio), self.bar
        for node, figure in sorted(figures.items()):
            others = statistics.median(v for n, v in figures.items() if n != node)
            x = figure / others if others > 0 else 1.0
            added = min(most, math.log(x / self.ratio)) if x > 0 else -most
            if figure - others <= MATERIAL * step_us:
                added = min(0.0, added)
            excess = self.excess[node] = max(0.0, self.excess.get(node, 0.0) + added)
            named = self.named.get(node)
            if named is None or named.until_step is not None:
                if excess >= bar:
                    self.named[node] = Slow(node, self.host(node), round(x, 2), step)
                    self.calm[node] = 0
                    said.append(self._named(node, x, step))
                continue
            named.x = round(max(named.x, x), 2)
            self.calm[node] = self.calm.get(node, 0) + 1 if excess == 0 else 0
            if self.calm[node] >= self.windows:
                named.until_step = step
                said.append(f"node {node} ({named.host}) is no longer slow: {x:.2f} x the other "
                            f"nodes' median per step, no excess for {self.windows} windows to step "
                            f"{step}")
        return said

    def _named(self, node: int, x: float, step: int) -> str:
        return (f"node {node} ({self.host(node)}) is slow: its ranks are busy {x:.2f} x the other "
                f"nodes' median per step, above {self.ratio:g} x over the last windows to step "
                f"{step} (on a CPU "
                "or waiting for one: a CPU capped or shared, a noisy neighbour, a loop short of "
                "cores); every rank waits for it at each all-reduce. Look at that node, or leave "
                "it out of the next job (sbatch --exclude)")


class Pace:
    """One rank's part: its figure at the end of each window, in the agreement begun there; rank 0
    hears every rank's at the next boundary and judges."""

    def __init__(self, ratio: float, windows: int, window_steps: int, on: bool, env: DistEnv,
                 run_dir: Path, read: Callable[[], dict[int, int]] = thread_demand) -> None:
        self.env, self.run_dir, self.window = env, run_dir, window_steps
        on = on and env.num_nodes > 1 and env.world_size > 1
        self._demand = Demand(read) if on else None
        self._since: int | None = None  # the step of the last window's end
        self._at = time.monotonic()  # and when it was
        self._step_us = 0.0  # the last whole window's wall time per step
        self.judge = Judge(ratio, windows, env.nodelist) if on and env.is_main else None
        self.record: dict[str, Any] | None = None  # the attempt's ledger line (rank 0; session)
        self.due: dict[str, Any] = {}  # rank 0: metrics for the loop's next logged line
        # rank 0, set by the session: why a slow node cannot be replaced ("": it can; None: warn)
        self.replace: str | None = None
        self.replacing: Slow | None = None  # rank 0: the node it asked every rank to stop for
        self.agreed = False  # every rank: the stop to replace a slow node was agreed
        self.leave_out: list[str] = []  # rank 0: every host to leave out (a health check's sick)

    def figures(self, step: int) -> list[int]:
        """What this rank adds to the agreement begun at ``step``: whether rank 0 asks to stop to
        replace a slow node, then, at a window's end, a slot per rank with its own filled (busy µs
        per step since the last window's end). Every rank adds the same length at the same step
        (the boundary's step is the same on every rank)."""
        if self._demand is None:
            return []
        asked = [int(self.replacing is not None)]
        return asked if step % self.window else asked + self._slots(step)

    def _slots(self, step: int) -> list[int]:
        assert self._demand is not None
        spent, now = self._demand.take(), time.monotonic()
        (since, self._since), (at, self._at) = (self._since, step), (self._at, now)
        slots = [0] * self.env.world_size
        if since is not None and step > since:
            slots[self.env.rank] = max(1, min(MOST, spent // 1000 // (step - since)))
            self._step_us = (now - at) * 1e6 / (step - since)
        return slots

    def heard(self, step: int, values: Sequence[int]) -> None:
        """Every rank: whether the stop to replace a slow node was agreed; rank 0: every rank's
        figures of the window that ended a boundary before ``step``."""
        self.agreed = self.agreed or bool(values[:1] and values[0])
        values = values[1:]
        if self.judge is None or len(values) != self.env.world_size:
            return
        said = self.judge.observe(step, node_figures(values, self.env.local_world_size),
                                  self._step_us)
        for message in said:
            log.warning(message)
        if said:
            self._publish()
        self._ask_to_replace()

    def _ask_to_replace(self) -> None:
        """With action replace: a node named and still slow whose excess has reached twice the bar
        that named it (a costly act wants twice the evidence: a slow spell of a few windows is named
        and not acted on) is left out; the stop is asked for once an attempt, or why not is said
        once."""
        assert self.judge is not None
        slow = [n for n in self.judge.named.values() if n.until_step is None
                and self.judge.excess.get(n.node, 0.0) >= 2 * self.judge.bar]
        if self.replace is None or self.replacing is not None or not slow:
            return
        if self.replace:
            log.warning("slurm.straggler.action=replace: node %s (%s) is kept: %s", slow[0].node,
                        slow[0].host, self.replace)
            slow[0].kept, self.replace = self.replace, None  # said once, and in the ledger line
            self._publish()
            return
        self.replacing = slow[0]
        log.warning("slurm.straggler.action=replace: every rank stops at the next boundary with a "
                    "snapshot, and the job goes on without node %s (%s)", slow[0].node,
                    slow[0].host)

    def _publish(self) -> None:
        assert self.judge is not None
        slow = {named.host: asdict(named) for named in self.judge.named.values()}
        if self.record is not None:
            self.record["slow_nodes"] = slow
        env = self.env
        body = {"job_id": env.job_id, "restart_count": env.restart_count, "in_job": env.in_job,
                "time": round(time.time(), 3), "slow_nodes": slow}
        try:
            write_atomic(layout.slow_nodes(self.run_dir), json.dumps(body, indent=1))
        except OSError as err:  # a full disk or a gone folder costs the status line, not the run
            log.warning("could not write %s: %s", layout.slow_nodes(self.run_dir), err)
        now = [n for n in self.judge.named.values() if n.until_step is None]
        self.due = {"slow_node_x": max((n.x for n in now), default=1.0), "slow_nodes": len(now)}

    def metrics_due(self) -> dict[str, Any]:
        """Rank 0: what the next ``run.log_metrics`` line adds, once."""
        due, self.due = self.due, {}
        return due
