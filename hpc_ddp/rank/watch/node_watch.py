"""The node's watcher: one small process per node that beats for the node and watches its ranks
through the kernel, so that neither needs a rank's GIL (issue 60).

The node's first rank starts it (:func:`spawn`) when its liveness starts, and it ends with the
node's part of the attempt (the first rank's last beat says ``left``, or no rank of the node is
left alive). It imports no torch and holds no GIL of a rank's, so:

- **The node's beat** (``RUN_DIR/liveness/node-N.json``) comes from here, every period: a first rank
  that holds the GIL in one long C call, or was killed by the OOM killer, no longer makes the next
  node declare this whole, healthy node lost. The first rank's thread writes it only while this
  process is not on duty (not started, could not start, died, or stopped: ``watcher_marker``).
- **The next node's beat** is watched from here (:class:`NextNode`), and a node silent for
  ``dist.liveness_s`` is declared lost with every rank on it, as the first rank's thread did; and
  **over the training network** (:mod:`hpc_ddp.rank.watch.net_beat`): pinged every tick, a node
  that stops answering for 3 s is lost (a partition, a frozen or powered-off node; a node that
  finds its own link down declares itself), and one whose run-dir beats are late while it answers
  is not (a slow file server).
- **Its node's ranks** are watched through ``/proc`` every :data:`TICK_S`
  (:class:`hpc_ddp.rank.watch.kernel_judge.KernelJudge`): a rank stopped by SIGSTOP for
  :data:`hpc_ddp.rank.watch.kernel_judge.STOPPED_S` is declared lost and named by rank, where its
  beats alone took ``dist.liveness_s`` (30 s); a rank whose process is gone without leaving is
  named in the log.

A declaration goes where a rank's goes (:class:`hpc_ddp.rank.watch.declaration.Board`): the node's
ranks hear this node's relay within a tick, the others through the run dir's ``declared.json``.
It ignores the stop signals sent to a step's processes (SIGTERM, SIGUSR1, ...): it ends with its
ranks, and SIGKILL with the step."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.core import processes
from hpc_ddp.rank.watch import declaration
from hpc_ddp.rank.watch.kernel_judge import STOPPED_S, KernelJudge
from hpc_ddp.rank.watch import net_beat
from hpc_ddp.rank.watch.net_beat import NET_SILENT_S
from hpc_ddp.rank.watch.next_node import NextNode
from hpc_ddp.rank.watch.watcher_marker import marker
from hpc_ddp.rundir import lost
from hpc_ddp.rundir import beats
from hpc_ddp.rundir.beats import Beat

log = logging.getLogger("hpc_ddp.liveness")
TICK_S = 0.5  # how often the kernel view and the node's relay are looked at (node-local reads)
IGNORED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGTSTP")


@dataclass(frozen=True)
class Plan:
    """What the watcher of one node needs, from its first rank (passed as JSON on argv)."""

    run_dir: str
    ids: tuple[Any, int, int]  # job id, restart count, in-job attempt
    tag: str
    local_tag: str
    folder: str  # the node's folder on node-local storage
    node: int
    nodes: int
    first_rank: int
    local_size: int
    host: str
    liveness_s: float
    period_s: float
    stopped_s: float = STOPPED_S
    toward: str = "127.0.0.1"  # MASTER_ADDR: the net beat goes from the address that reaches it
    net_silent_s: float = NET_SILENT_S


class NodeWatch:
    """The watcher's state and one tick of its work; the clocks and ``/proc`` are seams."""

    def __init__(self, plan: Plan, clock: Any = time.monotonic, wall: Any = time.time,
                 proc: Path = Path("/proc")) -> None:
        self.plan, self.clock, self.wall, self.proc = plan, clock, wall, proc
        self.folder, self.run_dir = Path(plan.folder), Path(plan.run_dir)
        self.board = declaration.Board(self.run_dir, plan.ids, plan.tag, self.folder,
                                       plan.local_tag)
        self.kernel = KernelJudge(plan.stopped_s, plan.liveness_s, stall_s=max(1.0, 2 * TICK_S))
        self.next_node = NextNode(self.run_dir, plan.tag, plan.node, plan.nodes, plan.liveness_s,
                                  handed=(self.folder, plan.local_tag))
        self.on_node = set(range(plan.first_rank, plan.first_rank + plan.local_size))
        self.count, self.beaten_at, self.done = 0, None, False
        # a declaration is out: the step ends; pings are still answered, nothing more is judged
        self.quiet, self.warned, self.cut, self.found_any = False, False, False, False
        self.cut_at = 0.0  # when this node's own link went down
        self.net = net_beat.start(plan.local_tag, plan.tag, plan.node, plan.toward,
                                  plan.net_silent_s)

    def tick(self) -> None:
        """One look at the node's ranks; the node's beat and the next node every period."""
        now = self.clock()
        local = {}
        for i in range(self.plan.local_size):
            local[i] = beats.read(beats.local_beat(self.folder, i), self.plan.local_tag, own=True)
        found = {b.rank: b for b in local.values() if b is not None}
        if not found and self.found_any:
            self.done = True  # the node's folder went with the step: nothing is left to watch
            return
        self.found_any = self.found_any or bool(found)
        if len(found) == self.plan.local_size:
            self.on_node = set(found)
        leader = local.get(0)
        seen = {b.pid: processes.seen(b.pid, self.proc) for b in found.values()
                if b.pid is not None}
        alive = [b for b in found.values() if not b.left and (s := seen.get(b.pid)) is not None
                 and not s.exited]
        if leader is not None and leader.left or found and not alive:
            self._beat(left=True)
            self.done = True
            return
        self.quiet = self.quiet or self._heard()
        if self.net is not None:
            self._look_at_link(now)
            self.net.tick(self.next_node.peer, None if self.quiet else self.next_node.endpoint(),
                          now)
        if self.quiet:
            self._period(now, judge=False)
            return
        look = self.kernel.observe(found, seen, now)
        for rank in look.gone:
            log.warning("node %d's watcher: rank %d's process (pid %s) is gone without saying it "
                        "left (killed: the OOM killer, a signal?)", self.plan.node, rank,
                        found[rank].pid)
        if look.stopped or look.gone_long:
            self._declare_stopped(look.stopped, look.gone_long, found)
            return
        if not self._net_lost(now):
            self._period(now, judge=True)

    def _period(self, now: float, judge: bool) -> None:
        """Every period: the node's beat, and (``judge``) the next node's in the run dir."""
        if self.beaten_at is not None and now - self.beaten_at < self.plan.period_s:
            return
        self.beaten_at = now
        self._beat(left=False)
        lost = self.next_node.look(now) if judge else None
        if lost is None:
            self.warned = False
            return
        silent, last = lost
        answers = None if self.net is None else self.net.silence(now)
        if answers is not None and answers < self.plan.net_silent_s:
            if not self.warned:
                log.warning("node %d's watcher: node %d's beats in the run dir are %.0fs late, "
                            "but it answers over the training network: its file server is slow "
                            "(not a loss)", self.plan.node, self.next_node.peer, silent)
            self.warned = True
            return
        message, record = declaration.lost(None, self.plan.host, self.plan.liveness_s, silent,
                                           list(last.ranks or (last.rank,)), last, self.wall(),
                                           by=self._me())
        self._post(message, record, silent)

    def _net_lost(self, now: float) -> bool:
        """The next node silent on the training network for ``net_silent_s``: declared lost (not
        when it left, when a declaration is already out, or when this node's own link is down),
        and True."""
        silent = None if self.net is None else self.net.lost(now)
        if self.net is None or silent is None or self.cut:
            return False
        left, age = self.next_node.fresh(now)
        last = self.next_node.last()
        if left or last is None or lost.declaration(self.run_dir, self.plan.tag) is not None:
            return False
        message, record = declaration.lost(None, self.plan.host, self.plan.liveness_s, silent,
                                           list(last.ranks or (last.rank,)), last, self.wall(),
                                           by=self._me(),
                                           noticed=net_beat.noticed(
                                               silent, age, self.plan.period_s,
                                               unanswered=self.net.unanswered()))
        self._post(message, record, silent)
        return True

    def _look_at_link(self, now: float) -> None:
        """This node's own link down: it is the one cut off and declares no other (said once);
        down for 2 x ``net_silent_s`` with no declaration out, itself, through the run dir (a cut
        before its first answer went undeclared: slurmctld's node timeout ended the step, B16)."""
        assert self.net is not None
        cut = self.net.cut_off()
        if cut and not self.cut:
            log.error("node %d's watcher: this node's link (%s) is down: it is the one cut off, "
                      "and declares nobody else", self.plan.node, self.net.interface)
            self.cut_at = now
        self.cut = cut
        down = now - self.cut_at
        if cut and not self.quiet and down >= 2 * self.plan.net_silent_s and \
                lost.declaration(self.run_dir, self.plan.tag) is None:
            ranks = sorted(self.on_node)
            me = Beat(self.plan.tag, ranks[0], self.plan.host, self.count, node=self.plan.node,
                      ranks=tuple(ranks))
            noticed = (f"its own link ({self.net.interface}) down for {down:.0f}s: the node "
                       "declared itself, cut off from its peers")
            self._post(*declaration.lost(None, self.plan.host, self.plan.liveness_s, down, ranks,
                                         me, self.wall(), by=self._me(), noticed=noticed), down)

    def _me(self) -> str:
        return f"node {self.plan.node}'s watcher ({self.plan.host})"

    def _heard(self) -> bool:
        return declaration.heard_on_node(self.folder, self.plan.local_tag) is not None

    def _declare_stopped(self, stopped: dict[int, float], gone: dict[int, float],
                         found: dict[int, Beat]) -> None:
        which = stopped or gone
        ranks, longest = sorted(which), max(which.values())
        self._post(*declaration.stopped(self._me(), self.plan.host, ranks, longest, found[ranks[0]],
                                        self.wall(), "stopped" if stopped else "gone"), longest)

    def _post(self, message: str, record: dict[str, Any], silent: float) -> None:
        self.board.post(record, silent)
        log.error("%s", message)
        self.quiet = True

    def _beat(self, left: bool) -> None:
        self.count += 1
        node = Beat(self.plan.tag, min(self.on_node), self.plan.host, self.count, left,
                    self.wall(), self.plan.node, tuple(sorted(self.on_node)),
                    net=None if self.net is None else self.net.endpoint)
        try:
            declaration.rewrite(beats.node_beat(self.run_dir, self.plan.node), beats.encode(node))
        except OSError as err:
            log.warning("node %d's watcher cannot write the node's beat: %s", self.plan.node, err)


