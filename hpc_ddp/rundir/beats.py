"""Liveness beats: their format and where they lie (:mod:`hpc_ddp.rank.watch.liveness` writes and
watches them).

Two places, one format (one JSON object padded to a multiple of :data:`WIDTH` bytes and rewritten in
place):

- **On the node** (:func:`node_dir`: ``/dev/shm`` or the temporary directory, one private folder per
  run, attempt and node, :mod:`hpc_ddp.rundir.node_local`): every rank's own beat, ``rank-L.beat``
  by local rank, and ``declared.json``, the relay of a declaration to the node's other ranks.
  Nothing here touches the shared filesystem, and a record here counts only with the attempt's token
  in its tag (:func:`local_tag`).
- **In the run dir**: ``liveness/node-N.json``, the node's beat, written by the node's first local
  rank for the whole node (it names the node's ranks and host), and ``liveness/declared.json``. One
  file per node, whatever the ranks per node: at 512 nodes x 8 GPUs the file server sees 512 beats a
  period, not 4,096.

The batch shell reads the node beats for the hosts of a step that wrote no ledger line. No torch.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.rundir import layout, node_local

# every beat is padded to a multiple of this, so each write replaces the last one in place
WIDTH = 256
READ_LIMIT = 64 * WIDTH  # a node beat names its ranks: 4,096 bytes hold about 600 of them


@dataclass(frozen=True)
class Beat:
    tag: str  # the attempt (hpc_ddp.rundir.ledger.attempt_tag)
    rank: int  # a rank's beat: the rank; a node's beat: its first rank
    host: str
    count: int
    left: bool = False
    wall: float = 0.0  # for people reading the file; never compared across nodes
    node: int | None = None  # a node's beat: its index in the step
    ranks: tuple[int, ...] = ()  # a node's beat: the ranks on it (those that have beaten)
    pid: int | None = None  # a rank's beat on its node: its process, for the node's watcher
    net: str | None = None  # a node's beat from its watcher: where it answers pings (ADDRESS:PORT)


def encode(beat: Beat) -> bytes:
    record = {"attempt": beat.tag, "rank": beat.rank, "host": beat.host, "count": beat.count,
              "state": "left" if beat.left else "alive", "time": round(beat.wall, 3)}
    if beat.node is not None:
        record.update(node=beat.node, ranks=list(beat.ranks))
    if beat.pid is not None:
        record["pid"] = beat.pid
    if beat.net is not None:
        record["net"] = beat.net
    text = json.dumps(record)
    width = WIDTH * (len(text) // WIDTH + 1)  # fixed within an attempt unless the node's ranks grow
    return (text.ljust(width - 1) + "\n").encode()


def decode(raw: bytes, tag: str) -> Beat | None:
    """A beat of attempt ``tag``; None for anything else (no beat yet, another attempt's, a torn
    read)."""
    try:
        record, _ = json.JSONDecoder().raw_decode(raw.decode().lstrip())
        if record.get("attempt") != tag:
            return None
        node, pid = record.get("node"), record.get("pid")
        return Beat(tag, int(record["rank"]), str(record.get("host") or ""), int(record["count"]),
                    record.get("state") == "left", float(record.get("time") or 0),
                    None if node is None else int(node),
                    tuple(int(r) for r in record.get("ranks") or ()),
                    None if pid is None else int(pid),
                    None if record.get("net") is None else str(record["net"]))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None


def read(path: Path, tag: str, own: bool = False) -> Beat | None:
    """The beat in ``path`` (opened by name, never through a link), if it is of attempt ``tag``.
    ``own``: a beat on node-local storage, believed only from a file of this user's."""
    raw = node_local.read(path, READ_LIMIT, owner=-1 if own else None)
    return None if raw is None else decode(raw, tag)


