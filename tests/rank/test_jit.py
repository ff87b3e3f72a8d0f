"""A failure costs the step in flight (issue 35): the survivors of a lost rank write a just-in-time snapshot of
the step they hold whole, and the run resumes from it bit-identically; where no consistent source exists it falls
back to the periodic snapshot and the ledger says why. The parts first (what a rank holds whole, the run dir's
claims and offers, derived RNGs), then the real local rehearsal (gloo processes, a node SIGKILLed)."""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpc_ddp.rank.state.rng import reseed
from hpc_ddp.rank.salvage.jit import Held, buffers
from hpc_ddp.rank.salvage.jit_checks import fingerprint
from hpc_ddp.rank.state.tracked import PerRank
from hpc_ddp.rundir import jit_claims, jit_files, jit_offers, layout, retention, slicing, snapshot
from hpc_ddp.rundir.snapshot import steps as snapshot_steps, write as snapshot_write
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.rundir.losses import jit_fields
from tests.helpers import done, losses, submit


def post(where: Path, rank: int, per_node: int = 2) -> jit_files.Post:
    """Rank ``rank``'s post in a job of ``per_node`` ranks a node, its node's folder beside the run dir's."""
    node, local = divmod(rank, per_node)
    return jit_files.Post(where, where.parent.parent / "node-local" / f"{where.name}-node-{node}", rank, node, local,
                          per_node)


def test_a_rank_holds_its_last_step_whole_until_its_optimizer_begins_the_next_update() -> None:
    """Between boundaries the forward changes BatchNorm's buffers, the loop draws a batch (the data position
    moves) and may set the learning rate; the parameters change only in step(). What a snapshot of step k needs
    is copied at boundary k; once step() begins, the rank holds no whole step (the code after it may not run)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    position = {"sample": 0}
    held = Held({"model": model, "optimizer": optimizer, "position": position})
    assert set(buffers(model)) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    held.mark(7)
    marked = {k: v.clone() for k, v in model.state_dict().items()}
    position["sample"] += 8  # the next step draws its batch
    optimizer.param_groups[0]["lr"] = 0.05  # and a schedule set its rate first
    loss = model(torch.randn(8, 4)).sum()
    loss.backward()  # ...and its gradient all-reduce fails here: the live state is still step 7's
    step, state, _ = held.whole()  # type: ignore[misc]
    assert step == 7 and state["step"] == 7 and state["position"] == {"sample": 0}
    assert all(torch.equal(state["model"][k], marked[k]) for k in marked)  # buffers from the copy, params live
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert not torch.equal(model.state_dict()["1.running_mean"], marked["1.running_mean"])  # the forward moved it
    optimizer.step()  # the update began: this rank holds no whole step until its next boundary
    assert "had begun the update after step 7" in str(held.whole())
    held.mark(8)
    assert held.whole()[0] == 8  # type: ignore[index]
    same = fingerprint(held.whole()[1], 8, {})  # type: ignore[index]
    assert same == fingerprint(held.whole()[1], 8, {})  # type: ignore[index]
    with torch.no_grad():
        model[0].weight[0, 0] += 1
    assert fingerprint(held.whole()[1], 8, {}) != same  # type: ignore[index]


def test_survivors_claim_a_step_once_and_the_ledger_learns_what_came_of_it(tmp_path: Path) -> None:
    where = jit_files.folder(tmp_path, 5, 0, 1)
    assert where.name == "job-5-restart-0-step-1"
    assert jit_claims.claim(where, 40) and not jit_claims.claim(where, 40) and jit_claims.claim(where, 41)
    assert jit_fields(tmp_path, 5, 0, 1) == {}  # no survivor said anything
    jit_files.offer(post(where, 2), {"rank": 2, "source": False, "why": "train.rng=saved: ..."})
    assert jit_fields(tmp_path, 5, 0, 1) == {"jit_fallback": "train.rng=saved: ..."}
    from hpc_ddp.rundir import snapshot

    jit_files.offer(post(where, 0), {"rank": 0, "source": True, "step": 40, "host": "n1",
                                     "outcome": "committed step 40"})
    assert "jit_snapshot" not in jit_fields(tmp_path, 5, 0, 1)  # an offer is no commit: the manifest is
    directory = snapshot.step_dir(tmp_path, 40)
    directory.mkdir(parents=True)
    snapshot.commit(directory, 40, [{"name": "jit-00000.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []}],
                    4, "h", extra={"jit": {"attempt": where.name, "writer": 0, "host": "n1", "took_s": 0.1}})
    assert jit_fields(tmp_path, 5, 0, 1) == {"jit_snapshot": {"step": 40, "writer": 0, "host": "n1",
                                                              "took_s": 0.1}}
    assert jit_fields(tmp_path, 5, 1) == {}  # another attempt's snapshot is not this one's
    assert [o["rank"] for o in jit_offers.offers(where, 2)] == [0, 2]  # read by name, node by node
    assert sorted(p.name for p in where.iterdir() if p.name.startswith("node-")) == ["node-0.json", "node-1.json"]


def test_a_snapshot_whose_files_list_their_ranks_has_no_guessed_rng_file() -> None:
    """A just-in-time snapshot's file holds no rank's RNG (they are derived): no rank looks for a node file that
    is not there; a snapshot from before files listed their ranks still finds each rank's by the node blocks."""
    jit = {"files": {"jit-00001.pt": {"ranks": []}}, "world_size": 4, "num_nodes": 1}
    assert slicing.rank_file(jit, 3) is None
    assert slicing.rank_file({"files": {"node-00000.pt": {}, "node-00001.pt": {}}, "world_size": 4,
                              "num_nodes": 2}, 3) == "node-00001.pt"


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_derived_randomness_depends_on_seed_step_and_rank_alone() -> None:
    reseed(0, 40, 1)
    first = draws()
    draws()  # a step's worth of randomness used
    reseed(0, 40, 1)
    assert draws() == first
    assert len({(reseed(s, k, r), draws())[1] for s, k, r in [(0, 40, 1), (1, 40, 1), (0, 41, 1), (0, 40, 2)]}) == 4


LOOP = ["examples/own_loop_gpt.yaml", "--local", "slurm.spare_nodes=1", "train.max_steps=30", "train.log_every=1"]
NO_SNAPSHOTS = ["snapshot.every_steps=null", "snapshot.every_minutes=null"]


