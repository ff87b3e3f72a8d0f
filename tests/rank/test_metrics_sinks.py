"""Every sink shows one run across attempts, and one rule for the steps an attempt replays: a resumed attempt's
values replace them. A crash after a snapshot (the next attempt replays steps from the older snapshot), a
preemption and its requeue, with real gloo ranks through the local rehearsal. Each sink is read back with its
own reader: metrics.jsonl with hpc_ddp.rundir.metrics_file (what status and --plot use), the event files with
TensorBoard's EventAccumulator, and W&B (offline, no network) with W&B's own reader of its run files
(``wandb leet inspect --json``, wandb-core's transaction-log reader)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.rundir import metrics_file
from hpc_ddp.rundir.ledger import read_attempts
from tests.wandb_reader import wandb_fragments, wandb_history

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Attempt 0 is killed at step 25 (snapshot at 20), attempt 1 is preempted after 27, attempt 2 finishes 40.
    The time limit comes as the warning signal, which W&B's service process keeps blocked, so every attempt
    finishes its W&B run (a SIGTERM's stop: the test after these)."""
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra (pip install 'hpc_ddp[tensorboard]')")
    pytest.importorskip("wandb", reason="needs the wandb extra (pip install 'hpc_ddp[wandb]')")
    run_dir = tmp_path_factory.mktemp("watched") / "run"
    env = {**os.environ, "HPC_DDP_TEST_FAULT": "kill:1:25", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local", f"run_dir={run_dir}",
                           "train.task=tests.tasks:Faulty", "slurm.nodes=1", "slurm.tasks_per_node=2",
                           "train.max_steps=40", "train.log_every=1", "snapshot.every_steps=10",
                           "snapshot.jit=false",  # the replay of steps 21-25 is what the sinks must rewind
                           "slurm.max_failures=1", "metrics.tensorboard=true", "metrics.wandb=true",
                           "metrics.wandb_mode=offline", "--timeout-at", "27", "slurm.max_timeouts=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = read_attempts(run_dir)
    # the stop lands on the first step boundary after the signal: 28, or later when the signal comes late (a
    # loaded machine); any stop after the replayed steps and before the end keeps the scenario
    stop = attempts[1]["last_step"]
    assert 28 <= stop < 40 and [(a["reason"], a.get("resumed_from")) for a in attempts] == \
        [("failed", None), ("timeout", 20), ("finished", stop)]
    return run_dir


def raw_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def replayed(run_dir: Path) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """The steps metrics.jsonl holds twice: (the crashed attempt's line, the resumed attempt's line)."""
    lines: dict[int, list[dict[str, Any]]] = {}
    for record in raw_lines(run_dir):
        lines.setdefault(record["step"], []).append(record)
    assert all(len(v) <= 2 for v in lines.values())
    return {step: (v[0], v[1]) for step, v in lines.items() if len(v) == 2}


def newest(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The run's history as hpc_ddp reads metrics.jsonl (status, --plot): one record per step."""
    return {record["step"]: record for record in metrics_file.read(run_dir)}


def test_metrics_jsonl_keeps_every_line_and_its_reader_gives_each_step_once_with_the_resumed_value(
        watched: Path) -> None:
    twice = replayed(watched)
    assert sorted(twice) == list(range(21, 21 + len(twice))) and len(twice) >= 4  # the crash's steps, from 21
    # samples/s is measured, so a replay's differs: that is what tells the attempts' values apart here
    assert any(first["samples_per_s"] != again["samples_per_s"] for first, again in twice.values())
    history = metrics_file.read(watched)
    assert [r["step"] for r in history] == list(range(1, 41))  # every step once, in order
    for step, (_, again) in twice.items():  # the resumed attempt's line, whole (less its attempt mark)
        assert history[step - 1] == {k: v for k, v in again.items() if k not in metrics_file.MARKS}
    # where the writer marks each attempt's first line, the marks name the resume points of the ledger
    marks = [(r["_resumed_from"], r["_attempt"]) for r in raw_lines(watched) if "_resumed_from" in r]
    assert marks in ([], [(0, 0), (20, 1), (read_attempts(watched)[1]["last_step"], 2)]), marks
    assert {r["step"]: r["samples_per_s"] for r in history} == \
        {r["step"]: r["samples_per_s"] for r in raw_lines(watched)}  # the last line of each step wins


def test_tensorboard_shows_one_value_per_step_the_resumed_attempts(watched: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((watched / "tensorboard").glob("events.out.tfevents.*"))
    crashed = EventAccumulator(str(files[0])).Reload()  # attempt 0's own file still holds what it logged
    assert max(e.step for e in crashed.Scalars("train/loss")) > 20
    events = EventAccumulator(str(watched / "tensorboard")).Reload()
    history = newest(watched)
    for key in ("loss", "samples_per_s", "lr"):
        scalars = events.Scalars(f"train/{key}")
        assert [e.step for e in scalars] == list(range(1, 41)), key  # every step once, in order: replays purged
        assert {e.step: e.value for e in scalars} == pytest.approx({s: r[key] for s, r in history.items()}), key
    attempts = [(e.step, int(e.value)) for e in events.Scalars("hpc_ddp/attempt")]
    stop = read_attempts(watched)[1]["last_step"]
    assert attempts == [(1, 0), (21, 1), (stop + 1, 2)]  # each attempt's first step, not its snapshot's


def test_wandb_offline_rewinds_so_the_run_has_each_step_once_with_the_resumed_value(watched: Path) -> None:
    fragments = wandb_fragments(watched)
    assert [f["types"].count("exit") for f in fragments] == [1, 1, 1]  # every attempt finished its W&B run
    assert ["preempting" in f["types"] for f in fragments] == [False, True, False]  # mark_preempting on the stop
    # attempt 1 replays steps attempt 0 sent (a crash after the snapshot at 20): it rewinds the run to 20;
    # attempt 2 resumes from its own stop snapshot, so it has nothing to replay and only resumes the run
    assert [(f["branch"] or {}).get("value") for f in fragments] == [None, 20, None]
    assert max(row["_step"] for row in fragments[0]["rows"]) > 20  # what the rewind replaces was sent
    run_id = (watched / "wandb_id.txt").read_text().strip()
    rows = wandb_history(fragments, run_id)
    history = newest(watched)
    assert sorted(rows) == sorted(history)
    for key in ("loss", "samples_per_s", "lr"):
        assert {s: rows[s][key] for s in history} == pytest.approx({s: r[key] for s, r in history.items()}), key
    markers = [(step, row["hpc_ddp/attempt"]) for step, row in sorted(rows.items()) if "hpc_ddp/attempt" in row]
    stop = read_attempts(watched)[1]["last_step"]
    assert markers == [(1, 0), (21, 1), (stop + 1, 2)]  # each attempt's first step that W&B took


def test_wandb_offline_keeps_one_run_id_across_attempts(watched: Path) -> None:
    run_id = (watched / "wandb_id.txt").read_text().strip()
    runs = sorted(p.name for p in (watched / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(f"-{run_id}" in name for name in runs), runs


def test_a_stop_by_sigterm_loses_no_step_in_w_and_b_the_next_attempt_sends_them_again(tmp_path: Path) -> None:
    """An own loop of 20 steps at 2x2, preempted at step 8 by SIGTERM: the signal reaches W&B's service process
    too (the rehearsal signals every process, as Slurm does), which shuts down without writing the attempt's
    rows. The requeued attempt rewinds the run to what W&B surely holds and sends the lost steps again from
    metrics.jsonl: the run, read back with W&B's own reader, holds steps 1-20 with metrics.jsonl's values."""
    pytest.importorskip("wandb", reason="needs the wandb extra (pip install 'hpc_ddp[wandb]')")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/own_loop_gpt.yaml", "--local",
                           f"run_dir={run_dir}", "train.max_steps=20", "train.log_every=1",
                           "metrics.wandb=true", "metrics.wandb_mode=offline", "--preempt-at", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = read_attempts(run_dir)
    assert [a["reason"] for a in attempts] == ["preemption", "finished"], attempts
    fragments = wandb_fragments(run_dir)
    assert len(fragments) == 2 and fragments[1]["branch"] is not None, fragments  # the rewind to what W&B kept
    rows = wandb_history(fragments, (run_dir / "wandb_id.txt").read_text().strip())
    history = newest(run_dir)
    assert sorted(rows) == sorted(history) == list(range(1, 21))
    assert {s: rows[s]["loss"] for s in history} == pytest.approx({s: r["loss"] for s, r in history.items()})
    markers = [(step, row["hpc_ddp/attempt"]) for step, row in sorted(rows.items()) if "hpc_ddp/attempt" in row]
    assert markers == [(1, 0), (attempts[1]["first_step"] + 1, 1)]


@pytest.mark.parametrize("where", ["--local", "--emit-sbatch"])
def test_a_sink_without_its_package_is_refused_at_submit_with_the_extra_to_install(tmp_path: Path, where: str) -> None:
    code = ("import sys, importlib.util as u; real = u.find_spec\n"
            "u.find_spec = lambda name, *a: None if name == 'tensorboard' else real(name, *a)\n"
            "from hpc_ddp.submit import main; sys.exit(main(sys.argv[1:]))")
    args = [where] if where == "--local" else [where, str(tmp_path / "job.sbatch")]
    proc = subprocess.run([sys.executable, "-c", code, "examples/mlp.yaml", *args, f"run_dir={tmp_path / 'r'}",
                           "metrics.tensorboard=true"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "metrics.tensorboard=true needs the tensorboard package, which is not installed" in proc.stderr
    assert "pip install 'hpc_ddp[tensorboard]'" in proc.stderr and not (tmp_path / "r" / "logs").exists()
