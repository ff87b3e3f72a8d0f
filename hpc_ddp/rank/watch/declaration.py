"""A lost rank's declaration: what the watcher that saw the silence writes, and how every
survivor hears it.

When the watched peer is silent for ``liveness_s``, its watcher
(:mod:`hpc_ddp.rank.watch.liveness`) writes ``RUN_DIR/errors/<attempt>-lost-rank-P.json`` (the
rank, or a whole node's ranks, the host from the last beat, silence, who saw it) and a crash
marker (a ``train.script`` worker then takes the SIGTERM that follows for a failure, not a stop),
logs the error and exits at once with ``EXIT_LOST``, without touching the process group (a wedged
communicator deadlocks a destroy). srun's ``--kill-on-bad-exit`` ends the step; the batch shell
reads :func:`hpc_ddp.rundir.losses.lost_ranks` and leaves the node out.

**Every survivor hears the declaration.** Only the watcher sees the silence; the other survivors
used to learn of the loss when a peer they waited on exited and gloo failed their pending work.
NCCL does not fail it: a survivor blocked in an NCCL collective stays blocked, and the buddies that
hold the lost ranks' per-rank state never wrote it. So the watcher also writes the declaration into
``RUN_DIR/liveness/declared.json`` (one file per run, rewritten in place, the attempt inside; rank 0
creates it before the rendezvous, and the others read it only after, so no node caches its absence);
each node's first rank reads it each period once the rendezvous is done and relays it to the node's
other ranks through the node's folder. A rank that hears it writes what it holds (the survivors'
snapshot, from the liveness thread) and exits with ``EXIT_FAILED``, whatever its training thread is
waiting for.

Apart from the beats and the watching: this is the loss's record, its files and its messages, and
none of the thread's timing. It speaks as ``hpc_ddp.liveness``, the logger it always had. No torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.core.atomic import rewrite_in_place, write_atomic
from hpc_ddp.rundir import beats, layout, losses, lost as lost_files, node_local
from hpc_ddp.rundir.beats import Beat
from hpc_ddp.rundir.ledger import crash_marker

log = logging.getLogger("hpc_ddp.liveness")
HINT = ("HINT: the node may be frozen or gone (`scontrol show node HOST`, its kernel log); the "
        "batch shell leaves it out of the next step (slurm.spare_nodes, a slurm.nodes range) or "
        "the job takes the requeue path (slurm.max_failures). A rank that holds the GIL in C code "
        "this long looks the same: raise dist.liveness_s")


def lost(rank: int | None, own_host: str, liveness_s: float, silent: float, ranks: list[int],
         last: Beat, now: float, by: str | None = None,
         noticed: str | None = None) -> tuple[str, dict[str, Any]]:
    """What rank ``rank`` (on ``own_host``; or ``by``, a node's watcher) says and records:
    ``ranks`` were silent ``silent`` s (in the run dir's beats, or as ``noticed`` says: on the
    training network, :mod:`hpc_ddp.rank.watch.net_beat`)."""
    host = last.host or "?"
    whole = (f" (node {last.node}, every rank on it)"
             if last.node is not None and len(ranks) > 1 else "")
    how = noticed or (f"no liveness beat for {silent:.0f}s (dist.liveness_s={liveness_s:g}); the "
                      f"last beat was #{last.count}")
    message = (f"{by or f'rank {rank}'}: {losses.who(ranks)} on {host}{whole} "
               f"{'is' if len(ranks) == 1 else 'are'} lost: {how}. Ending this "
               f"step now instead of waiting in a collective for dist.timeout_s.\n{HINT}")
    record = {"rank": ranks[0], "ranks": ranks, "host": host, "silent_s": round(silent, 1),
              "liveness_s": liveness_s, "by_rank": rank, "by_host": own_host,
              "last_beat": last.count, "last_beat_time": last.wall, "time": round(now, 3)}
    if by is not None:
        record["by"] = by
    if noticed is not None:
        record["noticed"] = noticed
    return message, record


def stopped(by: str, host: str, ranks: list[int], seconds: float, last: Beat, now: float,
            how: str = "stopped") -> tuple[str, dict[str, Any]]:
    """What a node's watcher says and records when ``ranks`` of its node were stopped (state T:
    SIGSTOP), or gone without leaving (``how``), for ``seconds``
    (:mod:`hpc_ddp.rank.watch.kernel_judge`)."""
    noticed = (f"stopped (SIGSTOP: state T in /proc) for {seconds:.0f}s" if how == "stopped" else
               f"its process gone without leaving for {seconds:.0f}s")
    hint = ("HINT: something sent it SIGSTOP (a frozen container, `kill -STOP`, a job control "
            "stop); a debugger's stop (gdb, py-spy) is never taken for a loss"
            if how == "stopped" else
            "HINT: it was killed (the OOM killer: `dmesg` or `journalctl -k` on that node; a "
            "signal) and its peers did not fail with it")
    message = (f"{by}: {losses.who(ranks)} on {host} {'is' if len(ranks) == 1 else 'are'} lost: "
               f"{noticed}. Ending this step now instead of waiting for it in a collective.\n"
               f"{hint}")
    record = {"rank": ranks[0], "ranks": ranks, "host": host, "silent_s": round(seconds, 1),
              "noticed": noticed, "by": by, "by_rank": None, "by_host": host,
              "last_beat": last.count, "last_beat_time": last.wall, "time": round(now, 3)}
    return message, record


def heard(rank: int, record: dict[str, Any]) -> str:
    """What rank ``rank`` says when it hears another rank's declaration ``record``."""
    by = record.get("by") or f"rank {record.get('by_rank')}"
    said = (f"rank {rank}: {by} declared "
            f"{losses.who(lost_files.named_ranks(record))} on {record.get('host') or '?'} lost; "
            "this rank ends the step now instead of waiting in a collective for the process group "
            "to fail")
    if fenced(rank, record):
        return (f"{said}. This rank is among them (its node cut off, or a false alarm): it offers "
                "nothing for the survivors' snapshot, which its peers write without it")
    return said