def run(plan: Plan, clock: Any = time.monotonic) -> None:
    """Tick until the node's part of the attempt ends."""
    watch = NodeWatch(plan, clock=clock)
    if watch.net is not None:
        watch.net.serve(clock, TICK_S)  # pings and answers while a tick waits on the file server
    net = None if watch.net is None else watch.net.endpoint  # for the store's hand-over
    declaration.rewrite(marker(watch.folder), beats.encode(
        Beat(plan.local_tag, plan.first_rank, plan.host, 1, pid=os.getpid(), net=net)))
    while not watch.done:
        started = clock()
        try:
            watch.tick()
        except Exception as err:  # noqa: BLE001 (a watcher that dies stops the node's beats)
            log.warning("node %d's watcher: a look failed (it goes on): %s", plan.node, err)
        time.sleep(max(0.0, TICK_S - (clock() - started)))
    if watch.net is not None:
        watch.net.close()


@dataclass
class Watcher:
    """The first rank's handle on its node's watcher."""

    process: subprocess.Popen[bytes] | None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)


def spawn(plan: Plan) -> Watcher:
    """The node's watcher, started beside the first rank (its stderr: the rank's log); a handle on
    nothing where it cannot start (no ``/proc``: not Linux), and the rank's thread beats instead.
    The plan goes through a pipe, not the command line, which every user of the node can read: it
    holds the attempt's token and the node's private folder (only the run dir is on the command
    line, by which a test finds what a run left running)."""
    if not Path("/proc/self/stat").exists():
        return Watcher(None)
    try:
        process = subprocess.Popen([sys.executable, "-m", "hpc_ddp.rank.watch.node_watch",
                                    plan.run_dir], stdin=subprocess.PIPE, close_fds=True)
        assert process.stdin is not None
        with process.stdin:
            process.stdin.write(json.dumps(plan.__dict__).encode())
    except OSError as err:
        log.warning("the node's watcher could not start (%s): the first rank's thread beats for "
                    "the node instead", err)
        return Watcher(None)
    return Watcher(process)


def main(stdin: Any = sys.stdin) -> int:
    for name in IGNORED:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    raw = json.loads(stdin.read())
    plan = Plan(**{**raw, "ids": tuple(raw["ids"])})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[hpc_ddp node {plan.node} watcher] %(message)s")
    run(plan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
