"""Stop, snapshot, requeue, resume: bit-exact results, faults mid-write, fallbacks, caps, the DONE guard.

Real processes through the local simulation (gloo, CPU), with the real signals.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir import snapshot
from hpc_ddp.rundir.snapshot import steps as snapshot_steps, verify as snapshot_verify
from hpc_ddp.rundir.ledger import read_attempts

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# The wide MLP: its tensors are cut between the two nodes' files (split snapshots, snapshot.replicas=2)
# snapshot.load=spread: the cluster's read (auto picks every_rank in the rehearsal), so it is what these test
MLP = ["examples/mlp.yaml", "--local", "train.task=tests.tasks:WideMLP", "train.log_every=1", "train.max_steps=80",
       "snapshot.load=spread"]
# DataLoader workers in the three-stop run only (they cost a forkserver and a worker per rank per epoch): it must
# equal the uninterrupted run without them bit for bit, so the workers change nothing and resume exactly.
WORKERS = "train.num_workers=1"
# The stopped runs send their control traffic over a gloo group of its own, as on GPUs (hpc_ddp.rank.group.control): the
# training group is the default gloo one, so any control message left on it would be a second group's collective
# issued in another order on some rank, and a hang or a mismatch here; the uninterrupted runs share one group.
OWN_CONTROL = {"HPC_DDP_CONTROL_GROUP": "own"}
ONE_RANK = ["slurm.nodes=1", "slurm.tasks_per_node=1", "train.max_steps=20"]  # the caps are rank 0's alone


def submit(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *MLP, f"run_dir={run_dir}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def done(run_dir: Path) -> dict:
    return json.loads((run_dir / "DONE.json").read_text())


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    proc = submit(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stopped three times mid-epoch (preemption, preemption, time-out) and resumed to the end, with loader workers."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    proc = submit(run_dir, WORKERS, "--preempt-at", "7,40", "--timeout-at", "61", env=OWN_CONTROL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "control traffic on its own gloo group" in (run_dir / "logs" / "attempt-0-rank-0.log").read_text()
    return run_dir


def test_three_stops_mid_epoch_give_bit_identical_results(uninterrupted: Path, stopped: Path) -> None:
    run_dir = stopped
    assert done(run_dir)["params_sha256"] == done(uninterrupted)["params_sha256"]
    assert losses(run_dir) == losses(uninterrupted)  # every step once, each loss bit for bit
    attempts = read_attempts(run_dir)
    assert [a["reason"] for a in attempts] == ["preemption", "preemption", "timeout", "finished"]
    assert [a["restart_count"] for a in attempts] == [0, 1, 2, 3]
    assert [a["resumed_from"] for a in attempts] == [None] + [a["last_step"] for a in attempts[:-1]]
    assert all(a["first_step"] == (a["resumed_from"] or 0) for a in attempts)
    for step in snapshot.committed_steps(run_dir):  # resuming (mmap) never wrote into a committed file
        directory = snapshot.step_dir(run_dir, step)
        manifest = snapshot_steps.read_manifest(directory)
        assert all(snapshot_verify.file_problem(directory, n, e) is None for n, e in manifest["files"].items())
    assert len(snapshot.committed_steps(run_dir)) == 2  # keep_last
    files = manifest["files"].values()  # split over the 2 nodes, each slice in both files (replicas 2)
    assert manifest["layout"]["slices"] == 2 and sorted(sorted(f["slices"]) for f in files) == [[0, 1], [0, 1]]


def test_killed_inside_each_phase_of_a_snapshot_write_resumes_from_the_previous_commit(uninterrupted: Path,
                                                                                       tmp_path: Path) -> None:
    """SIGKILL in each write phase of one run, one after another: in the temporary file (step 20), before its
    rename (step 40), before the manifest (step 60). Each resume starts from the commit before; the end is
    bit-identical to a run that was never killed. (One run for the three phases: a third of the launches.)"""
    run_dir = tmp_path / "killed"
    resumed: int | None = None
    for point, step in (("tmp", 20), ("before_rename", 40), ("before_manifest", 60)):
        crashed = submit(run_dir, "snapshot.every_steps=10", *(["--resume"] if resumed is not None else []),
                         env={"HPC_DDP_FAULT_POINT": f"{point}:{step}"})
        assert crashed.returncode != 0 and "killed by SIGKILL (137)" in crashed.stderr, f"{point}: {crashed.stderr[-2000:]}"
        assert snapshot.committed_steps(run_dir)[0] == step - 10, point  # the killed step never committed
        if resumed is not None:
            assert f"resuming from the snapshot of step {resumed}" in crashed.stdout + crashed.stderr
        resumed = step - 10
    proc = submit(run_dir, "snapshot.every_steps=10", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from the snapshot of step 50" in proc.stdout + proc.stderr
    assert done(run_dir)["params_sha256"] == done(uninterrupted)["params_sha256"]
    assert not list((run_dir / "snapshots").glob("step-*/.*tmp*"))  # no temporary file counted or left


def test_a_truncated_node_file_falls_back_to_the_other_nodes_copy(stopped: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "truncated"
    shutil.copytree(stopped, run_dir)
    (run_dir / "DONE.json").unlink()  # pretend the run stopped at its newest snapshot and was requeued
    step = snapshot.committed_steps(run_dir)[0]
    node1 = snapshot.step_dir(run_dir, step) / snapshot.node_file_name(1)
    node1.write_bytes(node1.read_bytes()[:1000])
    proc = submit(run_dir, WORKERS, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "\n".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert f"{node1} is not usable (size 1000 bytes" in logs
    assert "snapshot file node-00001.pt (this rank's RNG state) is not usable; taking the replicated state from the " \
        "copies that verify" \
        in logs  # node 0's file holds node 1's slice too (snapshot.replicas=2)
    assert "reseeding this rank's RNG" in logs
    assert done(run_dir)["step"] == 80


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "executed"

    class Evil:
        def __reduce__(self):  # noqa: D105
            return (Path.touch, (marker,))

    import torch

    directory = snapshot.step_dir(tmp_path, 5)
    directory.mkdir(parents=True)
    torch.save({"replicated": Evil()}, directory / snapshot.node_file_name(0))
    data = (directory / snapshot.node_file_name(0)).read_bytes()
    import hashlib

    snapshot.commit(directory, 5, [{"name": snapshot.node_file_name(0), "size": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()}], 1, "x")
    choice = snapshot.choose(tmp_path)
    assert choice is not None and choice.step == 5  # it verifies: the bytes are what the manifest says
    with pytest.raises(snapshot.SnapshotError, match="refused to load snapshot file .*arbitrary unpickling"):
        snapshot.load_file(directory / snapshot.node_file_name(0))
    assert not marker.exists()


def test_caps_end_the_run_with_the_cap_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "capped"
    proc = submit(run_dir, *ONE_RANK, "slurm.max_preemptions=1", "--preempt-at", "5,10")
    assert proc.returncode == 1
    assert "more than slurm.max_preemptions=1" in proc.stderr and "slurm.max_preemptions=11" in proc.stderr
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a["capped"]) for a in attempts] == [("preemption", False), ("preemption", True)]
    assert not (run_dir / "DONE.json").exists() and snapshot.committed_steps(run_dir)[0] == attempts[-1]["last_step"]
    timeouts = submit(tmp_path / "t", *ONE_RANK, "slurm.max_timeouts=0", "--timeout-at", "5")
    assert timeouts.returncode == 1 and "more than slurm.max_timeouts=0" in timeouts.stderr


def test_a_run_stopped_by_its_cap_continues_with_a_plain_resume_and_its_caps_count_afresh(tmp_path: Path) -> None:
    """"STOPPED ... (slurm.max_preemptions reached; --resume continues it)": and a plain --resume, with the run's
    own max_preemptions=0, was refused because the cap was reached. A person's --resume starts a fresh budget."""
    run_dir = tmp_path / "capped"
    first = submit(run_dir, *ONE_RANK, "slurm.max_preemptions=0", "--preempt-at", "6")
    assert first.returncode == 1 and "(slurm.max_preemptions reached; --resume continues it)" in first.stdout, \
        first.stdout[-2000:] + first.stderr[-2000:]
    again = submit(run_dir, *ONE_RANK, "--resume", "--preempt-at", "12")  # still capped at 0 preemptions: per resume
    assert again.returncode == 1 and "stopped for preemption once since its last --resume, more than " \
        "slurm.max_preemptions=0" in again.stderr, again.stderr[-3000:]
    last = submit(run_dir, *ONE_RANK, "--resume")
    assert last.returncode == 0, last.stderr[-3000:]
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a.get("capped")) for a in attempts] == [("preemption", True), ("preemption", True),
                                                                   ("finished", None)]
    assert [a.get("before_resume", False) for a in attempts] == [True, True, False]
    assert done(run_dir)["step"] == 20 and attempts[1]["resumed_from"] == attempts[0]["last_step"]


