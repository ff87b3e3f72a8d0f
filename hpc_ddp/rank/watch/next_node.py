"""The next node's beat in the run dir, as a node's watcher (:mod:`hpc_ddp.rank.watch.node_watch`)
or, while none runs, the node's first rank (:mod:`hpc_ddp.rank.watch.liveness`) watches it: each
node watches the next one, past a node that left; until its beat is read, what the store handed
over (:mod:`hpc_ddp.rank.watch.net_exchange`) says where it answers pings. No torch."""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.rundir import beats
from hpc_ddp.rundir.beats import Beat, Judge

PEER = "peer.beat"  # in the node's folder: the next node as the process group's store said


class NextNode:
    """The next node's beat in the run dir, judged by this watcher's clock; past a node that left,
    the one after it."""

    def __init__(self, run_dir: Path, tag: str, node: int, nodes: int, liveness_s: float,
                 handed: tuple[Path, str] | None = None) -> None:
        self.run_dir, self.tag, self.node, self.nodes = run_dir, tag, node, nodes
        self.liveness_s = liveness_s
        self.peer, self.judge = (node + 1) % nodes, Judge(liveness_s)
        # (the node's folder, its local tag): where the store's hand-over lands, read until found
        self.handed_in, self.handed = handed, None

    def look(self, now: float) -> tuple[float, Beat] | None:
        """(silence, its last beat) once the watched node was silent for ``liveness_s``."""
        if self.peer == self.node:
            return None
        judge = self.judge
        silent = judge.observe(beats.read(beats.node_beat(self.run_dir, self.peer), self.tag), now)
        if judge.left:
            self.peer, self.judge = (self.peer + 1) % self.nodes, Judge(self.liveness_s)
            return None
        return (silent, judge.last) if silent is not None and judge.last is not None else None

    def endpoint(self) -> str | None:
        """Where the next node's watcher answers pings: its last beat in the run dir says, or, where
        that beat says nothing of it (written by the node's first rank before its watcher ran) or
        none was read yet, the store's hand-over."""
        if self.peer == self.node:
            return None
        last, handed = self.judge.last, self._handed()
        if last is not None and last.net:
            return last.net
        return None if handed is None else handed.net

    def last(self) -> Beat | None:
        """The next node's last beat read from the run dir; until one is, the hand-over's."""
        return self.judge.last if self.judge.last is not None else self._handed()

    def _handed(self) -> Beat | None:
        if self.handed is None and self.handed_in is not None:
            folder, local_tag = self.handed_in
            self.handed = beats.read(folder / PEER, local_tag, own=True)
        return self.handed if self.handed is not None and self.handed.node == self.peer else None

    def fresh(self, now: float) -> tuple[bool, float | None]:
        """The next node's beat read now: (it left, seconds since it last changed)."""
        judge = self.judge
        judge.observe(beats.read(beats.node_beat(self.run_dir, self.peer), self.tag), now)
        return judge.left, None if judge.count is None else now - judge.changed_at
