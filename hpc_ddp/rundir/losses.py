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

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import jit_files, jit_offers, layout, node_local, view
from hpc_ddp.rundir.ledger import attempt_tag
from hpc_ddp.rundir.snapshot.steps import committed



def lost_markers(run_dir: Path | str, job_id: int | str | None, restart_count: int,
                 in_job: int = 0) -> dict[int, dict[str, Any]]:
    """Every lost-rank marker of an attempt, by rank (an unreadable one as ``{}``).

    The listing of ``errors/`` may be another node's cached past on NFS and lack a marker written
    seconds ago; the declaration (``liveness/declared.json``, created before the rendezvous and read
    by name) cannot: the rank it names is always among these, so a stale listing never moves the
    blame to the detector's node."""
    tag = attempt_tag(job_id, restart_count, in_job)
    pattern = layout.lost_marker(run_dir, tag, "*")
    head, tail = pattern.name.split("*")
    seen = view.current()
    try:
        names = sorted(n for n in seen.listdir(pattern.parent) if n.startswith(head)
                       and n.endswith(tail))
    except OSError:
        names = []
    found: dict[int, dict[str, Any]] = {}
    for name in names:
        rank = name[len(head):len(name) - len(tail)]
        if not rank.isdigit():
            continue
        try:
            record = json.loads(seen.read_bytes(pattern.parent / name))
        except (OSError, ValueError):
            record = {}
        record = record if isinstance(record, dict) else {}
        # a whole node's marker names every rank on it
        for each in named_ranks(record) or [int(rank)]:
            found[each] = record
    declared = declaration(run_dir, tag)
    if declared is not None and isinstance(declared.get("rank"), int):
        for each in named_ranks(declared):
            if not found.get(each):
                found[each] = {k: v for k, v in declared.items() if k != "attempt"}
    return dict(sorted(found.items()))


def declaration(run_dir: Path | str, tag: str) -> dict[str, Any] | None:
    """The last declaration of a lost rank or node, if it is of the attempt ``tag``
    (:mod:`hpc_ddp.rank.watch.declaration` writes it in place, padded: read up to the first whole
    JSON value)."""
    return declaration_in(layout.declared(run_dir), tag)


def declaration_in(path: Path, tag: str, own: bool = False) -> dict[str, Any] | None:
    """A declaration in ``path``: the run dir's, or (``own``) its relay on a node
    (:mod:`hpc_ddp.rundir.beats`), believed only from a file of this user's, never through a link,
    and with the token in its ``tag``."""
    try:
        if own:
            raw = node_local.read(path, 1 << 16)
            if raw is None:
                return None
        else:
            raw = view.current().read_bytes(path)
        record, _ = json.JSONDecoder().raw_decode(raw.decode().lstrip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("attempt") == tag else None


def padded(record: Mapping[str, Any]) -> bytes:
    """A declaration as written in place: one fixed width, so a second declarer overwrites the first
    whole."""
    text = json.dumps(record, sort_keys=True)
    width = 1024 * (len(text) // 1024 + 1)
    return (text.ljust(width - 1) + "\n").encode()


def named_ranks(record: Mapping[str, Any]) -> list[int]:
    """The ranks a marker or declaration names: ``ranks`` (a whole node) or ``rank``."""
    ranks = record.get("ranks")
    if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
        return list(ranks)
    return [record["rank"]] if isinstance(record.get("rank"), int) else []


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
