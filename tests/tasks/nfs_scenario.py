"""tests/rundir/test_nfs_view.py's scenario through the local cluster's real cached views (issue 55): run with srun on
one node per phase, ``python -m tests.tasks.nfs_scenario PHASE RUN_DIR``, each printing one JSON line.

- ``look`` (node B): the attempt's first looks, before anything is committed or declared: step 22's directory
  and errors/ listed, step 22's manifest looked up while absent (a survivor polled it);
- ``commit`` (node A): rank 2's liveness thread declares rank 4 (on n3) lost, the survivors commit step 22;
- ``decide`` (node B, within its cache time): what the batch shell and the next attempt's rank 0 decide.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hpc_ddp.rank.watch.liveness import Beat, Liveness
from hpc_ddp.rundir import layout, losses, newest, retention, snapshot
from hpc_ddp.rundir.snapshot import steps as snapshot_steps
from hpc_ddp.shell import shell_rules

TAG = "job-7-restart-0"


def commit(run_dir: Path, step: int, jit: dict | None = None) -> None:
    directory = snapshot.step_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "jit-00002.pt").write_bytes(b"state" * 20)
    snapshot.commit(directory, step, [{"name": "jit-00002.pt", "size": 100, "sha256": "x", "slices": [0],
                                       "ranks": []}], world_size=4, config_hash="h",
                    extra={"jit": jit} if jit else None)


def prepare(run_dir: Path) -> dict:
    """Before the attempt that fails (rank 0, on node B): the newest-commit file, an old periodic snapshot,
    errors/ and the declaration file."""
    newest.create(run_dir)
    commit(run_dir, 10)
    layout.errors(run_dir).mkdir(parents=True)
    layout.declared(run_dir).parent.mkdir(parents=True, exist_ok=True)
    layout.declared(run_dir).touch()
    snapshot.step_dir(run_dir, 22).mkdir()
    return {"prepared": True}


def look(run_dir: Path) -> dict:
    step_22 = snapshot.step_dir(run_dir, 22)
    return {"manifest_absent": not (step_22 / snapshot.MANIFEST).exists(), "step_22": os.listdir(step_22),
            "errors": os.listdir(layout.errors(run_dir)), "snapshots": sorted(os.listdir(layout.snapshots(run_dir)))}


def declare_and_commit(run_dir: Path) -> dict:
    detector = Liveness(run_dir, 7, 0, 0, 3, 8, "n2", 6.0, on_lost=lambda message: None,
                        node_base=Path("/dev/shm/hpc_ddp-test-nfs"))
    detector._declare(6.5, [4], Beat(TAG, 4, "n3", 41))
    commit(run_dir, 22, jit={"attempt": TAG, "writer": 2})
    return {"committed": 22}


def decide(run_dir: Path) -> dict:
    step_22 = snapshot.step_dir(run_dir, 22)
    seen = {"manifest_seen_at_once": (step_22 / snapshot.MANIFEST).exists(),
            "errors_listed": os.listdir(layout.errors(run_dir))}
    dropped = retention.drop_uncommitted(run_dir, clock=lambda: time.time() + 3600)
    lost = losses.lost_ranks(run_dir, 7, 0, 0)
    blamed = list(shell_rules.lost_nodes(run_dir, 7, 0, 0, ["n1", "n2", "n3", "n4"], per_node=2))
    started = time.monotonic()
    found = snapshot_steps.committed(run_dir, wait_s=snapshot_steps.NAME_CACHE_S)
    choice = snapshot.choose(run_dir, verify=lambda d, m: {name: None for name in m["files"]}, found=found)
    return {**seen, "dropped": {str(k): v for k, v in dropped.items()}, "kept": step_22.exists(),
            "lost": {str(k): v for k, v in lost.items()}, "blamed": blamed, "found": [s for s, _ in found],
            "waited_s": round(time.monotonic() - started, 1), "chosen": choice.step if choice else None,
            "host": os.uname().nodename}


if __name__ == "__main__":
    phase, where = sys.argv[1], Path(sys.argv[2])
    act = {"prepare": prepare, "look": look, "commit": declare_and_commit, "decide": decide}[phase]
    print(json.dumps(act(where)))
