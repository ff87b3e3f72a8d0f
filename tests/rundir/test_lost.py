"""The fence (issue 60): once a rank is declared lost, nothing it writes afterwards is taken as an offer or a
commit. Every reader fences: its offers are set aside, and a survivors' snapshot it wrote or committed after its
declaration is not resumed from. *After* is decided on the file server's clock (change times), never on two
nodes' wall clocks."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpc_ddp.rundir import jit_files, jit_offers, layout, lost, snapshot
from hpc_ddp.rundir.ledger import attempt_tag
from hpc_ddp.rundir.snapshot import steps as snapshot_steps

TAG = attempt_tag(5, 0)
ENTRY = {"name": "jit-00001.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []}


def declare(run_dir: Path, ranks: list[int], host: str, tag: str = TAG, marker: bool = True) -> None:
    """A watcher's declaration of ``ranks``, as :class:`hpc_ddp.rank.watch.declaration.Board` posts it: the
    marker (``marker``), then the run's declaration."""
    record = {"rank": ranks[0], "ranks": ranks, "host": host, "by": "node 0's watcher (n0)", "time": 1.0}
    if marker:
        path = layout.lost_marker(run_dir, tag, ranks[0])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    layout.declared(run_dir).parent.mkdir(parents=True, exist_ok=True)
    layout.declared(run_dir).write_bytes(lost.padded({**record, "attempt": tag}))


def commit(run_dir: Path, step: int, writer: int, **jit: object) -> None:
    directory = snapshot.step_dir(run_dir, step)
    directory.mkdir(parents=True)
    snapshot.commit(directory, step, [ENTRY], 4, "h",
                    extra={"jit": {"attempt": TAG, "writer": writer, "fingerprint": 7, **jit}})


def test_the_fence_names_every_declared_rank_and_sets_their_offers_aside(tmp_path: Path) -> None:
    """A whole node's marker names each of its ranks; a declaration whose marker a cached listing lacks still
    counts; a declaration of another attempt does not; offers of ranks not declared are kept."""
    assert lost.fence(tmp_path, TAG).declared == {}
    declare(tmp_path, [2, 3], "n1")
    fence = lost.fence(tmp_path, TAG)
    assert sorted(fence.declared) == [2, 3] and all(isinstance(t, float) for t in fence.declared.values())
    said = [{"rank": r, "source": True} for r in range(4)]
    assert [o["rank"] for o in fence.offers(said)] == [0, 1]
    assert lost.fence(tmp_path, attempt_tag(5, 1)).declared == {}
    declare(tmp_path, [1], "n0", marker=False)  # the declaration alone: the listing is another node's past
    assert sorted(lost.fence(tmp_path, TAG).declared) == [1, 2, 3]


def test_a_write_is_fenced_only_if_it_changed_after_the_declaration_on_the_servers_clock(tmp_path: Path) -> None:
    declare(tmp_path, [2, 3], "n1")
    fence = lost.fence(tmp_path, TAG)
    when = fence.declared[2]
    assert fence.before([2, 0], when + 1.0) == [2]  # a later write of rank 2: fenced; rank 0 was never declared
    assert fence.before([3], when - 1.0) == []  # written before its declaration: taken
    assert fence.before([3], when) == [3]  # one tick of the server's clock: no way to order them, fenced
    assert fence.before([3, None, "2"], None) == [3]  # a time that cannot be read: fenced


def test_rank_0_resumes_from_no_survivors_snapshot_a_declared_rank_wrote_after_its_declaration(
        tmp_path: Path) -> None:
    """Node 1 (ranks 2, 3) was declared lost, thawed, and committed step 60 before it heard of it: rank 0 does
    not resume from it, and says why. Step 50, which rank 2 committed before its declaration, is used."""
    commit(tmp_path, 50, 2)
    time.sleep(0.05)  # the server's clock moves on (file times tick coarsely)
    declare(tmp_path, [2, 3], "n1")
    time.sleep(0.05)
    commit(tmp_path, 60, 0, committer=3, writers={"0": {}, "2": {}})
    warned: list[str] = []
    kept = snapshot_steps.agreed(tmp_path, snapshot_steps.committed(tmp_path), lambda f, *a: warned.append(f % a))
    assert [s for s, _ in kept] == [50]
    assert warned == ["the survivors' snapshot of step 60 is not used: rank(s) [2, 3] wrote or committed it after "
                      "they were declared lost (a cut-off or thawed node's late write)"]


def test_a_declared_ranks_offer_that_disagrees_with_a_commit_is_not_taken_either(tmp_path: Path) -> None:
    """Its word does not count, for or against: the survivors' commit of step 60 stands."""
    where = jit_files.folder(tmp_path, 5, 0)
    commit(tmp_path, 60, 1)
    post = jit_files.Post(where, tmp_path / "node-local" / f"{where.name}-node-1", 3, 1, 1, 2)
    jit_files.offer(post, {"rank": 3, "source": True, "step": 60, "fingerprint": 9})
    manifest = snapshot_steps.read_manifest(snapshot.step_dir(tmp_path, 60))
    assert jit_offers.disagreeing(tmp_path, manifest) == [3]
    declare(tmp_path, [2, 3], "n1")
    assert jit_offers.disagreeing(tmp_path, manifest) == []