def local_tag(run_dir: Path | str, tag: str) -> str:
    """The tag a record on node-local storage carries: the attempt's, with its token (another user's
    planted beat or declaration, which cannot know it, is no beat of this attempt)."""
    return f"{tag}+{node_local.token(run_dir, tag)}"


def node_beat(run_dir: Path | str, node: int) -> Path:
    """Node ``node``'s beat in the run dir: one per node index, not per attempt (the attempt is
    inside)."""
    return Path(run_dir) / layout.LIVENESS / f"node-{node}.json"


def node_dir(run_dir: Path | str, tag: str, node: int, base: Path | None = None) -> Path:
    """This node's folder for the beats of its ranks, on node-local storage (:func:`run_folder`), by
    attempt and node index, so the rehearsal's simulated nodes (one machine) keep apart and so do
    two runs on one node. A path only: whoever writes there first makes it private
    (:func:`hpc_ddp.rundir.node_local.ensure`)."""
    return run_folder(run_dir, base) / f"{tag}-node-{node}"


def run_folder(run_dir: Path | str, base: Path | None = None) -> Path:
    """The run's folder on this node: under ``/dev/shm`` where it is writable, else the temporary
    directory; named by the user and a key only the run's secret gives
    (:func:`hpc_ddp.rundir.node_local.run_folder`)."""
    return node_local.run_folder(run_dir, base)


def local_beat(folder: Path, local_rank: int) -> Path:
    return folder / f"rank-{local_rank}.beat"


def local_declared(folder: Path) -> Path:
    return folder / "declared.json"


def clear_when_all_left(folder: Path, tag: str, local_size: int) -> None:
    """Remove the node's files once every rank on it has said it left (whoever leaves last): a
    finished or stopped run leaves nothing in ``/dev/shm``. Files only: a survivors' snapshot being
    written after a loss keeps its own subfolder (``jit/``,
    :func:`hpc_ddp.rundir.jit_files.post_for`), and with it the folder, until the next attempt's
    first rank on the node clears it. A lost rank never leaves; the next attempt clears that too."""
    if not all((beat := read(local_beat(folder, local), tag, own=True)) is not None and beat.left
               for local in range(local_size)):
        return
    try:
        for entry in folder.iterdir():
            if entry.is_file():
                entry.unlink(missing_ok=True)
        folder.rmdir()
        folder.parent.rmdir()  # the run's folder, once no node of it is left on this machine
    except OSError:
        pass


def clear_other_attempts(folder: Path, tag: str) -> None:
    """The node's leader removes the folders earlier attempts of the run left on this node's
    storage."""
    try:
        for old in folder.parent.iterdir():
            if not old.name.startswith(f"{tag}-node-"):
                shutil.rmtree(old, ignore_errors=True)
    except OSError:
        pass


class Judge:
    """One watcher's view of one peer, by the watcher's own clock. Pure: ``observe`` is given the
    time."""

    def __init__(self, liveness_s: float) -> None:
        self.liveness_s = liveness_s
        # a gap this long between two looks: this rank was not watching
        self.stall_s = liveness_s / 2
        self.count: int | None = None
        self.changed_at = 0.0
        self.looked_at: float | None = None
        self.left = False
        self.last: Beat | None = None

    def observe(self, beat: Beat | None, now: float) -> float | None:
        """One look at the peer's file (None: nothing readable of this attempt); the silence in
        seconds once it reaches ``liveness_s`` (the peer is lost), else None."""
        if self.looked_at is not None and now - self.looked_at > self.stall_s:
            # the silence this rank missed is not the peer's fault: start again
            self.changed_at = now
        self.looked_at = now
        self.left = self.left or (beat is not None and beat.left)
        if self.left:
            return None
        if beat is not None and beat.count != self.count:
            self.count, self.changed_at, self.last = beat.count, now, beat
            return None
        if self.count is None:
            return None  # not beaten yet in this attempt: not judged
        silent = now - self.changed_at
        return silent if silent >= self.liveness_s else None
