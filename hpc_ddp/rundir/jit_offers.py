"""Reading what the survivors of an attempt said (:mod:`hpc_ddp.rundir.jit_files` writes it): the
nodes' files of offers, read by name by the survivor that completes the set and by rank 0 before
it resumes (:func:`disagreeing`), or found by listing by the batch shell and the rehearsal
(:func:`listed`).

Node files are read by name (the node count is known), never found by listing the directory, as the
crash marks are (an NFS client may list a directory as it was 30 s ago); only the batch shell, after
the step ended, lists the folder for the ledger's line (:func:`hpc_ddp.rundir.losses.jit_fields`),
and the rehearsal, to wait while a survivor still writes (:func:`writing`). Apart from the node side
that writes them: a reader needs no node's folder, lock or :class:`~hpc_ddp.rundir.jit_files.Post`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import lost
from hpc_ddp.rundir.jit_files import JIT, folder


def fence_of(run_dir: Path | str, manifest: dict[str, Any]) -> lost.Fence | None:
    """The fence of the attempt whose survivors committed ``manifest``
    (:mod:`hpc_ddp.rundir.lost`); None for a periodic snapshot, which no declaration touches."""
    record = manifest.get("jit")
    if not isinstance(record, dict) or not isinstance(record.get("attempt"), str):
        return None
    return lost.fence(run_dir, record["attempt"])


def disagreeing(run_dir: Path | str, manifest: dict[str, Any],
                fence: lost.Fence | None = None) -> list[int]:
    """The survivors whose offer of a just-in-time snapshot's step holds another state than its
    writer's (their fingerprints differ): a source that offered after the writer's last look, or
    whose withdraw another node's cache hid. A declared rank's offer counts for nothing
    (``fence``: the attempt's, read here when not given). Empty for a periodic snapshot. Rank 0
    asks it before resuming from a step."""
    record = manifest.get("jit")
    world = manifest.get("world_size")
    if not isinstance(record, dict) or not isinstance(record.get("attempt"),
                                                      str) or not isinstance(world, int):
        return []
    where = Path(run_dir) / JIT / record["attempt"]
    # older records: at most one a rank
    nodes = record.get("nodes") if isinstance(record.get("nodes"), int) else world
    said = (fence or lost.fence(run_dir, record["attempt"])).offers(offers(where, nodes))
    return sorted(o["rank"] for o in said if o.get("source")
                  and o.get("step") == manifest.get("step")
                  and "fingerprint" in o and o.get("fingerprint") != record.get("fingerprint"))


def fenced(manifest: dict[str, Any], fence: lost.Fence, path: Path) -> list[int]:
    """The ranks that wrote or committed the survivors' snapshot ``manifest`` (its file ``path``)
    after they were declared lost in its attempt (issue 60: nothing a declared node writes
    afterwards is taken as a commit): the manifest's change time on the file server against the
    declarations' (:class:`hpc_ddp.rundir.lost.Fence`). Rank 0 asks it before resuming."""
    record = manifest["jit"]
    writers = record.get("writers") if isinstance(record.get("writers"), dict) else {}
    ranks = {record.get("writer"), record.get("committer"),
             *(int(r) for r in writers if str(r).isdigit())}
    return fence.before(ranks, lost.changed(path)) if fence.declared else []


def offers(where: Path, nodes: int) -> list[dict[str, Any]]:
    """Every offer of the attempt that can be read now: ``nodes`` files opened by name, one per
    node."""
    found = []
    for node in range(nodes):
        found.extend(node_offers(where, node))
    return sorted(found, key=lambda o: o.get("rank", -1))


def node_offers(where: Path, node: int) -> list[dict[str, Any]]:
    try:
        record = json.loads((where / f"node-{node}.json").read_bytes())
    except (OSError, ValueError):
        return []
    said = record.get("offers") if isinstance(record, dict) else None
    return [o for o in said if isinstance(o, dict)] if isinstance(said, list) else []


def writing(run_dir: Path | str, job_id: int | None, restart_count: int, in_job: int = 0) -> bool:
    """A survivor of this attempt is still at its just-in-time snapshot: a source whose offer has no
    outcome yet (the rehearsal then waits as srun waits KillWait, not its short grace)."""
    return any(o.get("source") and "outcome" not in o
               for o in listed(folder(run_dir, job_id, restart_count, in_job)))


def listed(where: Path) -> list[dict[str, Any]]:
    """Every node's offers, the node files found by listing: only for the batch shell and the
    rehearsal, after (or beside) the step, on the node that lists (never to decide what a survivor
    commits)."""
    found = []
    for path in sorted(where.glob("node-*.json")) if where.is_dir() else []:
        number = path.stem.removeprefix("node-")
        if number.isdigit():
            found.extend(node_offers(where, int(number)))
    return found
