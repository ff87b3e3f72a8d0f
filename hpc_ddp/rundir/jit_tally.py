"""Whether the survivors' set is whole, found once, by whoever completes it (issue 59): linear in
nodes, where every node reading every node's file was quadratic.

A survivors' snapshot of step S is whole when every slice of the state is in some survivor's file
and (with ``per_rank`` objects) every rank's per-rank state of S is held by some survivor. Each
node used to check that by opening every node's file at every change it published (about 2 N^2
opens a failure: half a million at 512 nodes). Now each node adds what its file newly says to the
step's **tally** (``RUN_DIR/jit/<attempt>/tally-S/``) and one **baton** walks the tally's items in
order (the slices, then the ranks in groups of a node's size), moving on while an item is covered
and parking, as a *wait* entry, at the first that is not. Whoever adds to an item where the baton
waits takes it on and walks further; whoever walks past the last item holds a whole set and does
the one full check (:func:`hpc_ddp.rank.salvage.jit_commit.complete`: the fingerprints, the files).
No survivor waits for another, none reads what it need not, and a failure costs the file server a
few operations per node.

Every item is a chain of entries ``s{K}-{J}`` (slice K) or ``r{G}-{J}`` (rank group G), J = 0, 1,
...: each made by an exclusive create (the one operation another node's cache cannot answer
wrongly, :mod:`hpc_ddp.rundir.view`), read only after the create of its name failed (so no node
ever looked it up while it was absent), and never rewritten. The baton's hand-over is an exclusive
create too (``take-...``; ``take-start`` for its first holder, the first survivor that adds anything
to the step's tally, who walks from slice 0). No torch.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import slicing, view
from hpc_ddp.rundir.jit_claims import exclusive
from hpc_ddp.rundir.jit_post import group_size  # noqa: F401 (the tally's own)

# an entry is written just after its exclusive create: a reader that finds it empty looks again
EMPTY_WAIT_S = 2.0
EMPTY_POLL_S = 0.01


@dataclass(frozen=True)
class Fact:
    """One thing a node's file newly says towards a step's set: slice ``index`` written (``kind``
    "s"), or the per-rank states of some ranks of group ``index`` held ("r")."""

    step: int
    kind: str
    index: int
    content: dict[str, Any] = field(hash=False, compare=False)

    @property
    def key(self) -> str:
        return json.dumps([self.step, self.kind, self.index, self.content], sort_keys=True)


@dataclass
class Settled:
    """What this rank's part in the tallies came to: the steps whose set it found whole (it must
    check and commit it), and where it left the baton waiting (step: what the set lacks)."""

    whole: list[int] = field(default_factory=list)
    waiting: dict[int, str] = field(default_factory=dict)


def facts(offers: list[dict[str, Any]], node: int, group: int) -> list[Fact]:
    """What a node's offers say towards the sets: each slice a survivor of it wrote, and for each
    step and rank group the ranks whose per-rank state its survivors hold (an offer names the steps
    it holds of each rank; one of the version before names one step, a number), and which of its
    survivors hold them (``by``: the fence reads it, :func:`settle`)."""
    found: list[Fact] = []
    held: dict[int, dict[int, set[int]]] = {}  # step -> rank -> the survivors that hold its state
    for o in offers:
        written = o.get("written")
        if isinstance(written, dict):
            layout = written["layout"]
            for k in written["entry"].get("slices", []):
                found.append(Fact(int(written["step"]), "s", int(k),
                                  {"node": node, "rank": o.get("rank"), "of": layout["slices"],
                                   "digest": slicing.layout_digest(layout)}))
        for rank, steps in (o.get("blobs") or {}).items():
            for step in steps if isinstance(steps, list) else [steps]:
                held.setdefault(int(step), {}).setdefault(int(rank), set()).add(o.get("rank"))
    for step, ranks in sorted(held.items()):
        for g in sorted({r // group for r in ranks}):
            mine = sorted(r for r in ranks if r // group == g)
            by = sorted({h for r in mine for h in ranks[r] if isinstance(h, int)})
            found.append(Fact(step, "r", g, {"node": node, "ranks": mine, "by": by}))
    return found


def settle(where: Path, new: list[Fact], rank: int, world: int, group: int,
           per_rank: bool, declared: Callable[[], Collection[int]] | None = None,
           ends: dict[str, int] | None = None) -> Settled:
    """Add ``new`` (what this rank's publish of its node's file newly said) to the steps' tallies,
    and walk on with the baton of each step where it came to this rank (a wait entry it passed, or
    the first baton of the step, which the first survivor to add anything takes at slice 0).

    ``declared``: the ranks declared lost in the attempt (:mod:`hpc_ddp.rundir.lost`), asked once
    where a walk found the set whole: if an item was covered by a declared rank's entry, the baton
    walks again from slice 0 past every declared rank's entries and parks where the set lacks a
    survivor's (its word is not taken, issue 60), so the survivor who adds it carries on.

    ``ends``: what this node learnt of the chains before (its node-local memory, updated here): the
    first entry of each item's chain that this node has not seen yet, and whether the step's first
    baton is taken. A node's publishes add to the same items again and again (its groups' states
    come rank by rank); scanning each chain from its start made a node's adds quadratic in them
    (B14-SIM at 8 ranks a node). Entries below it were seen, and their wait entries tried, by this
    node: a chain only grows."""
    settled, ends = Settled(), {} if ends is None else ends
    for step in sorted({f.step for f in new}, reverse=True):
        folder = where / f"tally-{step}"
        taken: tuple[str, int] | None = None
        for fact in sorted((f for f in new if f.step == step), key=lambda f: (f.kind, f.index)):
            key = f"{step}/{fact.kind}{fact.index}"
            took, ends[key] = _add(folder, fact, rank, ends.get(key, 0))
            taken = took or taken
        if taken is None and not ends.get(f"{step}/start") and exclusive(
                folder / "take-start", str(rank).encode()):
            taken = ("s", 0)
        ends[f"{step}/start"] = 1  # taken now, by this rank or another
        if taken is not None:
            groups_of = group if per_rank else 0
            said, authors = _walk(folder, taken, rank, world, groups_of)
            fenced = frozenset(declared()) if said is None and authors and declared else frozenset()
            if authors & fenced:
                said, _ = _walk(folder, ("s", 0), rank, world, groups_of, fenced)
            if said is None:
                settled.whole.append(step)
            else:
                settled.waiting[step] = f"step {step}: {said}"
    return settled


def _add(folder: Path, fact: Fact, rank: int, start: int = 0) -> tuple[tuple[str, int] | None, int]:
    """Append ``fact`` to its item's chain (at its first free entry from ``start``: a chain has no
    gaps); the item if this rank took the baton there (it passed the wait entry where the baton
    stopped), and the chain's next entry after this one."""
    item = f"{fact.kind}{fact.index}"
    data = json.dumps(fact.content).encode()
    taken = None
    for j in count(start):
        if exclusive(folder / f"{item}-{j}", data):
            return taken, j + 1
        entry = _read(folder / f"{item}-{j}")
        if entry is not None and entry.get("wait") is not None and taken is None \
                and exclusive(folder / f"take-{item}-{j}", str(rank).encode()):
            taken = (fact.kind, fact.index)
    return taken, 0  # never reached: count() does not end


