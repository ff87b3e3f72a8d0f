"""A hang's flight-recorder dumps, one file per node in the run dir (issue 57: a tidy run dir).

Every rank's hang handler dumps its flight record (:func:`hpc_ddp.rundir.flight.record`) at once,
before anyone exits. Written straight to ``RUN_DIR/errors/`` that was one multi-MB file per rank in
one shared directory, thousands at a time at scale. So a rank writes its dump on its node
(node-local storage, the attempt's private folder, with the attempt's token), and as it leaves its
handler it publishes what its node's ranks dumped as one file,
``errors/<attempt>-collectives-node-N.json`` (``{"node": N, "ranks": {rank: record}}``), unless a
publish already holds its own dump: the node's ranks dump at the start of their handlers and publish
once their survivors' snapshot is written (before any wait: the step may end under them), so the
first to publish takes them all and the others find themselves in it. Under a lock on the node; a
rank whose node's file was published without it (it dumped late) publishes again.
:func:`hpc_ddp.rundir.flight.read` reads these and the older per-rank files alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rundir import layout, node_local
from hpc_ddp.rundir.ledger import attempt_tag

PUBLISHED = "flight-published.json"


@dataclass(frozen=True)
class Spot:
    """Where one rank's dump goes: its node's folder for the attempt and the run dir's prefix."""

    prefix: str  # RUN_DIR/errors/<attempt>-collectives-
    local: Path  # this node's folder for the attempt (node-local)
    tag: str  # the attempt's tag with its token: every record on the node carries it
    rank: int
    node: int
    local_size: int


def node_prefix(run_dir: Path | str, job_id: int | str | None, restart_count: int,
                in_job: int) -> str:
    """The prefix of an attempt's per-node dumps (what the ledger's ``collectives`` names)."""
    tag = attempt_tag(job_id, restart_count, in_job)
    return str(layout.errors(run_dir) / f"{tag}-collectives-")


def spot_for(run_dir: Path | str, env: Any) -> Spot:
    """This rank's :class:`Spot` (``env``: a :class:`hpc_ddp.core.slurm_env.DistEnv`)."""
    from hpc_ddp.rundir import beats

    tag = attempt_tag(env.job_id, env.restart_count, env.in_job)
    return Spot(node_prefix(run_dir, env.job_id, env.restart_count, env.in_job),
                beats.node_dir(run_dir, tag, env.node_rank) / "flight",
                beats.local_tag(run_dir, tag),
                env.rank, env.node_rank, max(1, env.local_world_size))


def keep(spot: Spot, record: dict[str, Any]) -> None:
    """This rank's dump, on its node (not yet in the run dir)."""
    node_local.ensure(spot.local)
    write_atomic(spot.local / f"rank-{spot.rank}.json",
                 json.dumps({"tag": spot.tag, "rank": spot.rank, "record": record}).encode())


def publish(spot: Spot) -> Path | None:
    """The node's file in the run dir, written unless the last one already holds this rank's dump
    (or this rank kept none); the node's file, or None when no dump of the node is there."""
    try:
        node_local.ensure(spot.local)
    except OSError:
        return None
    target = Path(f"{spot.prefix}node-{spot.node}.json")
    with node_local.locked(spot.local / "flight.lock"):
        before = _mine(spot, spot.local / PUBLISHED).get("ranks") or []
        if spot.rank in before:
            return target
        ranks = {}
        for path in sorted(spot.local.glob("rank-*.json")):
            found = _mine(spot, path)
            if isinstance(found.get("rank"), int) and isinstance(found.get("record"), dict):
                ranks[found["rank"]] = found["record"]
        if not ranks:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, json.dumps({"node": spot.node, "ranks": ranks}).encode())
        write_atomic(spot.local / PUBLISHED, json.dumps({"tag": spot.tag, "ranks": sorted(ranks)}))
        return target


def _mine(spot: Spot, path: Path) -> dict[str, Any]:
    """A JSON record of the node's folder that is this user's and carries the attempt's token
    ({} otherwise)."""
    raw = node_local.read(path, 1 << 28)
    try:
        record = json.loads(raw) if raw is not None else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) and record.get("tag") == spot.tag else {}