@pytest.mark.slow
def test_a_lost_node_costs_no_step_and_the_run_ends_bit_identical(tmp_path: Path) -> None:
    """2 x 2 with dropout, no periodic snapshot at all, node 1 SIGKILLed once rank 0 has finished step 20:
    the survivors write step 20 (or 19, had they not finished it), the spare takes the node's place, and the run
    equals one that never failed, loss for loss."""
    failed = submit(*LOOP, *NO_SNAPSHOTS, f"run_dir={tmp_path / 'failed'}", "--fail-at", "20:1")
    assert failed.returncode == 0, failed.stderr[-3000:]
    straight = submit(*LOOP, *NO_SNAPSHOTS, f"run_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first, second = read_attempts(tmp_path / "failed")
    assert first["reason"] == "failed" and second["reason"] == "finished" and second["in_job"] == 1
    assert second["resumed_from"] >= 19 and first["jit_snapshot"]["step"] == second["resumed_from"], first
    assert first["last_step"] - second["resumed_from"] == 0  # nothing logged was lost
    assert losses(tmp_path / "failed") == losses(tmp_path / "straight")
    assert done(tmp_path / "failed")["params_sha256"] == done(tmp_path / "straight")["params_sha256"]
    status = submit_status(tmp_path / "failed")
    assert "#0: lost 0 step(s)" in status


PER_RANK_LOOP = [*LOOP, "train.loop=tests.tasks.loops:nanogpt_shaped", *NO_SNAPSHOTS]


@pytest.mark.slow
def test_a_lost_nodes_per_rank_state_comes_from_its_buddies_and_the_run_ends_bit_identical(tmp_path: Path) -> None:
    """The issue's case at 4 x 2 (issue 45's): dropout and per_rank objects (a prefetched batch drawn from each
    rank's own RNG, counters, a module of its own), no periodic snapshot, node 1 (ranks 2, 3) SIGKILLed after step
    20: their per-rank state of that step comes from their buddies on node 2 (rank/salvage/mirror.py), and every rank's
    counters, probe and loss equal those of a run that never failed. Per node, not per rank: the survivors' offers
    and per-rank states are one file per node, the state is split over the surviving nodes (a file per writing
    node), and liveness beat one file per node."""
    geometry = ["slurm.nodes=4", "slurm.tasks_per_node=2"]
    failed = submit(*PER_RANK_LOOP, *geometry, f"run_dir={tmp_path / 'failed'}", "--fail-at", "20:1")
    assert failed.returncode == 0, failed.stderr[-3000:]
    straight = submit(*PER_RANK_LOOP, *geometry, f"run_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first, second = read_attempts(tmp_path / "failed")
    assert first["reason"] == "failed" and second["reason"] == "finished" and second["in_job"] == 1
    assert second["resumed_from"] == first["jit_snapshot"]["step"] == first["last_step"] >= 20, first
    step_dir = tmp_path / "failed" / "snapshots" / f"step-{second['resumed_from']:08d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert {int(r) for r in manifest["jit"]["per_rank_from"]} == set(range(8))
    assert {manifest["jit"]["per_rank_from"][str(r)] for r in (2, 3)} <= {4, 5}  # the lost ranks' buddies
    held_by = first["jit_snapshot"]["per_rank_held_by"]  # and the ledger says so (a newcomer found it nowhere)
    assert {"2", "3"} <= set(held_by) and {held_by["2"], held_by["3"]} <= {4, 5}, first
    writers = sorted(f for f in manifest["files"] if f.startswith("jit-node-"))
    assert 2 <= len(writers) <= 3 and "jit-node-00001.pt" not in writers, manifest["files"]  # split, node 1 lost
    assert sorted({s for f in writers for s in manifest["files"][f]["slices"]}) == [0, 1, 2, 3]
    jit = tmp_path / "failed" / "jit" / f"job-{first['job_id']}-restart-0"
    names = sorted(p.name for p in jit.iterdir())
    # one offer file per node, nothing per rank; once the run went on, the tidy settle left the failed attempt
    # its commit claim (the fence) and the offers its kept survivors' snapshot is checked against, not the
    # per-rank blobs (rundir/jit_tidy.py)
    assert names == ["commit", *(f"node-{n}.json" for n in range(4))], names
    assert sorted(p.name for p in (tmp_path / "failed" / "liveness").iterdir()) == [
        "declared.json", "node-0.json", "node-1.json", "node-2.json", "node-3.json"]
    assert losses(tmp_path / "failed") == losses(tmp_path / "straight")
    assert done(tmp_path / "failed") == done(tmp_path / "straight")  # params_sha256 and every rank's own state


def lost_and_straight(tmp_path: Path, loop: str, step: int) -> tuple[dict, dict]:
    """``tests.tasks.loops``'s ``loop`` at 3 x 1 with a spare and no periodic snapshot, run twice: losing node 1
    after ``step`` (in ``failed``), and never stopped (in ``straight``); the failed run's two ledger lines."""
    args = [*LOOP, f"train.loop=tests.tasks.loops:{loop}", *NO_SNAPSHOTS, "slurm.nodes=3", "slurm.tasks_per_node=1"]
    failed = submit(*args, f"run_dir={tmp_path / 'failed'}", "--fail-at", f"{step}:1")
    assert failed.returncode == 0, failed.stderr[-3000:]
    straight = submit(*args, f"run_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first, second = read_attempts(tmp_path / "failed")
    return first, second


@pytest.mark.slow
def test_a_per_rank_batch_tracked_with_mirror_derive_is_rebuilt_after_the_survivors_snapshot(tmp_path: Path) -> None:
    """Issue 59's mirror policy: ``per_rank(batch, mirror="derive")`` is never sent to a buddy, so the survivors'
    snapshot at 3 x 1 (node 1 lost after step 20) holds every rank's mirrored counter but no batch; each rank
    rebuilds its batch from (seed, rank, step), the run ends as one never stopped (losses, counters, batches,
    params_sha256), and the resumed attempt's ledger note says the batch was rebuilt, not restored."""
    first, second = lost_and_straight(tmp_path, "derived_prefetch", 20)
    assert second["resumed_from"] == first["jit_snapshot"]["step"] == first["last_step"] >= 20, first
    manifest = json.loads((tmp_path / "failed" / "snapshots" / f"step-{second['resumed_from']:08d}" /
                           "manifest.json").read_text())
    assert {int(r) for r in manifest["jit"]["per_rank_from"]} == {0, 1, 2}  # the counters: every rank's
    assert "mirror='derive'" in second.get("note", "") and "batch" in second["note"], second
    assert losses(tmp_path / "failed") == losses(tmp_path / "straight")
    ended, uninterrupted = done(tmp_path / "failed"), done(tmp_path / "straight")
    assert any("mirror='derive'" in w for w in ended.pop("warnings")), ended  # DONE.json says it too
    assert ended == {k: v for k, v in uninterrupted.items() if k != "warnings"}


@pytest.mark.slow
def test_a_per_rank_counter_mirrored_every_100_steps_comes_back_older_and_the_ledger_says_so(tmp_path: Path) -> None:
    """Issue 59's third mirror policy: ``per_rank(counters, mirror=100)`` at 3 x 1 is packed and sent to the buddy
    at the resume's boundary (step 0) and not again in 30 steps. Node 1 lost after step 22: the survivors'
    snapshot still commits (each rank's last packed state stands for its step, rank 1's from its buddy), the
    ledger names every rank and the step its state is of, and the run ends with each count short of the steps
    since (a periodic or stop snapshot would pack it afresh), its losses those of a run never stopped."""
    first, second = lost_and_straight(tmp_path, "cadenced_counter", 22)
    step, stale = first["jit_snapshot"]["step"], first["jit_snapshot"].get("per_rank_stale")
    assert second["resumed_from"] == step == first["last_step"] >= 22, first
    assert stale == {"0": 0, "1": 0, "2": 0}, first  # the resume's boundary, every rank's
    said = "rank 0 as of step 0, rank 1 as of step 0, rank 2 as of step 0 (per_rank(..., mirror=N)"
    assert said in second.get("note", ""), second  # the resumed attempt's line, and DONE.json, say it
    ended = done(tmp_path / "failed")
    assert ended["per_rank"] == [30 - step] * 3 and any(said in w for w in ended["warnings"])
    assert done(tmp_path / "straight")["per_rank"] == [30, 30, 30]
    assert losses(tmp_path / "failed") == losses(tmp_path / "straight")


BATCHNORM_LOOP = [*LOOP, "train.loop=tests.tasks.loops:batchnorm", *NO_SNAPSHOTS]


@pytest.mark.slow
def test_a_batchnorm_model_ends_bit_identical_whichever_node_is_lost_and_after_a_periodic_snapshot(
        tmp_path: Path) -> None:
    """BatchNorm with DDP's broadcast_buffers at 3 x 1, every rank on its own data: between two forwards each
    rank's running statistics differ, and the step's are rank 0's. Losing node 0 (rank 0 with it) used to resume
    from a survivor's own statistics: the run drifted from one never stopped (buffers, evaluations, params_sha256).
    Now the boundary hands rank 0's to every rank, so node 0 lost, node 2 lost and a resume from a periodic
    snapshot all end as the uninterrupted run does, loss for loss, evaluation for evaluation, buffers included.
    And the survivors' snapshot is split over the two surviving nodes as for any model (issue 59: one survivor
    used to write a BatchNorm model's whole state alone)."""
    from hpc_ddp.rundir import metrics_file

    geometry = ("slurm.nodes=3", "slurm.tasks_per_node=1")

    def rehearse(name: str, *more: str) -> Path:
        run_dir = tmp_path / name
        proc = submit(*BATCHNORM_LOOP, *geometry, f"run_dir={run_dir}", *more)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return run_dir

    def seen(run_dir: Path) -> tuple[dict[int, float], dict[int, float], dict]:
        evals = {r["step"]: r["eval"] for r in metrics_file.read(run_dir) if "eval" in r}
        return losses(run_dir), evals, {k: v for k, v in done(run_dir).items() if k != "time"}

    straight = seen(rehearse("straight"))
    assert sorted(straight[1]) == [10, 20, 30]
    for node in (0, 2):
        failed = rehearse(f"node{node}", "--fail-at", f"23:{node}")  # not at an evaluation (its forward syncs them)
        first, second = read_attempts(failed)
        assert first["reason"] == "failed" and first["jit_snapshot"]["step"] == second["resumed_from"] >= 22, first
        manifest = json.loads((failed / "snapshots" / f"step-{second['resumed_from']:08d}" / "manifest.json")
                              .read_text())
        writers = sorted(f for f in manifest["files"] if f.startswith("jit-node-"))
        assert writers == [f"jit-node-{n:05d}.pt" for n in range(3) if n != node], manifest["files"]
        assert seen(failed) == straight, f"node {node} lost"
    periodic = rehearse("periodic", "snapshot.jit=false", "snapshot.every_steps=10", "--fail-at", "15:0")
    assert read_attempts(periodic)[1]["resumed_from"] == 10
    assert seen(periodic) == straight


@pytest.mark.slow
def test_without_a_consistent_source_the_run_falls_back_to_the_periodic_snapshot_bit_exact(tmp_path: Path) -> None:
    """train.rng=saved: a lost rank's RNG stream died with it, so no survivor may write a snapshot (it would be a
    mixture); the run resumes from the periodic one, bit-exact, and the ledger says why."""
    saved = ["train.rng=saved", "snapshot.every_steps=10"]
    failed = submit(*LOOP, *saved, f"run_dir={tmp_path / 'failed'}", "--fail-at", "15:1")
    assert failed.returncode == 0, failed.stderr[-3000:]
    straight = submit(*LOOP, *saved, f"run_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first, second = read_attempts(tmp_path / "failed")
    assert "jit_snapshot" not in first and "train.rng=saved" in first["jit_fallback"], first
    assert second["resumed_from"] == 10
    assert done(tmp_path / "failed")["params_sha256"] == done(tmp_path / "straight")["params_sha256"]
    said = submit_status(tmp_path / "failed")
    assert "#0: lost 5 step(s): got to step 15, resumed from 10; no survivors' snapshot: train.rng=saved" in said


def submit_status(run_dir: Path) -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run_dir)], capture_output=True,
                          text=True).stdout


def test_the_manifest_of_a_jit_snapshot_says_who_wrote_it(tmp_path: Path) -> None:
    """Committed through the same function as every snapshot; the extra key rides along."""
    from hpc_ddp.rundir import snapshot

    directory = snapshot.step_dir(tmp_path, 3)
    directory.mkdir(parents=True)
    snapshot.commit(directory, 3, [{"name": "jit-00001.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []}],
                    4, "h", extra={"jit": {"writer": 1}})
    assert json.loads((directory / snapshot.MANIFEST).read_text())["jit"] == {"writer": 1}


def test_a_survivor_that_comes_late_and_holds_another_state_withdraws_the_commit(tmp_path: Path) -> None:
    """The writer waited for the offers it could get; one that came after its commit and differs (a replicated
    dict that differed by rank, seen by a newcomer) takes the snapshot back: never resume from a mixture."""
    from hpc_ddp.rank.salvage.jit_commit import check_commit
    from hpc_ddp.rundir import snapshot

    where = jit_files.folder(tmp_path, 5, 0)
    directory = snapshot.step_dir(tmp_path, 50)
    directory.mkdir(parents=True)
    snapshot.commit(directory, 50, [{"name": "jit-00001.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []}],
                    4, "h", extra={"jit": {"attempt": where.name, "writer": 1, "fingerprint": 7}})
    assert "same fingerprint" in check_commit(tmp_path, where, 50, 50, {"rank": 0, "fingerprint": 7})
    assert snapshot.committed_steps(tmp_path) == [50]
    said = check_commit(tmp_path, where, 50, 50, {"rank": 0, "fingerprint": 8})
    assert said == "withdrew step 50: rank 1 wrote another state than rank 0 holds"
    assert snapshot.committed_steps(tmp_path) == []


def test_rank_0_warns_at_resume_when_a_failure_would_lose_everything(caplog: pytest.LogCaptureFixture) -> None:
    """No survivors' snapshot possible (a per_rank object) and no periodic one: say so before the failure."""
    import logging
    from types import SimpleNamespace

    from hpc_ddp.core.config import RunConfig
    from hpc_ddp.rank.salvage.jit_checks import warn_unprotected

    cfg = RunConfig()
    cfg.snapshot.every_steps, cfg.snapshot.every_minutes = None, None
    run = SimpleNamespace(config=cfg, per_rank={"batch": PerRank({})}, mirror=None, env=SimpleNamespace(is_main=True))
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.jit"):
        warn_unprotected(run)
        cfg.snapshot.every_steps = 10
        warn_unprotected(run)  # a periodic snapshot bounds the loss: nothing to say
    [record] = caplog.records
    assert "would lose every step since the start" in record.getMessage() and "(batch)" in record.getMessage()


def test_the_survivor_whose_offer_completes_the_per_rank_set_commits_it(tmp_path: Path) -> None:
    """Per-rank state: the snapshot is committed by whichever survivor's offer brings the last rank's state of the
    step (none waits for another: a survivor blocked behind a live one could never bring its own), never with a
    rank missing or a step behind, and its per-rank file is what a resumed rank reads back."""
    from types import SimpleNamespace

    from hpc_ddp.rank.salvage.jit_commit import complete
    from hpc_ddp.rank.state.checkpointer import PER_RANK
    from hpc_ddp.rundir import snapshot

    where = jit_files.folder(tmp_path, 5, 0)
    layout = slicing.layout_for([], 1, 1)
    written = {"step": 40, "entry": {"name": "jit-00001.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []},
               "layout": layout}

    def survivor(rank: int, blobs: dict[int, dict[int, bytes]], **more: object) -> str:
        jit_files.write_blobs(post(where, rank), blobs)
        jit_files.offer(post(where, rank), {"rank": rank, "host": "n1", "error": "peer lost", "time": 1.0, "source": True,
                                      "step": 40, "fingerprint": 7,
                                      "blobs": {str(r): list(states) for r, states in blobs.items()}, **more})
        run = SimpleNamespace(env=SimpleNamespace(rank=rank, world_size=4, num_nodes=2), per_rank={"batch": PerRank({})},
                              checkpointer=None, run_dir=tmp_path)
        return complete(run, where)

    said = survivor(1, {1: {40: b"one"}, 3: {40: b"three"}}, written=written)
    assert "per_rank state of rank(s) [0, 2] at step 40" in said and snapshot.committed_steps(tmp_path) == []
    said = survivor(2, {2: {40: b"two"}, 0: {39: b"zero, a step behind"}})
    assert "per_rank state of rank(s) [0] at step 40" in said and snapshot.committed_steps(tmp_path) == []
    assert survivor(0, {0: {40: b"zero"}, 2: {40: b"two"}}) == "committed step 40"
    assert survivor(3, {3: {40: b"three"}}) == "step 40 committed by another survivor"
    manifest = snapshot_steps.read_manifest(snapshot.step_dir(tmp_path, 40))
    ranks_file = jit_files.ranks_file_name(40, 0)  # rank 0 committed
    assert manifest is not None and manifest["jit"]["per_rank_from"] == {"0": 0, "1": 1, "2": 2, "3": 1}
    assert [slicing.rank_file(manifest, r) for r in range(4)] == [ranks_file] * 4
    held = snapshot.load_file(snapshot.step_dir(tmp_path, 40) / ranks_file)["rng"]
    assert {r: entry[PER_RANK] for r, entry in held.items()} == {0: b"zero", 1: b"one", 2: b"two", 3: b"three"}


def per_rank_state(rank: int, step: int) -> bytes:
    return f"rank {rank}'s per_rank state of step {step}".encode()


def states_of(rank: int, *steps: int) -> dict[int, bytes]:
    """What a survivor holds of ``rank``: its states of ``steps``, newest first (rank/salvage/mirror.py's held)."""
    return {step: per_rank_state(rank, step) for step in steps}


def two_step_survivors(tmp_path: Path) -> Any:
    """Survivors of a 2 x 3 job whose node 1 (ranks 3, 4, 5) was lost, each offering the step it holds whole and
    its per-rank states (its own and its ward's, rank r + 3: :func:`hpc_ddp.rank.salvage.mirror.ward_of`);
    ``writes``: it writes the replicated state of its step (the first source of that step). Returns what its
    check of the set said (:func:`hpc_ddp.rank.salvage.jit_commit.complete`)."""
    from types import SimpleNamespace

    from hpc_ddp.rank.salvage.jit_commit import complete

    where = jit_files.folder(tmp_path, 5, 0)

    def survivor(rank: int, step: int, blobs: dict[int, dict[int, bytes]], writes: bool) -> str:
        jit_files.write_blobs(post(where, rank, 3), blobs)
        # its part done (an outcome): a node's ranks still at theirs leave their per-rank states to the last one
        offer: dict[str, Any] = {"rank": rank, "host": "n0", "error": "peer lost", "time": 1.0, "source": True,
                                 "step": step, "fingerprint": step * 7, "outcome": "its part done",
                                 "blobs": {str(r): list(states) for r, states in blobs.items()}}
        if writes:
            offer["written"] = {"step": step, "layout": slicing.layout_for([], 1, 1), "entry": {
                "name": f"jit-{step}.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []}}
        jit_files.offer(post(where, rank, 3), offer)
        run = SimpleNamespace(env=SimpleNamespace(rank=rank, world_size=6, num_nodes=2), per_rank={"batch": PerRank({})},
                              checkpointer=None, run_dir=tmp_path)
        return complete(run, where)

    return survivor


def test_survivors_at_two_steps_complete_the_older_one_from_the_states_of_the_boundary_before(tmp_path: Path) -> None:
    """Issue 55 ("Why 5"): node 1 froze inside a ring all-reduce that had completed for some survivors: ranks 0 and
    2 passed boundary 339, rank 1 is still at 338 (it writes 338, rank 0 writes 339), and rank 5's last message
    was of 338. With one boundary held each, no step was whole and the run fell back to step 0. Every survivor
    now holds its own state and its ward's of their last two boundaries: step 339 lacks ranks 1, 4 and 5, and
    step 338 is committed with every rank's state of 338, each from its own copy or, for a lost rank, its
    buddy's; the survivors' files hold both steps."""
    from hpc_ddp.rank.state.checkpointer import PER_RANK
    from hpc_ddp.rundir import jit_blobs

    survivor = two_step_survivors(tmp_path)
    said = survivor(1, 338, {1: states_of(1, 338, 337), 4: states_of(4, 338, 337)}, writes=True)
    assert "per_rank state of rank(s) [0, 2, 3, 5] at step 338" in said, said
    said = survivor(0, 339, {0: states_of(0, 339, 338), 3: states_of(3, 339, 338)}, writes=True)
    assert ("per_rank state of rank(s) [1, 2, 4, 5] at step 339" in said
            and "per_rank state of rank(s) [2, 5] at step 338" in said), said
    assert survivor(2, 339, {2: states_of(2, 339, 338), 5: states_of(5, 338, 337)}, writes=False) == \
        "committed step 338"
    assert snapshot.committed_steps(tmp_path) == [338]
    where = jit_files.folder(tmp_path, 5, 0)
    assert jit_blobs.read_blobs(where, 0)[0] == {0: states_of(0, 339, 338), 3: states_of(3, 339, 338)}
    manifest = snapshot_steps.read_manifest(snapshot.step_dir(tmp_path, 338))
    assert manifest is not None and manifest["jit"]["sources"] == [1]
    assert manifest["jit"]["per_rank_from"] == {"0": 0, "1": 1, "2": 2, "3": 0, "4": 1, "5": 2}
    ranks_file = snapshot.step_dir(tmp_path, 338) / jit_files.ranks_file_name(338, 2)  # rank 2 committed
    held = snapshot.load_file(ranks_file)["rng"]
    assert {r: entry[PER_RANK] for r, entry in held.items()} == {r: per_rank_state(r, 338) for r in range(6)}


def test_survivors_at_two_steps_commit_neither_when_a_rank_of_the_older_is_held_by_nobody(tmp_path: Path) -> None:
    """As above, but rank 5's state of 338 never left it (replaced by 339's while 337's was on its way): its buddy
    holds 339 and 337. Neither step is whole, nothing is committed, and the reason names the ranks and step
    of each."""
    survivor = two_step_survivors(tmp_path)
    survivor(1, 338, {1: states_of(1, 338, 337), 4: states_of(4, 338, 337)}, writes=True)
    survivor(0, 339, {0: states_of(0, 339, 338), 3: states_of(3, 339, 338)}, writes=True)
    said = survivor(2, 339, {2: states_of(2, 339, 338), 5: states_of(5, 339, 337)}, writes=False)
    assert said.startswith("not committed: ") and snapshot.committed_steps(tmp_path) == []
    assert "no survivor holds the per_rank state of rank(s) [1, 4] at step 339" in said, said
    assert "no survivor holds the per_rank state of rank(s) [5] at step 338" in said, said


def test_per_rank_state_files_and_offers_of_the_version_before_read_as_one_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run dir written before issue 55 holds one state per rank (``{rank: [step, bytes]}``, an offer's
    ``{rank: step}``): it reads as that one step. A step whose bytes are not bytes is missing, with a warning."""
    from hpc_ddp.rank.salvage.jit_commit import _holders
    from hpc_ddp.rundir import jit_blobs

    (tmp_path / "blobs-node-0.pt").write_bytes(_saved({1: {1: [40, b"one"], 3: [40, b"three"]}}))
    held = jit_blobs.read_blobs(tmp_path, 0)
    assert held == {1: {1: {40: b"one"}, 3: {40: b"three"}}}
    assert jit_blobs.blob_of(held, 1, 3, 40) == b"three" and jit_blobs.blob_of(held, 1, 3, 39) is None
    (tmp_path / "blobs-1.pt").write_bytes(_saved({"holder": 1, "blobs": {1: [40, b"one"], 3: {40: "not bytes"}}}))
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.jit"):
        assert jit_blobs.survivor_file(tmp_path / "blobs-1.pt") == (1, {1: {40: b"one"}})
    assert "not {step: bytes}" in caplog.text
    offers = [{"rank": 1, "blobs": {"1": 40, "3": 40}}, {"rank": 0, "blobs": {"0": [41, 40], "2": [41, 40]}}]
    assert _holders(offers, 40) == {0: 0, 1: 1, 2: 0, 3: 1} and _holders(offers, 41) == {0: 0, 2: 0}


@pytest.mark.slow
def test_random_kill_points_lose_no_step_where_a_consistent_source_exists(tmp_path: Path) -> None:
    """B11's property at three random points (the benchmark has 30: benchmarks/lost.py), with per_rank objects
    mirrored: node 1 SIGKILLed at a random step and a random point inside the next step; every run ends identical
    to the uninterrupted one (parameters and every rank's own state), and where the survivors wrote a snapshot
    nothing was lost. Each step computes 0.1 s before its forward, as a GPU's would: a kill between a lost rank's
    gradient all-reduce and its boundary (the optimizer update, the prefetch) cannot be covered and falls back,
    and in the bare 13 ms steps of this loop that window is 40% of the step (B11-PER-RANK)."""
    from benchmarks.lost import b11

    result = b11(tmp_path, trials=3, seed=35, per_rank=True, compute_s=0.1)
    assert result["completed"] == 3 and result["exact"] == 3, result["rows"]
    assert all(r["lost"] == 0 for r in result["rows"] if r["jit"]), result["rows"]
    assert result["jit_written"] >= 1, result["rows"]  # not vacuous: a source existed somewhere
    assert not any(r["uncommitted"] for r in result["rows"]), result["rows"]  # a set left incomplete is removed


def test_the_rehearsal_waits_for_a_survivor_still_at_its_snapshot(tmp_path: Path) -> None:
    """srun waits KillWait (30 s by default) after its SIGTERM, the rehearsal 3 s: long enough for its ranks to
    leave, not for a survivor writing a GB (B13 saw one killed at 866 MB of 1 GB). While a source's offer has no
    outcome yet, the rehearsal waits as srun does."""
    where = jit_files.folder(tmp_path, 5, 0)
    assert not jit_offers.writing(tmp_path, 5, 0)
    jit_files.offer(post(where, 0), {"rank": 0, "source": False, "why": "mid-update"})
    jit_files.offer(post(where, 1), {"rank": 1, "source": True, "step": 8})
    assert jit_offers.writing(tmp_path, 5, 0)
    jit_files.offer(post(where, 1), {"rank": 1, "source": True, "step": 8, "outcome": "committed step 8"})
    assert not jit_offers.writing(tmp_path, 5, 0)


def test_an_attempt_starts_by_dropping_step_directories_that_were_never_committed(tmp_path: Path) -> None:
    """A survivors' snapshot whose set never completed left jit-*.pt behind, newer than every commit, and prune
    (which keeps what is newer than the newest commit) never removed it. A manifest, readable or not, keeps
    its step: resume explains why it skips a damaged one, and those files are the evidence."""
    def step_with(step: int, manifest: str | None) -> Path:
        directory = snapshot.step_dir(tmp_path, step)
        directory.mkdir(parents=True)
        (directory / "jit-00001.pt").write_bytes(b"x" * 100)
        if manifest is not None:
            (directory / snapshot.MANIFEST).write_text(manifest)
        return directory

    committed = step_with(40, None)
    snapshot.commit(committed, 40, [{"name": "jit-00001.pt", "size": 100, "sha256": "x", "slices": [0],
                                     "ranks": []}], world_size=2, config_hash="h")
    older, newer, damaged = step_with(30, None), step_with(41, None), step_with(50, "{not json")
    (layout.snapshots(tmp_path) / "step-notes").mkdir()
    # written seconds ago: another node's manifest may not be visible here yet (an NFS client's cached absence),
    # so it stays; once older than the bound, its own listing without a manifest is the truth
    fresh = step_with(60, None)
    for directory in (committed, older, newer, damaged):
        for path in (*directory.iterdir(), directory):
            os.utime(path, (time.time() - 3600, time.time() - 3600))
    assert retention.drop_uncommitted(tmp_path) == {30: 100, 41: 100}
    assert committed.exists() and damaged.exists() and not older.exists() and not newer.exists() and fresh.exists()
    assert (layout.snapshots(tmp_path) / "step-notes").exists()
    assert retention.drop_uncommitted(tmp_path) == {}
    assert retention.drop_uncommitted(tmp_path, clock=lambda: time.time() + retention.UNCOMMITTED_AGE_S + 1) == {
        60: 100}


def _one_rank_run(tmp_path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """What jit.after_failure reads of a run, for one rank of two (the other one lost), no per_rank objects."""
    from types import SimpleNamespace

    from hpc_ddp.core.config import RunConfig

    tracked = {"model": model, "optimizer": optimizer}
    env = SimpleNamespace(rank=1, world_size=2, job_id=5, restart_count=0, in_job=0, is_main=False, node_rank=1,
                          num_nodes=2, local_rank=0, local_world_size=1)
    return SimpleNamespace(held=Held(tracked), tracked=tracked, env=env, run_dir=tmp_path, config=RunConfig(),
                           per_rank={}, mirror=None, checkpointer=None)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_survivors_snapshot_written_while_the_training_thread_goes_on_is_never_committed_torn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A false alarm: the liveness thread writes what the rank holds while the training thread trains on. Its
    boundary used to reset the update count that the write checked afterwards, so parameters half-way to step 8
    could be committed as step 7 with a matching sha256. The write keeps the mark it read and asks after its last
    byte whether the update after it began (rank/salvage/device_clock.intact): a write during which the training
    went on is not committed, and one during which it did not is committed and equals step 7."""
    import threading

    from hpc_ddp.rank.salvage import jit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = _one_rank_run(tmp_path / "torn", model, optimizer)
    run.held.mark(7)
    at_7 = {k: v.clone() for k, v in model.state_dict().items()}
    real_write = snapshot_write.write_node_file

    def training_goes_on(*args: Any, **kwargs: Any) -> Any:  # the training thread runs while the bytes are written
        _train_step(model, optimizer)
        run.held.mark(8)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(snapshot_write, "write_node_file", training_goes_on)
    side = threading.Thread(target=lambda: setattr(run, "offer", jit.after_failure(run, RuntimeError("peer lost"))))
    side.start()
    side.join()
    assert "training went on" in run.offer["outcome"] and snapshot.committed_steps(run.run_dir) == []

    monkeypatch.setattr(snapshot_write, "write_node_file", real_write)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = _one_rank_run(tmp_path / "whole", model, optimizer)
    run.held.mark(7)
    model(torch.randn(8, 4))  # the next step's forward moved the running statistics; no update began
    assert jit.after_failure(run, RuntimeError("peer lost"))["outcome"] == "committed step 7"
    state = snapshot.read_state(snapshot.choose(run.run_dir))[0]  # type: ignore[arg-type]
    assert state["step"] == 7 and all(torch.equal(state["model"][k], v) for k, v in at_7.items())


class _BroadcastsBuffers(torch.nn.Module):
    """Stands for DistributedDataParallel(broadcast_buffers=True) in a unit test: no process group."""
    broadcast_buffers = True

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)  # type: ignore[no-any-return]


def test_rank_0_lost_before_the_boundarys_buffer_broadcast_leaves_no_step_to_write_but_a_fallback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B11-BN caught it (1 trial of 20 not bit-identical): rank 0 was killed inside boundary 25, after the
    survivors marked step 25 and before DDP's broadcast made rank 0's BatchNorm statistics theirs. A survivor
    then wrote step 25 with its own statistics, a mixture. Now no survivor writes that step (the run falls back
    and says why); once the broadcast finished, the step is whole on every rank and is written."""
    from hpc_ddp.rank.salvage import jit
    from hpc_ddp.rank.state import ddp_settle

    monkeypatch.setattr(ddp_settle, "DistributedDataParallel", _BroadcastsBuffers)  # what ddp_in takes for DDP
    torch.manual_seed(0)
    model = _BroadcastsBuffers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = _one_rank_run(tmp_path / "unsynced", model, optimizer)
    _train_step(model, optimizer)
    run.held.mark(25)  # rank 1's own statistics: rank 0's broadcast never came
    offer = jit.after_failure(run, RuntimeError("peer lost"))
    assert offer["source"] is False and "mix this rank's own statistics" in offer["why"], offer
    assert snapshot.committed_steps(run.run_dir) == [] and not snapshot.step_dir(run.run_dir, 25).exists()

    run = _one_rank_run(tmp_path / "synced", model, optimizer)
    run.held.mark(25)
    run.held.synced()  # the broadcast finished: these statistics are rank 0's
    assert jit.after_failure(run, RuntimeError("peer lost"))["outcome"] == "committed step 25"


def test_one_failure_handler_per_process_whichever_thread_comes_first() -> None:
    """The training, liveness and watchdog threads may each start the survivors' snapshot: the first writes, a
    later one waits for it and returns what it did, and never writes the same files over it."""
    import threading

    from hpc_ddp.rank.salvage.jit import OneHandler

    calls: list[str] = []
    release = threading.Event()

    def handler(error: BaseException) -> dict[str, Any]:
        calls.append(str(error))
        release.wait(5)
        return {"outcome": f"committed after {error}"}

    class Watched(threading.Event):
        """The handler's end, telling when a caller waits for it (threads ordered by events, not sleeps)."""

        def __init__(self) -> None:
            super().__init__()
            self.waited = threading.Event()

        def wait(self, timeout: float | None = None) -> bool:
            self.waited.set()
            return super().wait(timeout)

    once = OneHandler(handler, wait_s=10)
    once._done = done = Watched()
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(once(RuntimeError("liveness"))))
    first.start()
    while not calls:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: results.append(once(RuntimeError("training"))))
    second.start()
    assert done.waited.wait(5) and not done.is_set()  # the second waits for the first write, still running
    release.set()
    first.join(5)
    second.join(5)
    assert calls == ["liveness"] and results == [{"outcome": "committed after liveness"}] * 2


def test_what_a_rank_holds_follows_reassigned_buffers_new_groups_and_tensor_rates() -> None:
    """References taken once went stale: a buffer reassigned after resume (module.to, a user's assignment), a
    parameter group added (progressive unfreezing), a tensor learning rate that a scheduler updates in place."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=torch.tensor(0.1))
    held = Held({"model": model, "optimizer": optimizer})
    held.mark(1)
    model[1].running_mean = torch.full((4,), 3.0)  # a new tensor: the old reference would miss it
    held.mark(2)
    model(torch.randn(8, 4))  # moves the new running_mean
    assert torch.equal(held.whole()[1]["model"]["1.running_mean"], torch.full((4,), 3.0))  # type: ignore[index]
    optimizer.param_groups[0]["lr"].fill_(0.05)  # a scheduler's in-place update after the boundary
    assert torch.equal(held.whole()[1]["optimizer"]["param_groups"][0]["lr"], torch.tensor(0.1))  # type: ignore[index]
    optimizer.add_param_group({"params": list(model[2].parameters()), "lr": torch.tensor(0.01)})
    assert "a group was added since" in str(held.whole())
    held.mark(3)
    step, state, _ = held.whole()  # type: ignore[misc]
    assert step == 3 and [g["params"] for g in state["optimizer"]["param_groups"]] == [[0, 1], [2, 3]]
    optimizer.load_state_dict(state["optimizer"])  # what a resume does with it


def test_a_gradscalers_state_is_held_without_a_device_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """GradScaler.state_dict() calls .item() twice, a GPU sync at every boundary under fp16: its scale and growth
    tracker are cloned as tensors at the boundary and read back only when a snapshot is written."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held = Held({"model": model, "optimizer": optimizer, "scaler": scaler})
    held.mark(0)  # not used yet: plain numbers
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    expected = scaler.state_dict()

    def synced(*args: Any) -> None:
        raise AssertionError("GradScaler.state_dict() at a boundary: a device sync")

    monkeypatch.setattr(type(scaler), "state_dict", synced)
    held.mark(1)
    scaler._scale.mul_(2)  # what the next step's update may do in place
    assert held.whole()[1]["scaler"] == expected  # type: ignore[index]


def _garbage(good: bytes, kind: str) -> bytes:
    return {"pickle": b"\x80\x02garbage", "text": b"hello world", "empty": b"", "truncated": good[:len(good) // 2],
            "wrong shape": _saved({1: "not a holder's states", "x": {}})}[kind]


def _saved(value: object) -> bytes:
    import io

    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


@pytest.mark.parametrize("kind", ["pickle", "text", "empty", "truncated", "wrong shape"])
def test_a_garbage_per_rank_state_file_is_a_missing_source_named_in_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    """Issue 61: the survivors read per-rank state files other ranks wrote; one that is garbage raised
    UnpicklingError (or KeyError, EOFError) out of the commit. Now a warning names the file, its states count as
    missing, and the commit falls back as for a lost source; the other files are read as before."""
    from types import SimpleNamespace

    from hpc_ddp.rank.salvage.jit_commit import complete
    from hpc_ddp.rundir import jit_blobs

    where = jit_files.folder(tmp_path, 5, 0)
    written = {"step": 40, "entry": {"name": "jit-00001.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []},
               "layout": slicing.layout_for([], 1, 1)}

    def survivor(rank: int, blobs: dict[int, dict[int, bytes]], **more: object) -> str:
        jit_files.offer(post(where, rank), {"rank": rank, "host": "n1", "error": "peer lost", "time": 1.0,
                                            "source": True, "step": 40, "fingerprint": 7,
                                            "blobs": {str(r): list(states) for r, states in blobs.items()}, **more})
        run = SimpleNamespace(env=SimpleNamespace(rank=rank, world_size=4, num_nodes=2), per_rank={"batch": PerRank({})},
                              checkpointer=None, run_dir=tmp_path)
        return complete(run, where)

    # a survivor's file on its node: rank 0's is garbage, rank 1's (the same node) is read
    jit_files.write_blobs(post(where, 1), {1: {40: b"one"}, 3: {40: b"three"}})
    assert "per_rank state of rank(s) [0, 2] at step 40" in survivor(1, {1: {40: b"one"}, 3: {40: b"three"}},
                                                                     written=written)
    jit_files.write_blobs(post(where, 0), {0: {40: b"zero"}})
    local = post(where, 0).local / "blobs-0.pt"
    local.write_bytes(_garbage(local.read_bytes(), kind))
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.jit"):
        said = survivor(0, {0: {40: b"zero"}})
    assert "per_rank state of rank(s) [2] at step 40" in said, said
    assert str(local) in caplog.text and "treated as missing" in caplog.text
    assert jit_blobs.read_blobs(where, 0) == {1: {1: {40: b"one"}, 3: {40: b"three"}}}
    # the node's file in the run dir, which another node's survivor reads to commit
    node_file = where / "blobs-node-0.pt"
    node_file.write_bytes(_garbage(node_file.read_bytes(), kind))
    caplog.clear()
    jit_files.write_blobs(post(where, 2), {2: {40: b"two"}, 0: {40: b"zero"}})
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.jit"):
        said = survivor(2, {2: {40: b"two"}, 0: {40: b"zero"}})
    assert said == ("not committed: the files holding the per_rank state of rank(s) [0, 1, 3] at step 40 could "
                    "not be read"), said
    assert str(node_file) in caplog.text and snapshot.committed_steps(tmp_path) == []
    assert not (where / jit_claims.COMMIT_CLAIM).exists()  # read before the claim: a later survivor may still commit


def test_a_damaged_file_of_the_per_rank_state_skips_its_step_for_the_one_before(tmp_path: Path) -> None:
    """A survivors' snapshot keeps every rank's per_rank state in one file, its only copy. When that file no longer
    verifies, resuming from the step used to end the run as a configuration error (exit 2, never requeued) while
    the periodic snapshot before it was intact: the step is now skipped, as one with a bad slice is. Without
    per_rank objects a rank's RNG is reseeded and the step stays usable."""
    import hashlib

    def step(number: int, files: dict[str, list[int]]) -> Path:
        directory = snapshot.step_dir(tmp_path, number)
        directory.mkdir(parents=True)
        entries = []
        for name, ranks in files.items():
            data = f"{name} of step {number}".encode()
            (directory / name).write_bytes(data)
            entries.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                            "slices": [] if name.startswith("jit-ranks") else [0], "ranks": ranks})
        snapshot.commit(directory, number, entries, 2, "h", split=slicing.layout_for([], 1, 1))
        return directory

    step(10, {"node-00000.pt": [0, 1]})
    ranks_file = jit_files.ranks_file_name(20, 1)
    assert ranks_file == "jit-ranks-00000020-by-00001.pt"  # named after its committer: two never share a name
    (step(20, {"jit-00001.pt": [], ranks_file: [0, 1]}) / ranks_file).write_bytes(b"damaged")
    warned: list[str] = []
    choice = snapshot.choose(tmp_path, ranks_needed=2, warn=lambda f, *a: warned.append(f % a))
    assert choice is not None and choice.step == 10
    assert any("per_rank state of rank(s) [0, 1]; trying the one before" in w for w in warned), warned
    assert snapshot.choose(tmp_path, warn=lambda *a: None).step == 20  # type: ignore[union-attr]


def test_every_source_compares_and_a_withdrawn_step_is_marked_in_the_file_a_cache_still_shows(tmp_path: Path) -> None:
    """The fingerprint check is made: a source that lost the claim compares with the commit once it is there
    (it used to say "committed by another survivor" unseen); a withdraw marks the manifest's own file before it
    renames it, so a node whose cache still maps the name to that file (played by a hard link) reads no
    manifest; and an offer that disagrees with a commit nobody withdrew keeps rank 0 from resuming from it."""
    from hpc_ddp.rank.salvage.jit_commit import claimed_by_another

    where = jit_files.folder(tmp_path, 5, 0)
    directory = snapshot.step_dir(tmp_path, 50)
    directory.mkdir(parents=True)
    snapshot.commit(directory, 50, [{"name": "jit-00001.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []}],
                    4, "h", extra={"jit": {"attempt": where.name, "writer": 1, "fingerprint": 7}})
    cached = tmp_path / "another-nodes-view"
    cached.mkdir()
    os.link(directory / snapshot.MANIFEST, cached / snapshot.MANIFEST)
    assert claimed_by_another(tmp_path, 50, where, {"rank": 2, "fingerprint": 7}) == \
        "step 50 committed by another survivor (same fingerprint)"
    said = claimed_by_another(tmp_path, 50, where, {"rank": 0, "fingerprint": 8})
    assert said == "withdrew step 50: rank 1 wrote another state than rank 0 holds"
    assert snapshot.committed_steps(tmp_path) == [] and snapshot_steps.read_manifest(cached) is None
    assert "rank 0 holds another state" in json.loads((cached / snapshot.MANIFEST).read_text())["withdrawn"]

    other = snapshot.step_dir(tmp_path, 60)  # committed, and a disagreeing offer came after every survivor's look
    other.mkdir(parents=True)
    snapshot.commit(other, 60, [{"name": "jit-00001.pt", "size": 1, "sha256": "x", "slices": [0], "ranks": []}],
                    4, "h", extra={"jit": {"attempt": where.name, "writer": 1, "fingerprint": 7}})
    jit_files.offer(post(where, 1), {"rank": 1, "source": True, "step": 60, "fingerprint": 7})
    assert [s for s, _ in snapshot_steps.agreed(tmp_path, snapshot_steps.committed(tmp_path))] == [60]
    jit_files.offer(post(where, 3), {"rank": 3, "source": True, "step": 60, "fingerprint": 9})
    warned: list[str] = []
    assert snapshot_steps.agreed(tmp_path, snapshot_steps.committed(tmp_path), lambda f, *a: warned.append(f % a)) == []
    assert "rank(s) [3] offered another state of it than its writer, rank 1" in warned[0]


def test_a_side_threads_failure_action_is_bounded_whatever_the_write_waits_for() -> None:
    """On a GPU a read of the state can queue behind a wedged collective's kernel forever: the liveness or
    watchdog thread's survivors' snapshot runs in a thread of its own, and the side thread goes on to exit
    when its bound passes; a later caller waits no longer than its own bound either."""
    import threading

    from hpc_ddp.rank.salvage.jit import OneHandler

    wedged = threading.Event()
    once = OneHandler(lambda error: wedged.wait(30) and {"outcome": "late"}, wait_s=0.3)
    assert once(RuntimeError("peer lost"), wait_s=0.2) is None  # the liveness thread: no outcome, but it returns
    assert once(RuntimeError("collective failed")) is None  # the training thread, freed later: bounded too
    assert not wedged.is_set() and not once._done.is_set()  # both returned while the write still waited
    wedged.set()


def split_writer(run_dir: Path, where: Path, rank: int, node: int, cut: dict[str, Any]) -> str:
    """Rank ``rank`` (alone on node ``node`` of 3) writes its node's share of step 40 in the layout ``cut``,
    offers it, and completes the set if it can: what :func:`complete` said."""
    from types import SimpleNamespace

    from hpc_ddp.rank.salvage.jit_commit import complete

    written = {"step": 40, "layout": cut, "took_s": 0.5,
               "entry": {"name": jit_files.node_file_name(node), "size": 1, "sha256": "x",
                         "slices": slicing.slices_of(node, 3, 2), "ranks": []}}
    jit_files.offer(post(where, rank, per_node=1), {"rank": rank, "host": f"n{node}", "error": "peer lost",
                                                     "time": 1.0, "source": True, "step": 40, "fingerprint": 7,
                                                     "written": written})
    run = SimpleNamespace(env=SimpleNamespace(rank=rank, world_size=3, num_nodes=3), per_rank={},
                          checkpointer=None, run_dir=run_dir)
    return complete(run, where)


def test_a_survivors_snapshot_split_over_the_nodes_is_committed_once_every_slice_is_written(tmp_path: Path) -> None:
    """Issue 45: each surviving node writes its share of the state (its slices with snapshot.replicas >= 2, so the
    node after a lost one writes its slice too), as a periodic snapshot does: the write per node falls with the
    node count. Whoever finds every slice written commits every writer's file; a set with a slice nobody wrote,
    or writers that cut the state differently, is not committed."""
    from types import SimpleNamespace

    from hpc_ddp.rank.salvage.jit_write import replicas_of, split_over

    assert split_over(SimpleNamespace(num_nodes=4, node_rank=2), {}) == (2, 4)
    # buffers that are this rank's own, not rank 0's (the boundary's broadcast had not finished): one writer
    assert split_over(SimpleNamespace(num_nodes=4, node_rank=2), {"model": {"bn.running_mean"}}) == (0, 1)
    assert split_over(SimpleNamespace(num_nodes=1, node_rank=0), {}) == (0, 1)
    assert [replicas_of(n, 1) for n in (1, 2, 3, 8)] == [1, 2, 2, 2] and replicas_of(8, 3) == 3
    where = jit_files.folder(tmp_path, 5, 0)
    tensors = [(("model", "w"), torch.zeros(3 << 18)), (("model", "b"), torch.zeros(3 << 18))]  # 2 x 3 MiB: cut
    layout = slicing.layout_for(tensors, 3, 2)
    snapshot.step_dir(tmp_path, 40).mkdir(parents=True)  # where the writers' files are

    def writer(rank: int, node: int, cut: dict[str, Any] = layout) -> str:
        return split_writer(tmp_path, where, rank, node, cut)

    said = writer(0, 0)  # node 1 was lost: node 0 holds slices 0 and 2, nobody slice 1 yet
    assert "slice(s) [1] of step 40 not written (yet)" in said and snapshot.committed_steps(tmp_path) == []
    assert writer(2, 2) == "committed step 40"  # node 2 holds slices 2 and 1
    manifest = snapshot_steps.read_manifest(snapshot.step_dir(tmp_path, 40))
    assert manifest is not None and sorted(manifest["files"]) == ["jit-node-00000.pt", "jit-node-00002.pt"]
    assert slicing.sources(manifest, manifest["files"]) == {0: "jit-node-00000.pt", 1: "jit-node-00002.pt",
                                                           2: "jit-node-00002.pt"}
    assert manifest["jit"]["writer"] == 0 and manifest["jit"]["writers"] == {
        "0": {"write_s": None, "bytes": 1, "slices": [0, 2]}, "2": {"write_s": None, "bytes": 1, "slices": [2, 1]}}
    other = jit_files.folder(tmp_path, 6, 0)  # another attempt: two writers that cut the state differently
    where = other
    writer(0, 0)
    said = writer(2, 2, slicing.layout_for(tensors, 3, 3))
    assert "cut the state in 2 different ways" in said


def test_a_declared_node_that_wrote_its_share_anyway_is_no_survivor(tmp_path: Path) -> None:
    """Issue 60's fence: node 1 was declared lost, then (cut off from its peers, not from the run dir, or frozen
    and thawed before it heard) wrote its share of step 40. It commits nothing, and its share is not taken: the
    set waits for a survivor's, and the commit holds none of node 1's files."""
    from hpc_ddp.rundir import lost

    where = jit_files.folder(tmp_path, 5, 0)
    layout_ = slicing.layout_for([(("model", "w"), torch.zeros(3 << 18)), (("model", "b"), torch.zeros(3 << 18))],
                                 3, 2)
    snapshot.step_dir(tmp_path, 40).mkdir(parents=True)
    layout.declared(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    layout.declared(tmp_path).write_bytes(lost.padded({"rank": 1, "ranks": [1], "host": "n1", "attempt": where.name}))

    def writer(rank: int) -> str:
        return split_writer(tmp_path, where, rank, rank, layout_)

    assert writer(1).startswith("not committed: this rank was declared lost")
    said = writer(0)  # node 1's file holds slice 1, but its word is not taken
    assert "slice(s) [1] of step 40 not written (yet)" in said
    assert said.endswith("(the offers of rank(s) [1], declared lost in this attempt, are not taken)")
    assert writer(2) == "committed step 40"
    manifest = snapshot_steps.read_manifest(snapshot.step_dir(tmp_path, 40))
    assert manifest is not None and sorted(manifest["files"]) == ["jit-node-00000.pt", "jit-node-00002.pt"]
    assert snapshot_steps.agreed(tmp_path, snapshot_steps.committed(tmp_path)) != []


def test_a_rank_zero_declared_lost_is_no_source_of_the_ddp_buffers(tmp_path: Path) -> None:
    """A rank whose DDP buffers are its own writes only where rank 0 offers the step (rank 0 writes the buffers);
    a declared rank 0's offer is not taken (issue 60), so that rank writes nothing rather than a mixture."""
    from hpc_ddp.rank.salvage.jit_checks import why_not_buffers
    from hpc_ddp.rundir import lost

    where = jit_files.folder(tmp_path, 5, 0)
    offered = lambda: {"rank": 0, "source": True, "step": 30}  # noqa: E731
    assert why_not_buffers(2, where, 30, read=offered) is None
    layout.declared(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    layout.declared(tmp_path).write_bytes(lost.padded({"rank": 0, "ranks": [0, 1], "host": "n0",
                                                        "attempt": where.name}))
    assert "rank 0 offers no step 30" in (why_not_buffers(2, where, 30, read=offered) or "")
