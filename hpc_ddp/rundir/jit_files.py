"""The run dir's part of a just-in-time snapshot (:mod:`hpc_ddp.rank.jit`): where the survivors of an attempt
meet, without a process group or a store. No torch: the batch shell reads what they said.

``RUN_DIR/jit/job-J-restart-R[-step-K]/`` holds one offer per survivor (``rank-K.json``: the step it holds
whole and its fingerprint, or why it holds none, and what came of it) and one empty ``claim-step-S`` per
claimed step, created with O_EXCL (atomic on local filesystems and on NFS v3 and later): one writer per step.
With ``per_rank`` objects each survivor also leaves ``blobs-K.pt``: the per-rank states it holds (its own and
its ward's, from :mod:`hpc_ddp.rank.mirror`) by rank and step, and one ``commit-step-S`` (O_EXCL again) names
the one survivor that puts them together and commits.
Offers are read by name (the world size is known), never found by listing the directory, as the crash marks
are (an NFS client may list a directory as it was 30 s ago); only the batch shell, after the step ended,
lists the folder for the ledger's summary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rundir.ledger import attempt_tag

JIT = "jit"


def folder(run_dir: Path | str, job_id: int | None, restart_count: int, in_job: int = 0) -> Path:
    return Path(run_dir) / JIT / attempt_tag(job_id, restart_count, in_job)


def disagreeing(run_dir: Path | str, manifest: dict[str, Any]) -> list[int]:
    """The survivors whose offer of a just-in-time snapshot's step holds another state than its writer's (their
    fingerprints differ): a source that offered after the writer's last look, or whose withdraw another node's
    cache hid. Empty for a periodic snapshot. Rank 0 asks it before resuming from a step."""
    record = manifest.get("jit")
    world = manifest.get("world_size")
    if not isinstance(record, dict) or not isinstance(record.get("attempt"), str) or not isinstance(world, int):
        return []
    where = Path(run_dir) / JIT / record["attempt"]
    return sorted(o["rank"] for o in offers(where, world) if o.get("source") and o.get("step") == manifest.get("step")
                  and "fingerprint" in o and o.get("fingerprint") != record.get("fingerprint"))


BROKEN_STOP_MARK = "stopped-mid-step"  # a rank whose step a stop signal broke (rank/broken_stop.py) creates it


def broken_stop_marked(run_dir: Path | str, job_id: int | None, restart_count: int, in_job: int = 0) -> bool:
    """Whether a rank of this attempt found its step broken by a stop signal (opened by name, not listed)."""
    return (folder(run_dir, job_id, restart_count, in_job) / BROKEN_STOP_MARK).exists()


def file_name(rank: int) -> str:
    """The snapshot file a survivor writes: its own name, apart from the nodes' files of a periodic save of
    the same step that a failure may have left half-written (a manifest lists only what it commits)."""
    return f"jit-{rank:05d}.pt"


def offer(where: Path, rank: int, content: dict[str, Any]) -> None:
    where.mkdir(parents=True, exist_ok=True)
    write_atomic(where / f"rank-{rank}.json", json.dumps(content).encode())


def offers(where: Path, world_size: int) -> list[dict[str, Any]]:
    """Every offer of the attempt that can be read now, by rank."""
    found = []
    for rank in range(world_size):
        try:
            found.append(json.loads((where / f"rank-{rank}.json").read_text()))
        except (OSError, ValueError):
            continue
    return found


def claim(where: Path, step: int, what: str = "claim") -> bool:
    """True for the one survivor that creates ``claim-step-S`` (or ``commit-step-S``: ``what="commit"``) first."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(where / f"{what}-step-{step}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def ranks_file_name(step: int, committer: int) -> str:
    """The snapshot file of every rank's per-rank state at ``step`` (beside the survivor's state file), named
    after the survivor that committed it: on a filesystem without O_EXCL across nodes two may both believe they
    hold the commit claim, and the same name would have one's bytes under the other's manifest."""
    return f"jit-ranks-{step:08d}-by-{committer:05d}.pt"


def write_blobs(where: Path, rank: int, blobs: dict[int, tuple[int, bytes]]) -> None:
    """A survivor's per-rank states ({rank: (step, packed bytes)}), before its offer names them."""
    import torch

    where.mkdir(parents=True, exist_ok=True)
    write_atomic(where / f"blobs-{rank}.pt", lambda out: torch.save({r: [s, b] for r, (s, b) in blobs.items()}, out))


def read_blob(where: Path, holder: int, rank: int, step: int) -> bytes | None:
    """``rank``'s packed per-rank state at ``step`` from survivor ``holder``'s file (None: it holds another)."""
    import torch

    try:
        blobs = torch.load(where / f"blobs-{holder}.pt", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return None
    found = blobs.get(rank) if isinstance(blobs, dict) else None
    return found[1] if isinstance(found, list) and len(found) == 2 and found[0] == step else None


def writing(run_dir: Path | str, job_id: int | None, restart_count: int, in_job: int = 0) -> bool:
    """A survivor of this attempt is still at its just-in-time snapshot: a source whose offer has no outcome yet
    (the rehearsal then waits as srun waits KillWait, not its short grace)."""
    where = folder(run_dir, job_id, restart_count, in_job)
    for path in where.glob("rank-*.json") if where.is_dir() else []:
        try:
            said = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if said.get("source") and "outcome" not in said:
            return True
    return False


def summary(run_dir: Path | str, job_id: int | None, restart_count: int, in_job: int = 0) -> dict[str, Any]:
    """For the failed attempt's ledger line: the just-in-time snapshot committed (``jit_snapshot``: its step,
    writer, seconds) or why there is none (``jit_fallback``); empty when no survivor said anything (snapshot.jit
    off, a script, or every rank died)."""
    where = folder(run_dir, job_id, restart_count, in_job)
    from hpc_ddp.rundir.snapshot import committed  # manifests only: no torch

    for step, manifest in committed(Path(run_dir)):  # the manifest is the commit: it, not an offer, decides
        record = manifest.get("jit")
        if isinstance(record, dict) and record.get("attempt") == where.name:
            committer = record.get("committer")  # with per_rank state, whoever completed the set (may differ)
            return {"jit_snapshot": {"step": step, "writer": record.get("writer"), "host": record.get("host"),
                                     "took_s": record.get("took_s"),
                                     **({"committer": committer} if committer not in (None, record.get("writer"))
                                        else {})}}
    try:
        names = sorted(p.name for p in where.glob("rank-*.json"))
    except OSError:
        return {}
    said = []
    for name in names:
        try:
            said.append(json.loads((where / name).read_text()))
        except (OSError, ValueError):
            continue
    if not said:
        return {}
    reasons = sorted({o.get("why") or o.get("outcome") or "no outcome" for o in said})
    broken = {str(o.get("rank")): o["mirror_broken"] for o in said if o.get("mirror_broken")}
    return {"jit_fallback": "; ".join(reasons)[:500], **({"mirror_broken": broken} if broken else {})}
