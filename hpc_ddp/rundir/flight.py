"""The flight recorder's dumps: which collective each rank was in when the job hung.

torch keeps the last collectives of every process group in a ring buffer (the flight
recorder; NCCL's groups, and gloo's since torch 2.10, in two recorders: one for CUDA events,
one for the rest), switched on by the variables of
:func:`hpc_ddp.rank.group.distributed.failure_env`. When the hang watchdog fires, every rank takes
that record (:func:`record`) and its node's ranks publish theirs as one JSON file per node in the
run dir's errors/ (:mod:`hpc_ddp.rundir.flight_node`), next to the Python stacks in each rank's
log; ``hpc_ddp.status`` reads the dumps back (:func:`read`) and says which collective the ranks
wait in and which ranks never reached it. NCCL's own watchdog, on a collective timeout, writes its
pickled dump per rank under :func:`prefix` (a backstop that comes after ours).

No torch at import: :func:`summarize` runs on the login node (status).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout
from hpc_ddp.rundir.ledger import attempt_tag

log = logging.getLogger("hpc_ddp.flight")


def prefix(run_dir: Path | str, job_id: int | str | None, restart_count: int, in_job: int) -> str:
    """The prefix NCCL's own watchdog writes its per-rank dump under (``TORCH_FR_DUMP_TEMP_FILE``;
    the rank is appended); older runs' JSON dumps were there too."""
    tag = attempt_tag(job_id, restart_count, in_job)
    return str(layout.errors(run_dir) / f"{tag}-collectives-rank-")


# gloo's (and others') recorder, then NCCL's
READERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")


def record() -> dict[str, Any] | None:
    """This process's flight record, both recorders merged (on a GPU the training group's NCCL
    entries are in one, the gloo control group's in the other: seen on an H100 with torch 2.11);
    None where torch keeps none (an older torch, or a record switched off). Where it goes:
    :mod:`hpc_ddp.rundir.flight_node` (one file per node)."""
    import torch

    c10d = torch._C._distributed_c10d
    records = []
    for name in READERS:
        reader = getattr(c10d, name, None)
        if reader is None:
            continue
        try:
            records.append(json.loads(reader()))
        # the dump is a diagnosis: never let it stop the hang from being recorded
        except Exception as err:
            log.warning("the flight recorder could not be dumped (%s): %s", name, err)
    found = merged(records)
    return found if found.get("entries") else None


def merged(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One record of several recorders' dumps: entries in the order they were created, and each
    recorder's per-group status and config (the groups differ between recorders; the first recorder
    wins a clash)."""
    out: dict[str, Any] = {}
    entries: list[Any] = []
    for record in records:
        entries += list(record.get("entries") or [])
        for key, value in record.items():
            if key == "entries":
                continue
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = {**value, **out[key]}
            else:
                out.setdefault(key, value)
    out["entries"] = sorted(entries, key=lambda e: e.get("time_created_ns", 0)
                            if isinstance(e, Mapping) else 0)
    return out


def read(target_prefix: str) -> dict[int, dict[str, Any]]:
    """Every rank's dump under a prefix, by rank: the per-node files
    (``PREFIX node-N.json``, :mod:`hpc_ddp.rundir.flight_node`) and the per-rank files of older runs
    (``PREFIX R.json``, ``PREFIX rank-R.json``); unreadable ones left out."""
    found: dict[int, dict[str, Any]] = {}
    base = Path(target_prefix)
    for path in sorted(base.parent.glob(base.name + "*.json")):
        rest = path.stem.removeprefix(base.name)
        try:
            data = json.loads(path.read_text())
            if rest.startswith("node-"):
                found.update({int(rank): dump for rank, dump in data["ranks"].items()})
            else:
                found[int(rest.removeprefix("rank-"))] = data
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def _last(record: Mapping[str, Any], group: str) -> tuple[int, str]:
    """(the last collective this rank entered on ``group``, its name)."""
    status = record.get("pg_status", {}).get(group, {})
    seq = int(status.get("last_enqueued_collective", -1))
    name = next((e.get("profiling_name", "?") for e in record.get("entries", [])
                 if str(e.get("pg_id")) == group and e.get("collective_seq_id") == seq
                 and not e.get("is_p2p")), "?")
    return seq, name


def _issued(record: Mapping[str, Any], group: str) -> dict[int, str]:
    """{sequence number: "name [sizes]"} of the collectives this rank issued on ``group`` (as far as
    kept); the name alone where the sizes differ by rank when all is well (:func:`_sized`)."""
    return {int(e["collective_seq_id"]): _said(e)
            for e in record.get("entries", []) if str(e.get("pg_id")) == group
            and not e.get("is_p2p")
            and isinstance(e.get("collective_seq_id"), int)}


def _said(entry: Mapping[str, Any]) -> str:
    name = str(entry.get("profiling_name", "?"))
    if not _sized(name):
        return name
    return f"{name} of " + (", ".join(map(str, entry.get("input_sizes") or [])) or "nothing")


def _sized(name: str) -> bool:
    """Whether every rank gives a collective of this name inputs of one shape: not a scatter or a
    gather (the root's inputs are not the others': a newcomer's status blamed hpc_ddp's own scatter
    for a branch of the program) nor an all_to_all (uneven splits are allowed)."""
    op = name.rpartition(":")[2]
    return not ((op.endswith("scatter") and not op.endswith("reduce_scatter"))
                or (op.endswith("gather") and not op.startswith("all")) or "all_to_all" in op)


def first_mismatch(dumps: Mapping[int, Mapping[str, Any]],
                   ids: Mapping[int, str]) -> tuple[int, dict[str, list[int]]] | None:
    """The first collective number at which the ranks issued different collectives on a group (a
    branch some ranks took and others did not), with the ranks that issued each; None when they
    agree. ``ids``: each rank's id of the group (:func:`groups`)."""
    issued = {rank: _issued(record, ids[rank]) for rank, record in dumps.items()}
    common = set.intersection(*(set(ops) for ops in issued.values())) if issued else set()
    for seq in sorted(common):
        by_op: dict[str, list[int]] = {}
        for rank in sorted(issued):
            by_op.setdefault(issued[rank][seq], []).append(rank)
        if len(by_op) > 1:
            return seq, by_op
    return None


