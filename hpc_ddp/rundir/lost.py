"""Which ranks an attempt declared lost, and the fence that keeps their later writes out (issue
60): the lost-rank markers in ``RUN_DIR/errors/`` and the run's declaration
(``liveness/declared.json``), read by every reader of the survivors' files. No torch, and no import
of the survivors' files, which read it.

A declared node may still be running: cut off from its peers but not from the run dir, or frozen
and thawed. Its ranks write nothing once they hear their declaration (the writer's side,
:mod:`hpc_ddp.rank.watch.declaration`), but hearing takes a period, and a rank can be stopped
between its last look and its write. So the readers fence too: an offer of a declared rank is never
taken (:meth:`Fence.offers`), and a survivors' snapshot that a declared rank wrote or committed is
not used if its manifest came after the declaration (:meth:`Fence.before`). *After* is decided on
one clock, the file server's: the change time of the marker (or of the declaration) and of the
manifest, never two nodes' wall clocks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout, node_local, view


def markers(run_dir: Path | str, tag: str) -> dict[int, dict[str, Any]]:
    """Every lost-rank marker of the attempt ``tag``, by rank (an unreadable one as ``{}``).

    The listing of ``errors/`` may be another node's cached past on NFS and lack a marker written
    seconds ago; the declaration (``liveness/declared.json``, created before the rendezvous and read
    by name) cannot: the rank it names is always among these, so a stale listing never moves the
    blame to the detector's node."""
    return {rank: record for rank, (record, _) in _marked(run_dir, tag).items()}


def _marked(run_dir: Path | str, tag: str) -> dict[int, tuple[dict[str, Any], float | None]]:
    """rank -> (its marker or the declaration naming it, that file's change time if known)."""
    pattern = layout.lost_marker(run_dir, tag, "*")
    head, tail = pattern.name.split("*")
    seen = view.current()
    try:
        names = sorted(n for n in seen.listdir(pattern.parent) if n.startswith(head)
                       and n.endswith(tail))
    except OSError:
        names = []
    found: dict[int, tuple[dict[str, Any], float | None]] = {}
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
            found[each] = (record, changed(pattern.parent / name))
    declared = declaration(run_dir, tag)
    if declared is not None and isinstance(declared.get("rank"), int):
        when = changed(layout.declared(run_dir))
        for each in named_ranks(declared):
            record, marked_at = found.get(each, ({}, None))
            found[each] = (record or {k: v for k, v in declared.items() if k != "attempt"},
                           _earliest(marked_at, when))
    return dict(sorted(found.items()))


def changed(path: Path) -> float | None:
    """The file server's time of ``path``'s last change (None if it cannot be read): what
    :class:`Fence` compares, one clock for every node."""
    try:
        return view.current().stat(path).st_ctime
    except OSError:
        return None


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class Fence:
    """The ranks declared lost in one attempt, each with when its declaration reached the run dir
    (the file server's clock; None if unknown, which counts as before anything)."""

    declared: Mapping[int, float | None]

    def offers(self, said: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """``said`` without the offers of declared ranks: never taken, whenever written."""
        return [o for o in said if o.get("rank") not in self.declared]

    def before(self, ranks: Iterable[Any], written_at: float | None) -> list[int]:
        """Those of ``ranks`` declared lost before a file of theirs changed at ``written_at``
        (unknown times count as before): what they wrote is not taken."""
        late = []
        for rank in ranks:
            if isinstance(rank, int) and rank in self.declared:
                when = self.declared[rank]
                if when is None or written_at is None or when <= written_at:
                    late.append(rank)
        return sorted(set(late))


def fence(run_dir: Path | str, tag: str) -> Fence:
    """The attempt ``tag``'s fence: one listing of ``errors/``, its markers and the declaration."""
    return Fence({rank: when for rank, (_, when) in _marked(run_dir, tag).items()})


def fence_at(folder: Path) -> Fence:
    """The fence of the attempt whose survivors' files are in ``folder`` (``RUN_DIR/jit/<attempt>``,
    :func:`hpc_ddp.rundir.jit_files.folder`)."""
    return fence(folder.parent.parent, folder.name)


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
