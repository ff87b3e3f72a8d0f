"""Elastic resume: a run stopped on 2 x 2 ranks continues on 1 x 2, 4 x 1 and 1 x 1 with the same
global batch and data order. Real processes through the local rehearsal (gloo, CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from hpc_ddp.rundir.ledger import read_attempts

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS, GLOBAL, SAMPLES = 40, 16, 256  # 16 steps per epoch: the resumed part crosses two epoch ends
RUN = ["--local", "train.task=tests.tasks.elastic:IdsTask", "name=elastic", "train.batch_size=2",
       f"train.global_batch_size={GLOBAL}", f"train.max_steps={STEPS}", "train.log_every=1", "slurm.max_timeouts=0",
       "snapshot.load=spread"]  # the cluster's read: auto would pick every_rank in the rehearsal


def submit(run_dir: Path, nodes: int, tasks: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *RUN, f"run_dir={run_dir}", f"slurm.nodes={nodes}",
                           f"slurm.tasks_per_node={tasks}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=os.environ.copy())


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def samples_per_step(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the sample ids all ranks used in it, from the task's records and the ledger's accumulation."""
    attempts = {(str(a["job_id"]), str(a["restart_count"])): a for a in read_attempts(run_dir)}
    steps: dict[int, list[int]] = defaultdict(list)
    for record in (run_dir / "ids").glob("*.jsonl"):
        job, restart, _rank = record.stem.split("-")
        attempt = attempts[(job, restart)]
        for i, line in enumerate(record.read_text().splitlines()):
            steps[attempt["first_step"] + i // attempt["grad_accum"] + 1] += json.loads(line)
    return dict(steps)


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted 2x2 run, and one stopped one boundary after step 9 (a time-out, not requeued:
    max_timeouts=0)."""
    base = tmp_path_factory.mktemp("elastic")
    plain, stopped = base / "plain", base / "stopped"
    proc = submit(plain, 2, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = submit(stopped, 2, 2, "--timeout-at", "9")
    assert [a["reason"] for a in read_attempts(stopped)] == ["timeout"], proc.stderr[-3000:]
    return {"plain": plain, "stopped": stopped}


@pytest.mark.parametrize("nodes,tasks", [(1, 2), (4, 1), (1, 1)])
def test_a_stopped_run_resumes_at_another_geometry_with_the_same_batches(runs: dict[str, Path], tmp_path: Path,
                                                                        nodes: int, tasks: int) -> None:
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs["stopped"], run_dir)
    proc = submit(run_dir, nodes, tasks, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a["world_size"], a["grad_accum"]) for a in attempts] == [
        ("timeout", 4, 2), ("finished", nodes * tasks, GLOBAL // (2 * nodes * tasks))]
    assert attempts[1]["resumed_from"] == attempts[0]["last_step"] >= 10
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    if nodes * tasks != 4:
        assert "at another world size: written by 4 ranks (accumulation 2, global batch 16)" in logs
        assert "no longer bit-identical" in logs

    plain = runs["plain"]
    expected, got = losses(plain), losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in expected.items():  # only the order floats are summed in differs
        assert got[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    for name, tensor in params(plain).items():
        torch.testing.assert_close(params(run_dir)[name], tensor, rtol=1e-4, atol=1e-6)

    used, reference = samples_per_step(run_dir), samples_per_step(plain)
    assert sorted(used) == list(range(1, STEPS + 1))
    assert all(sorted(used[s]) == sorted(reference[s]) and len(used[s]) == GLOBAL for s in used)
    per_epoch = SAMPLES // GLOBAL
    for epoch in range(STEPS // per_epoch):  # the whole epochs: every sample exactly once
        ids = Counter(i for s in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1) for i in used[s])
        assert sorted(ids) == list(range(SAMPLES)) and set(ids.values()) == {1}
    if nodes * tasks == 4:  # same world size, other nodes x tasks: every rank finds its RNG, still bit-identical
        assert got == expected and json.loads((run_dir / "DONE.json").read_text())["params_sha256"] == \
            json.loads((plain / "DONE.json").read_text())["params_sha256"]


def test_a_resume_that_would_change_the_global_batch_is_refused_before_anything_is_written(
        runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "refused"
    shutil.copytree(runs["stopped"], run_dir)
    config = (run_dir / "config.yaml").read_bytes()
    proc = submit(run_dir, 1, 2, "--resume", "train.global_batch_size=null", "train.grad_accum=2")
    assert proc.returncode == 2
    assert "written by 4 ranks at global batch 16" in proc.stderr and "the batch would be 8" in proc.stderr
    assert "HINT: add train.global_batch_size=16" in proc.stderr
    assert (run_dir / "config.yaml").read_bytes() == config and not (run_dir / "logs" / "rank0-1.log").exists()


def test_a_snapshot_with_a_per_rank_position_is_refused_with_the_fix(runs: dict[str, Path], tmp_path: Path) -> None:
    """As written before positions were global: progress {epoch, consumed}. Re-hashed whole (an entry without
    digests per slice, as those were written), so only the layout is old."""
    from hpc_ddp.rundir import snapshot

    run_dir = tmp_path / "old"
    shutil.copytree(runs["stopped"], run_dir)
    directory = snapshot.step_dir(run_dir, snapshot.committed_steps(run_dir)[0])
    manifest = json.loads((directory / "manifest.json").read_text())
    for name in manifest["files"]:
        data = torch.load(directory / name, weights_only=True)
        data["skeleton"]["progress"] = {"epoch": 0, "consumed": 40}  # plain values: in every file's skeleton
        torch.save(data, directory / name)
        manifest["files"][name].pop("digests")  # an entry as written before digests per slice: hashed whole
        manifest["files"][name].update(size=(directory / name).stat().st_size, sha256=hashlib.sha256(
            (directory / name).read_bytes()).hexdigest())
    (directory / "manifest.json").write_text(json.dumps(manifest))
    proc = submit(run_dir, 2, 2, "--resume")
    assert proc.returncode != 0
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "per-rank data position" in logs and "start a new run (run_dir=...)" in logs
    assert [a["reason"] for a in read_attempts(run_dir)] == ["timeout", "error"]  # recorded once, not requeued
