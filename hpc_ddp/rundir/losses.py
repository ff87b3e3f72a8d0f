"""The lost-rank markers a rank's liveness watcher leaves in ``RUN_DIR/errors/``
(:mod:`hpc_ddp.rank.watch.liveness`), read by the batch shell and the rehearsal: which ranks and
hosts an attempt lost, and the ledger's line for it. No torch.

A failed attempt's ledger line says what it lost (:func:`ledger_fields`) and what its survivors
saved (:func:`jit_fields`: their offers in :mod:`hpc_ddp.rundir.jit_files`, the commit in the
snapshots' manifests). Both are read here, by whoever writes that line (the batch shell, the
rehearsal, or a rank recording its own failure), so the survivors' files need not import the
snapshots that import them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import jit_files, jit_offers, lost
from hpc_ddp.rundir.ledger import attempt_tag
from hpc_ddp.rundir.snapshot.steps import committed



def lost_markers(run_dir: Path | str, job_id: int | str | None, restart_count: int,
                 in_job: int = 0) -> dict[int, dict[str, Any]]:
    """Every lost-rank marker of an attempt, by rank (:func:`hpc_ddp.rundir.lost.markers`)."""
    return lost.markers(run_dir, attempt_tag(job_id, restart_count, in_job))


def who(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 4, 5``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def lost_ranks(run_dir: Path, job_id: int | str | None, restart_count: int,
               in_job: int) -> dict[int, str]:
    """rank -> host of the ranks declared lost in that attempt (the host "" if its marker is
    unreadable); empty when none was. For the batch shell and the rehearsal: a lost rank's node is a
    hard suspect."""
    return {rank: str(record.get("host") or "") for rank, record in lost_markers(
        run_dir, job_id, restart_count, in_job).items()}


def describe(run_dir: Path, job_id: int | str | None, restart_count: int, in_job: int = 0) -> str:
    """One line for the ledger and the logs, e.g. ``rank 3 on node1 lost (no liveness beat for 31s,
    seen by rank 2)``; "" when no rank was declared lost."""
    return _describe(lost_markers(run_dir, job_id, restart_count, in_job))


def _describe(markers: Mapping[int, Mapping[str, Any]]) -> str:
    """One clause per marker: a whole node's ranks together (``ranks 2, 3 on n2 lost ...``)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for rank, m in markers.items():
        noticed = str(m.get("noticed") or f"no liveness beat for {m.get('silent_s', '?')}s")
        key = (str(m.get("host") or "?"), noticed,
               str(m.get("by") or f"rank {m.get('by_rank', '?')}"))
        groups.setdefault(key, []).append(rank)
    return "; ".join(f"{who(ranks)} on {host} lost ({noticed}, seen by {by})"
                     for (host, noticed, by), ranks in groups.items())


def ledger_fields(run_dir: Path, job_id: int | str | None, restart_count: int,
                  in_job: int = 0) -> dict[str, Any]:
    """What a ``failed`` ledger line adds when ranks were declared lost: ``lost_ranks``,
    ``lost_hosts`` and the ``message``; empty when none was."""
    # read once: the ranks, hosts and message
    markers = lost_markers(run_dir, job_id, restart_count, in_job)
    if not markers:
        return {}
    times = [float(m["time"]) for m in markers.values() if isinstance(m.get("time"), (int, float))]
    return {"lost_ranks": sorted(markers),
            "lost_hosts": sorted({str(m.get("host")) for m in markers.values()
                                                                 if m.get("host")}),
            "message": _describe(markers), **({"lost_at": min(times)} if times else {})}


def _buddies(held: Any) -> dict[str, Any]:
    """``per_rank_held_by``: the ranks whose per-rank state the survivors' snapshot took from
    another rank (a lost rank's, from its buddy's mirror), by holder; the manifest has every rank's
    (``jit.per_rank_from``), the ledger line the few that say the mirror was used."""
    if not isinstance(held, dict):
        return {}
    others = {r: h for r, h in held.items() if str(h) != str(r)}
    return {"per_rank_held_by": others} if others else {}


def jit_fields(run_dir: Path | str, job_id: int | None, restart_count: int,
               in_job: int = 0) -> dict[str, Any]:
    """What a failed attempt's ledger line adds about its survivors: the just-in-time snapshot
    committed (``jit_snapshot``: its step, writer, seconds) or why there is none (``jit_fallback``);
    empty when no survivor said anything (snapshot.jit off, a script, or every rank died)."""
    where = jit_files.folder(run_dir, job_id, restart_count, in_job)
    for step, manifest in committed(Path(run_dir)):  # the manifest is the commit, not an offer
        record = manifest.get("jit")
        if isinstance(record, dict) and record.get("attempt") == where.name:
            writer = record.get("writer")
            committer = record.get("committer")  # with per_rank state: whoever completed the set
            stale = record.get("per_rank_stale")  # rank -> the older step of its state (mirror=N)
            return {"jit_snapshot": {"step": step, "writer": writer, "host": record.get("host"),
                                     "took_s": record.get("took_s"),
                                     **({"committer": committer}
                                        if committer not in (None, writer) else {}),
                                     **_buddies(record.get("per_rank_from")),
                                     **({"per_rank_stale": stale} if stale else {})}}
    try:
        said = jit_offers.listed(where)
    except OSError:
        return {}
    if not said:
        return {}
    reasons = sorted({o.get("why") or o.get("outcome") or "no outcome" for o in said})
    broken = {str(o.get("rank")): o["mirror_broken"] for o in said if o.get("mirror_broken")}
    return {"jit_fallback": "; ".join(reasons)[:500],
            **({"mirror_broken": broken} if broken else {})}
