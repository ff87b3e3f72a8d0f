"""The survivors' files of earlier attempts are removed as a step is settled, but for the fence (each attempt's
commit claim) and the offers a kept survivors' snapshot is still checked against (issue 57, a tidy run dir)."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_ddp.rundir import jit_claims, jit_tidy


def attempt(run_dir: Path, tag: str, claim: str | None = None) -> Path:
    where = run_dir / "jit" / tag
    where.mkdir(parents=True)
    for name in ("node-0.json", "node-1.json", "blobs-node-0.pt", "blobs-node-1.pt", "claim-step-12",
                 "stopped-mid-step"):
        (where / name).write_bytes(b"x" * 100)
    if claim is not None:
        (where / jit_claims.COMMIT_CLAIM).write_text(claim)
    return where


def test_earlier_attempts_keep_only_their_seal_and_the_settled_one_stays_whole(tmp_path: Path) -> None:
    old = attempt(tmp_path, "job-1-restart-0")  # ended without a failure: never sealed
    healed = attempt(tmp_path, "job-1-restart-0-step-1", claim="sealed\n")
    settled = attempt(tmp_path, "job-1-restart-1")
    removed = jit_tidy.prune(tmp_path, "job-1-restart-1")
    assert sorted(p.name for p in old.iterdir()) == ["commit"] == sorted(p.name for p in healed.iterdir())
    assert old.joinpath("commit").read_text() == "sealed\n"  # sealed by the prune: no late commit counts
    assert len(list(settled.iterdir())) == 6 and len(removed) == 12
    # a late process of the old attempt cannot commit: the claim it would create exists
    assert not jit_claims.claim_commit(old, 12) and jit_claims.commit_holder(old) == "sealed"


def test_the_offers_of_a_kept_survivors_snapshot_stay_and_a_claim_being_written_waits(tmp_path: Path) -> None:
    committed = attempt(tmp_path, "job-1-restart-0", claim="step 12\n")
    starting = attempt(tmp_path, "job-1-restart-0-step-1", claim="")  # created, not yet written
    step = tmp_path / "snapshots" / "step-00000012"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 12, "world_size": 4, "files": {},
                                                    "jit": {"attempt": "job-1-restart-0", "nodes": 2}}))
    jit_tidy.prune(tmp_path, "job-1-restart-1")
    assert sorted(p.name for p in committed.iterdir()) == ["commit", "node-0.json", "node-1.json"]
    assert len(list(starting.iterdir())) == 7  # left for the next settle


def test_a_run_dir_without_jit_is_left_alone(tmp_path: Path) -> None:
    assert jit_tidy.prune(tmp_path, "job-1-restart-0") == []