def test_a_finished_run_resumed_with_more_steps_goes_on_and_keeps_its_first_finish(uninterrupted: Path,
                                                                                    tmp_path: Path) -> None:
    """--resume train.max_steps=N of a finished run trains on to N (issue 23): DONE.json and model.pt of the first
    finish are set aside with their step, the ledger and metrics go on. From the finished step: this run takes no
    periodic snapshot (snapshot.every_minutes=30, every_steps null), and it went on from step 0 (a newcomer saw
    its metrics replaced) until the finish committed a snapshot of its step."""
    run_dir = tmp_path / "longer"
    shutil.copytree(uninterrupted, run_dir)
    first, before = done(run_dir), losses(run_dir)
    proc = submit(run_dir, "--resume", f"train.max_steps={first['step'] + 10}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"its DONE.json is kept as {run_dir / ('DONE-step-%d.json' % first['step'])}; it goes on from step " \
        f"{first['step']}, where it finished" in proc.stdout
    assert json.loads((run_dir / f"DONE-step-{first['step']}.json").read_text()) == first
    assert (run_dir / f"model-step-{first['step']}.pt").exists() and (run_dir / "model.pt").exists()
    assert done(run_dir)["step"] == first["step"] + 10
    assert [a["reason"] for a in read_attempts(run_dir)][-2:] == ["finished", "finished"]
    assert max(step for step, _ in losses(run_dir)) == first["step"] + 10
    assert read_attempts(run_dir)[-1]["resumed_from"] == first["step"]
    assert [row for row in losses(run_dir) if row[0] <= first["step"]] == before


def test_a_finished_run_requeued_again_exits_at_once(uninterrupted: Path) -> None:
    before = read_attempts(uninterrupted)
    refused = submit(uninterrupted)
    assert refused.returncode == 2 and "holds an earlier run" in refused.stderr and "--resume" in refused.stderr
    # --resume that would train nothing is refused on the login node (it took an allocation and did nothing)
    proc = submit(uninterrupted, "--resume")
    assert proc.returncode == 2 and "would train nothing more" in proc.stderr and "--resume train.max_steps=" in \
        proc.stderr
    # a job that Slurm requeues after the finish (its worker starts as rank 0 of 1 here) exits at once
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    worker = subprocess.run([sys.executable, "-m", "hpc_ddp.worker", "--config", str(uninterrupted / "config.yaml")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 0 and "has already finished (DONE.json)" in worker.stderr
    assert read_attempts(uninterrupted) == before


def test_async_snapshots_resume_bit_exactly(uninterrupted: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "async"
    proc = submit(run_dir, "snapshot.async_write=true", "snapshot.every_steps=5", "--preempt-at", "23,52",
                  env=OWN_CONTROL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert done(run_dir)["params_sha256"] == done(uninterrupted)["params_sha256"]
    assert losses(run_dir) == losses(uninterrupted)
    assert snapshot.committed_steps(run_dir)[0] == 80 - 80 % 5  # the in-flight one is committed before DONE


def test_killed_inside_a_background_write_resumes_from_the_previous_commit(uninterrupted: Path,
                                                                            tmp_path: Path) -> None:
    run_dir = tmp_path / "async-crash"
    # snapshot.jit=false: the training thread runs on while step 20 is written, so the survivors of the killed
    # writers may hold step 21 and commit it (the fault kills any writer of step 20 only): the fallback to the
    # previous commit, which this tests, would then depend on how far the loop ran before the kill
    options = ["snapshot.async_write=true", "snapshot.every_steps=10", "snapshot.jit=false"]
    crashed = submit(run_dir, *options, env={"HPC_DDP_FAULT_POINT": "before_rename:20"})
    assert crashed.returncode != 0 and snapshot.committed_steps(run_dir) == [10]
    proc = submit(run_dir, *options, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from the snapshot of step 10" in proc.stdout + proc.stderr
    assert done(run_dir)["params_sha256"] == done(uninterrupted)["params_sha256"]
