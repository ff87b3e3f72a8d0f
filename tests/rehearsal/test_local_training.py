"""Real multi-process training through the local simulation (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpc_ddp.login.submit import main as submit
from hpc_ddp.rundir.ledger import read_attempts
from tests.helpers import alive_with

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_local(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    """`python -m hpc_ddp.submit examples/simple.yaml --local ...` in a subprocess, from the repo root."""
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "examples/simple.yaml", "--local", f"name={name}",
           f"run_dir={tmp_path / name}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_over_four_ranks_equals_one_process_on_the_full_batch(tmp_path: Path, accum: int) -> None:
    common = ["train.max_steps=20", "train.log_every=1", f"train.grad_accum={accum}", "train.lr=0.05"]
    ddp = run_local(tmp_path, "ddp", "slurm.nodes=2", "slurm.tasks_per_node=2", "train.batch_size=8", *common)
    single = run_local(tmp_path, "single", "slurm.nodes=1", "slurm.tasks_per_node=1", "train.batch_size=32",
                       *common)
    assert ddp.returncode == 0, ddp.stderr
    assert single.returncode == 0, single.stderr
    ours, theirs = final_params(tmp_path / "ddp"), final_params(tmp_path / "single")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("ddp", "single")]
    assert len(losses[0]) == 20 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    done = json.loads((tmp_path / "ddp" / "DONE.json").read_text())
    assert (done["step"], done["world_size"]) == (20, 4) and len(done["params_sha256"]) == 64
    assert not (tmp_path / "ddp" / "compile_cache").exists()  # nothing compiled: no empty folder is left


def test_a_failing_rank_fails_the_job_fast_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Rank 2 raises in its 5th step; its peers wait in the step's all-reduce. Fast means no rank waits out
    dist.timeout_s (600 s; the collectives' own timeout is longer): run_local's 300 s bound fails the test long
    before (the run takes seconds), and each attempt (the first and the in-job retry) ends as a failure, not as
    a hang found by the watchdog."""
    proc = run_local(tmp_path, "fail", "train.task=tests.tasks:FailOnRank2AtStep5", "train.max_steps=50",
                     "dist.timeout_s=600")
    assert proc.returncode != 0
    attempts = [a for a in read_attempts(tmp_path / "fail") if "reason" in a]
    assert [a["reason"] for a in attempts] == ["failed", "failed"], attempts  # a hang's reason is "hung"
    assert "rank 2 failed" in proc.stderr and "injected failure on rank 2 at step 5" in proc.stderr
    assert "Traceback" in proc.stderr
    assert alive_with(str(tmp_path / "fail")) == []
    assert not (tmp_path / "fail" / "DONE.json").exists()


def test_bad_task_path_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_local(tmp_path, "bad", "train.task=examples.simple:SimpleTsk")
    assert proc.returncode != 0
    assert "train.task" in proc.stderr and "e.g. examples.simple:SimpleTask" in proc.stderr
    assert "nothing was rehearsed" in proc.stderr and not (tmp_path / "bad").exists()  # refused before the ranks


def test_bad_config_values_stop_before_any_process_starts(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert submit([str(ROOT / "examples" / "simple.yaml"), "--local", "train.batch_size=0",
                   f"run_dir={tmp_path / 'x'}"]) == 2
    assert "train.batch_size" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_dry_run_shows_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert submit([str(ROOT / "examples" / "simple.yaml"), "--dry-run", "slurm.nodes=3"]) == 0
    out = capsys.readouterr().out
    assert "run simple: 3 nodes x 2 tasks" in out and "3 nodes -> 6 ranks x" in out  # and the batch plan
    table = out[out.index("every rank as Slurm job"):out.index("preflight:")]
    assert len(table.splitlines()) == 2 + 6  # header lines, then one line per rank


def test_worker_without_a_config_argument_explains(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.worker", "--config", str(tmp_path / "none.yaml")],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "cannot read config file" in proc.stderr


def test_char_gpt_demo_learns(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/char_gpt.yaml", "--local",
                           "slurm.nodes=1", "train.max_steps=60", "train.log_every=10",
                           f"run_dir={tmp_path / 'gpt'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "gpt" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3


def test_own_loop_example_under_real_torchrun() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "examples/own_loop.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 1 loss" in proc.stdout and "world 2 source torchrun stop False" in proc.stdout


def test_epochs_bf16_workers_and_syncbatchnorm(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local", "slurm.nodes=1",
                           "train.max_steps=null", "train.epochs=1", "train.amp=bf16", "train.num_workers=1",
                           "train.sync_batchnorm=true", "train.log_every=16", f"run_dir={tmp_path / 'e'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads((tmp_path / "e" / "DONE.json").read_text())
    assert (done["step"], done["epoch"]) == (4096 // 2 // 32, 1)  # one epoch: 2048 samples per rank, batch 32
    steps = [json.loads(line)["step"] for line in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [16, 32, 48, 64]


def test_done_json_appears_only_after_the_ledgers_finished_line(tmp_path: Path) -> None:
    """A user who polls DONE.json and then reads attempts.jsonl raced the ledger line (issue 27): DONE.json was
    written by the program's last step, the ledger line when the run closed. Watched here as it happens."""
    from hpc_ddp.rundir.ledger import read_attempts

    run_dir = tmp_path / "done_order"
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "examples/simple.yaml", "--local", "slurm.nodes=1",
           "train.max_steps=4", f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    done = run_dir / "DONE.json"
    while not done.exists() and proc.poll() is None:
        time.sleep(0.001)
    seen = [a["reason"] for a in read_attempts(run_dir)] if done.exists() else None
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    assert seen == ["finished"]  # the ledger was complete the moment DONE.json could be seen