def groups(dumps: Mapping[int, Mapping[str, Any]]) -> dict[str, dict[int, str]]:
    """{a group's name: {rank: that rank's id of it}}. A rank's ``pg_id`` counts the groups it is
    in, so one node's group and the next node's have the same id on their own ranks (issue 57:
    status said "the ranks issued different collectives" across two nodes' groups); the name the
    entries carry (``process_group``) tells them apart. A group with no entry keeps its id."""
    found: dict[str, dict[int, str]] = {}
    for rank, record in dumps.items():
        for pg_id in record.get("pg_status", {}):
            found.setdefault(_name(record, str(pg_id)), {})[rank] = str(pg_id)
    return dict(sorted(found.items()))


def _name(record: Mapping[str, Any], pg_id: str) -> str:
    for entry in record.get("entries", []):
        named = entry.get("process_group") if str(entry.get("pg_id")) == pg_id else None
        if isinstance(named, (list, tuple)) and named and str(named[0]):
            return str(named[0])
    return pg_id


def summarize(dumps: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """One line per process group where the ranks part: the first collective they issued differently
    (some ranks took a branch the others did not), else the collective the furthest ranks wait in
    and the ranks that never reached it (the ones to look at)."""
    lines = []
    for group, ids in groups(dumps).items():
        mismatch = first_mismatch({r: dumps[r] for r in ids}, ids)
        if mismatch is not None:
            seq, by_op = mismatch
            lines.append(f"process group {group}: the ranks issued different collectives at "
                         f"#{seq}: "
                         + "; ".join(f"ranks {_ranks(ranks)} {op}" for op, ranks in by_op.items())
                         + " (a branch only some ranks take, e.g. a forward of the DDP model on "
                           "rank 0 alone: "
                         "docs/troubleshooting.md)")
            continue
        last = {rank: _last(dumps[rank], pg_id) for rank, pg_id in sorted(ids.items())}
        top = max(seq for seq, _ in last.values())
        behind = sorted(rank for rank, (seq, _) in last.items() if seq < top)
        if not behind:
            continue
        waiting = sorted(rank for rank, (seq, _) in last.items() if seq == top)
        name = next(n for r, (s, n) in last.items() if s == top)
        lines.append(f"process group {group}: ranks {_ranks(waiting)} wait in collective #{top} "
                     f"({name}); "
                     f"ranks {_ranks(behind)} never reached it (last: "
                     + ", ".join(f"#{last[r][0]}" for r in behind[:8]) + ")")
    return lines


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16
                                             else "")
