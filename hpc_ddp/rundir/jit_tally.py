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
create too (``take-...``, ``take-start`` for its first holder: a writer of slice 0). No torch.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import slicing, view
from hpc_ddp.rundir.jit_claims import exclusive

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


def group_size(world: int, nodes: int) -> int:
    """How many ranks one item of the per-rank tally covers: a node's worth."""
    return max(1, math.ceil(world / max(1, nodes)))


def facts(offers: list[dict[str, Any]], node: int, group: int) -> list[Fact]:
    """What a node's offers say towards the sets: each slice a survivor of it wrote, and for each
    step and rank group the ranks whose per-rank state its survivors hold (an offer names the steps
    it holds of each rank; one of the version before names one step, a number)."""
    found: list[Fact] = []
    held: dict[int, set[int]] = {}
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
                held.setdefault(int(step), set()).add(int(rank))
    for step, ranks in sorted(held.items()):
        for g in sorted({r // group for r in ranks}):
            found.append(Fact(step, "r", g, {"node": node,
                                             "ranks": sorted(r for r in ranks if r // group == g)}))
    return found


def settle(where: Path, new: list[Fact], rank: int, world: int, group: int,
           per_rank: bool) -> Settled:
    """Add ``new`` (what this rank's publish of its node's file newly said) to the steps' tallies,
    and walk on with the baton of each step where it came to this rank."""
    settled = Settled()
    for step in sorted({f.step for f in new}, reverse=True):
        folder = where / f"tally-{step}"
        taken: tuple[str, int] | None = None
        for fact in sorted((f for f in new if f.step == step), key=lambda f: (f.kind, f.index)):
            taken = _add(folder, fact, rank) or taken
        if taken is not None:
            said = _walk(folder, taken, rank, world, group if per_rank else 0)
            if said is None:
                settled.whole.append(step)
            else:
                settled.waiting[step] = f"step {step}: {said}"
    return settled


def _add(folder: Path, fact: Fact, rank: int) -> tuple[str, int] | None:
    """Append ``fact`` to its item's chain; the item where this rank took the baton, if it did
    (a wait entry it passed, or the first baton, for slice 0's first writer)."""
    item = f"{fact.kind}{fact.index}"
    data = json.dumps(fact.content).encode()
    taken = None
    for j in count():
        if exclusive(folder / f"{item}-{j}", data):
            break
        entry = _read(folder / f"{item}-{j}")
        if entry is not None and entry.get("wait") is not None and taken is None \
                and exclusive(folder / f"take-{item}-{j}", str(rank).encode()):
            taken = (fact.kind, fact.index)
    if (fact.kind, fact.index) == ("s", 0) and exclusive(folder / "take-start", str(rank).encode()):
        taken = ("s", 0)
    return taken


def _walk(folder: Path, start: tuple[str, int], rank: int, world: int, groups_of: int) -> str | None:
    """Walk the baton from ``start`` over the step's items (its slices, then its rank groups) while
    each is covered; park it at the first that is not (a wait entry at the end of its chain) and say
    what is missing; None once past the last: the set is whole."""
    # the step's layout: slice 0's first writer's (its entry is there before any baton is: the
    # first is taken by a writer of slice 0 after it wrote, and no wait entry comes before it)
    first = _read(folder / "s0-0") or {}
    digest, slices = first.get("digest"), int(first.get("of", 1))
    groups = math.ceil(world / groups_of) if groups_of else 0
    items = [("s", k) for k in range(slices)] + [("r", g) for g in range(groups)]
    wait = json.dumps({"wait": rank}).encode()
    for kind, index in items[items.index(start):] if start in items else []:
        wanted = (set(range(index * groups_of, min(world, (index + 1) * groups_of)))
                  if kind == "r" else set())
        seen: set[int] = set()
        covered = False
        for j in count():
            if kind == "s" and covered or kind == "r" and wanted <= seen:
                break
            if exclusive(folder / f"{kind}{index}-{j}", wait):
                return _missing(kind, index, seen, wanted)
            entry = _read(folder / f"{kind}{index}-{j}") or {}
            covered = covered or (kind == "s" and entry.get("digest") == digest)
            seen |= set(entry.get("ranks", [])) if kind == "r" else set()
    return None


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