def _walk(folder: Path, start: tuple[str, int], rank: int, world: int, groups_of: int,
          skip: frozenset[int] = frozenset()) -> tuple[str | None, set[int]]:
    """Walk the baton from ``start`` over the step's items (its slices, then its rank groups) while
    each is covered; park it at the first that is not (a wait entry at the end of its chain) and say
    what is missing; None once past the last: the set is whole. The step's layout is slice 0's
    first writer's: every slice is covered in that layout or not at all. Entries of the ranks in
    ``skip`` count for nothing; with what was said, the ranks whose entries counted."""
    authors: set[int] = set()
    layout = None if start == ("s", 0) else _layout(folder)
    if layout is None and start != ("s", 0):
        return "the entries of slice 0 could not be read (the tally was tampered with)", authors
    groups = math.ceil(world / groups_of) if groups_of else 0
    wait = json.dumps({"wait": rank}).encode()
    kind, index = start
    while True:
        wanted = (set(range(index * groups_of, min(world, (index + 1) * groups_of)))
                  if kind == "r" else set())
        seen: set[int] = set()
        covered = False
        for j in count():
            if covered or kind == "r" and wanted <= seen:
                break
            if exclusive(folder / f"{kind}{index}-{j}", wait):
                return _missing(kind, index, seen, wanted), authors
            entry = _read(folder / f"{kind}{index}-{j}") or {}
            by = set(entry.get("by", [])) if kind == "r" else {entry.get("rank")}
            if by & skip:
                continue
            if kind == "s" and entry.get("digest") is not None:
                layout = layout or (entry["digest"], int(entry.get("of", 1)))
                covered = entry["digest"] == layout[0]
            seen |= set(entry.get("ranks", [])) if kind == "r" else set()
            authors |= {a for a in by if isinstance(a, int)}
        assert layout is not None  # slice 0 was covered: its first writer's layout is known
        if kind == "s" and index + 1 < layout[1]:
            index += 1
        elif kind == "s" and groups or kind == "r" and index + 1 < groups:
            kind, index = "r", index + 1 if kind == "r" else 0
        else:
            return None, authors


def _layout(folder: Path) -> tuple[str, int] | None:
    """The step's layout (digest, slice count), from slice 0's first written entry: read by name in
    order (a chain has no gaps, and slice 0 was covered before any baton went past it: every name
    read up to that entry exists)."""
    for j in count():
        entry = _read(folder / f"s0-{j}")
        if entry is None:  # not there after all, or not a record: the walk stops here
            return None
        if entry.get("digest") is not None:
            return entry["digest"], int(entry.get("of", 1))
    return None  # never reached: count() does not end


def _missing(kind: str, index: int, seen: set[int], wanted: set[int]) -> str:
    if kind == "s":
        return (f"slice {index} not written (yet) in the layout of slice 0's writer: the nodes "
                "that write it were lost or had not finished (whoever writes it checks on)")
    return (f"no survivor holds the per_rank state of rank(s) {sorted(wanted - seen)} (yet): their "
            "buddies were lost too, or their mirror was more than a step behind")


def _read(path: Path) -> dict[str, Any] | None:
    """An entry, read by name once its create failed (it exists): looked at again while it is empty
    (its writer writes it just after the create), None if it stays empty or is no record."""
    deadline = time.monotonic() + EMPTY_WAIT_S
    while True:
        try:
            raw = view.current().read_bytes(path)
        except OSError:
            return None
        if raw:
            break
        if time.monotonic() > deadline:
            return None
        time.sleep(EMPTY_POLL_S)
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
