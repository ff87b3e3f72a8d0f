"""Issue 44, item 1: the failure protocol's shared decisions read through another node's cached view of the run
dir (an NFS client with ``lookupcache=all`` and a 30 s attribute cache, tests/nfs_client.py), with the real
writers: a survivors' snapshot committed on node A and a lost rank declared by node A's liveness thread, then
read on node B, which looked at the run dir before they existed. The committed step is found and never
deleted; the blame stays on the frozen node."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hpc_ddp.rank.watch.liveness import Beat, Liveness
from hpc_ddp.rundir import layout, losses, newest, retention, snapshot, view
from hpc_ddp.rundir.snapshot import steps as snapshot_steps
from hpc_ddp.shell import shell_rules
from tests.nfs_client import CachingClient

TAG = "job-7-restart-0"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _commit(run_dir: Path, step: int, jit: dict[str, Any] | None = None) -> Path:
    directory = snapshot.step_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)  # survivors made it when they claimed the step
    (directory / "jit-00002.pt").write_bytes(b"state" * 20)
    snapshot.commit(directory, step, [{"name": "jit-00002.pt", "size": 100, "sha256": "x", "slices": [0],
                                       "ranks": []}], world_size=4, config_hash="h",
                    extra={"jit": jit} if jit else None)
    return directory


def _everything_verifies(directory: Path, manifest: dict[str, Any]) -> dict[str, str | None]:
    return {name: None for name in manifest["files"]}


def test_a_node_that_looked_before_the_commit_finds_it_keeps_it_and_blames_the_frozen_node(tmp_path: Path) -> None:
    run_dir, clock = tmp_path / "run", Clock()
    newest.create(run_dir)  # rank 0, before the rendezvous of the attempt that fails
    _commit(run_dir, 10)  # a periodic snapshot, long ago
    layout.errors(run_dir).mkdir(parents=True)
    declared = layout.declared(run_dir)
    declared.parent.mkdir(parents=True)
    declared.touch()  # rank 0 created it before the rendezvous too (Liveness.start)

    # node B (rank 0's and the batch shell's) looks, t=0: the step dir lists without step 22, whose manifest
    # a survivor here polled while it was absent; errors/ lists empty
    node_b = CachingClient(clock)
    step_22 = snapshot.step_dir(run_dir, 22)
    step_22.mkdir()
    node_b.looked_at(lookups=[step_22 / snapshot.MANIFEST],
                     listings=[layout.snapshots(run_dir), step_22, layout.errors(run_dir)])

    # node A, t=5: rank 2's liveness thread declares rank 4 (node n3) lost, and the survivors commit step 22
    clock.now = 5.0
    detector = Liveness(run_dir, 7, 0, 0, 3, 8, "n2", 6.0, on_lost=lambda message: None, clock=clock,
                        node_base=tmp_path / "node-local")
    detector._declare(6.5, [4], Beat(TAG, 4, "n3", 41))
    _commit(run_dir, 22, jit={"attempt": TAG, "writer": 2})
    for path in (*step_22.iterdir(), step_22):  # node A's files are as old as the failure, not this test
        os.utime(path, (time.time() - 5, time.time() - 5))

    # node B, t=10: what the next attempt and the batch shell decide, within the cache's 30 s
    clock.now = 10.0
    with view.seen_as(node_b):
        # the seam plays the staleness: by its listings and lookup, step 22 is uncommitted and nobody is lost
        assert snapshot.MANIFEST not in node_b.listdir(step_22) and node_b.listdir(layout.errors(run_dir)) == []
        assert not view.exists(step_22 / snapshot.MANIFEST)
        assert snapshot_steps.read_manifest(step_22) is None

        assert retention.drop_uncommitted(run_dir, clock=lambda: time.time() + 3600) == {}  # named: kept
        assert step_22.exists() and (step_22 / snapshot.MANIFEST).exists()

        # the batch shell first: which node to leave out
        lost = losses.lost_ranks(run_dir, 7, 0, 0)
        assert lost == {4: "n3"}  # from the declaration, read by name: the listing still lacks the marker
        assert node_b.listdir(layout.errors(run_dir)) == []
        blamed = shell_rules.lost_nodes(run_dir, 7, 0, 0, ["n1", "n2", "n3", "n4"], per_node=2)
        assert list(blamed) == ["n3"], blamed  # not n2, the detector's node, whose rank exited first
        # then the next attempt's rank 0
        found = snapshot_steps.committed(run_dir, wait_s=snapshot_steps.NAME_CACHE_S, sleep=clock.sleep)
        assert [step for step, _ in found] == [22, 10]
        assert 10.0 < clock.now <= 10.0 + 30  # read again until the cached absence expired: no longer
        choice = snapshot.choose(run_dir, verify=_everything_verifies, found=found)
        assert choice is not None and choice.step == 22

    assert losses.ledger_fields(run_dir, 7, 0)["lost_ranks"] == [4]


def test_a_withdrawn_newest_step_is_not_waited_for(tmp_path: Path) -> None:
    run_dir, clock = tmp_path / "run", Clock()
    newest.create(run_dir)
    _commit(run_dir, 10)
    step_22 = _commit(run_dir, 22, jit={"attempt": TAG, "writer": 2})
    assert json.loads(newest.path(run_dir).read_text())["step"] == 22
    snapshot.withdraw(step_22, "rank 3 holds another state")
    found = snapshot_steps.committed(run_dir, wait_s=snapshot_steps.NAME_CACHE_S, sleep=clock.sleep)
    assert [step for step, _ in found] == [10] and clock.now == 0.0


def test_the_newest_commit_file_survives_a_full_filesystem_rewrite_in_place(tmp_path: Path) -> None:
    """It is created with its one block written, and each commit rewrites that block: the same size always."""
    newest.create(tmp_path)
    size = newest.path(tmp_path).stat().st_size
    assert newest.read(tmp_path) is None and size == newest.WIDTH
    newest.publish(tmp_path, 123, TAG)
    newest.create(tmp_path)  # a later attempt's rank 0 keeps what it names
    assert newest.read(tmp_path) == {"step": 123, "attempt": TAG}
    assert newest.path(tmp_path).stat().st_size == size


def test_the_newest_commit_file_names_the_newest_step_that_stands_not_the_last_writer(tmp_path: Path) -> None:
    """Issue 57: a commit that comes after a newer one (a survivors' snapshot finished late) no longer takes the
    name back to an older step; once the newer one is withdrawn, the next commit names its own."""
    run_dir = tmp_path / "run"
    _commit(run_dir, 30)
    _commit(run_dir, 22, jit={"attempt": TAG, "writer": 2})
    assert newest.read(run_dir)["step"] == 30
    snapshot.withdraw(snapshot.step_dir(run_dir, 30), "rank 3 holds another state")
    _commit(run_dir, 25)
    assert newest.read(run_dir)["step"] == 25