def fenced(rank: int, record: dict[str, Any]) -> bool:
    """``rank`` is among the ranks ``record`` declares lost: once declared, nothing it would write
    (an offer, its share of the survivors' snapshot) is taken; it writes none (issue 60)."""
    return rank in lost_files.named_ranks(record)


def heard_on_node(folder: Path, local_tag: str) -> dict[str, Any] | None:
    """The declaration relayed on this node (by its first rank, or its watcher), if any."""
    return lost_files.declaration_in(beats.local_declared(folder), local_tag, own=True)


@dataclass(frozen=True)
class Board:
    """Where one rank's attempt posts a declaration and hears one: the run dir's files
    (``errors/``, ``liveness/declared.json``) and the relay in its node's folder (``folder``,
    records of ``local_tag``)."""
    run_dir: Path
    ids: tuple[int | str | None, int, int]  # job id, restart count, in-job attempt
    tag: str
    folder: Path
    local_tag: str

    def post(self, record: dict[str, Any], silent: float) -> None:
        """The lost-rank marker, the crash marker, the run's declaration, this node's relay."""
        ranks, host = record["ranks"], record["host"]
        try:
            marker = layout.lost_marker(self.run_dir, self.tag, ranks[0])
            marker.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, json.dumps(record, sort_keys=True) + "\n")
            noticed = record.get("noticed") or f"no liveness beat for {silent:.0f}s"
            write_atomic(crash_marker(self.run_dir, *self.ids, ranks[0]),
                         f"{losses.who(ranks)} on {host} lost: {noticed}\n")
            # other nodes' leaders read it, and this node's ranks the copy here, with the token
            rewrite_in_place(layout.declared(self.run_dir),
                             lost_files.padded({**record, "attempt": self.tag}))
            rewrite(beats.local_declared(self.folder),
                    lost_files.padded({**record, "attempt": self.local_tag}))
        except OSError as err:
            log.error("the lost-rank marker could not be written: %s", err)

    def hear(self, rank: int, leader: bool) -> dict[str, Any] | None:
        """Another rank's declaration in this attempt, or None. Only the node's leader reads the
        run dir's (one read per node a period) and relays it on the node; the node's other ranks
        read the relay."""
        if leader:
            record = lost_files.declaration(self.run_dir, self.tag)
            if record is not None and record.get("by_rank") != rank:
                rewrite(beats.local_declared(self.folder),
                        lost_files.padded({**record, "attempt": self.local_tag}))
        else:
            record = heard_on_node(self.folder, self.local_tag)
        return None if record is None or record.get("by_rank") == rank else record


def rewrite(path: Path, data: bytes) -> None:
    """``data`` over ``path`` in place (a beat, a relayed declaration), its folder made at first
    use."""
    try:
        rewrite_in_place(path, data)
    except FileNotFoundError:  # the first beat of the run dir, or the node's folder (made private)
        if path.parent.name == layout.LIVENESS:
            path.parent.mkdir(parents=True, exist_ok=True)
        else:
            node_local.ensure(path.parent)
        rewrite_in_place(path, data)
