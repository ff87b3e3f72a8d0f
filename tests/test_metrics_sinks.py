"""TensorBoard and W&B stay one run across attempts: a crash after a snapshot (the next attempt replays steps
from the older snapshot), a preemption and its requeue. Real gloo ranks through the local rehearsal; the
event files are read back with TensorBoard's own reader, and W&B runs offline (no network), its run files read
back with W&B's own reader (``wandb leet inspect --json``, wandb-core's transaction-log reader)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.preemption import read_attempts

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Attempt 0 is killed at step 25 (snapshot at 20), attempt 1 is preempted after 27, attempt 2 finishes 40."""
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra (pip install 'hpc_ddp[tensorboard]')")
    pytest.importorskip("wandb", reason="needs the wandb extra (pip install 'hpc_ddp[wandb]')")
    run_dir = tmp_path_factory.mktemp("watched") / "run"
    env = {**os.environ, "HPC_DDP_TEST_FAULT": "kill:1:25", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local", f"run_dir={run_dir}",
                           "train.task=tests.tasks:Faulty", "slurm.nodes=1", "slurm.tasks_per_node=2",
                           "train.max_steps=40", "train.log_every=1", "snapshot.every_steps=10",
                           "slurm.max_failures=1", "metrics.tensorboard=true", "metrics.wandb=true",
                           "metrics.wandb_mode=offline", "--preempt-at", "27"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = read_attempts(run_dir)
    # the stop lands on the first step boundary after the signal: 28, or 29 when the signal comes late
    stop = attempts[1]["last_step"]
    assert stop in (28, 29) and [(a["reason"], a.get("resumed_from")) for a in attempts] == \
        [("failed", None), ("preemption", 20), ("finished", stop)]
    return run_dir


def last_values(run_dir: Path) -> dict[int, float]:
    """metrics.jsonl's loss per step, the later attempt's value where a step was logged twice."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_tensorboard_shows_one_value_per_step_across_a_crash_a_stop_and_a_requeue(watched: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = (watched / "metrics.jsonl").read_text().splitlines()
    assert len(lines) > 40  # the crashed attempt logged steps 21-24 that the next one logged again
    files = sorted((watched / "tensorboard").glob("events.out.tfevents.*"))
    crashed = EventAccumulator(str(files[0])).Reload()  # attempt 0's own file still holds what it logged
    assert max(e.step for e in crashed.Scalars("train/loss")) > 20
    events = EventAccumulator(str(watched / "tensorboard")).Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 41))  # every step once, in order: the replays were purged
    assert {e.step: round(e.value, 5) for e in loss} == {s: round(v, 5) for s, v in last_values(watched).items()}
    assert {e.step for e in events.Scalars("train/samples_per_s")} == set(range(1, 41))
    assert {e.step for e in events.Scalars("train/lr")} == set(range(1, 41))
    attempts = [(e.step, int(e.value)) for e in events.Scalars("hpc_ddp/attempt")]
    stop = read_attempts(watched)[1]["last_step"]
    assert attempts == [(0, 0), (20, 1), (stop, 2)]  # where each attempt began


def first_values(run_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's record per step, the first attempt's where a step was logged twice."""
    firsts: dict[int, dict[str, Any]] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        firsts.setdefault(record["step"], record)
    return firsts


def wandb_fragments(run_dir: Path) -> list[dict[str, Any]]:
    """Each attempt's offline run file as W&B's own reader sees it, in start order: its history rows
    (``_step`` and the values) and the types of all its records."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}  # no telemetry upload
    fragments = []
    for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        starts = [r["run"]["start_time"] for r in records if r["type"] == "run"]
        assert starts, f"{path} ({path.stat().st_size} bytes) holds no run: the attempt's Run.finish() failed?"
        fragments.append({"start": starts[0], "types": [r["type"] for r in records],
                          "rows": [r["history"]["item"] for r in records if r["type"] == "history"]})
    return sorted(fragments, key=lambda f: f["start"])


def test_wandb_offline_history_has_every_logged_step_once_across_a_crash_a_stop_and_a_requeue(watched: Path) -> None:
    logged = first_values(watched)
    assert len((watched / "metrics.jsonl").read_text().splitlines()) > len(logged)  # the crash's steps were replayed
    fragments = wandb_fragments(watched)
    assert [f["types"].count("exit") for f in fragments] == [1, 1, 1]  # every attempt finished its W&B run
    assert ["preempting" in f["types"] for f in fragments] == [False, True, False]  # mark_preempting on the stop
    steps = [[row["_step"] for row in f["rows"]] for f in fragments]
    # `wandb sync` uploads the fragments in start order as the one run, and wandb-core (its history step
    # tracker, core/internal/stream/historystep.go; string present in the 0.31 binary) renumbers a row whose
    # step is not above every step already uploaded to the next free step (a re-logged step would shift the
    # rest of the curve): so each fragment must begin above where the one before it ended, and W&B keeps
    # the first value logged for a step.
    assert all(s == sorted(set(s)) for s in steps) and all(b[-1] < a[0] for b, a in zip(steps, steps[1:])), steps
    assert [step for s in steps for step in s] == [0, *sorted(logged)]  # step 0: only attempt 0's marker
    rows = {row["_step"]: row for f in fragments for row in f["rows"]}
    for key in ("loss", "samples_per_s"):  # samples/s differs between a step and its replay
        assert {s: rows[s][key] for s in logged} == pytest.approx({s: r[key] for s, r in logged.items()})
    markers = [(row["_step"], row["hpc_ddp/attempt"]) for row in rows.values() if "hpc_ddp/attempt" in row]
    assert markers == [(s[0], n) for n, s in enumerate(steps)]  # each attempt's first step that W&B kept
    assert markers[2][0] == read_attempts(watched)[1]["last_step"] + 1


def test_wandb_offline_keeps_one_run_id_across_attempts(watched: Path) -> None:
    run_id = (watched / "wandb_id.txt").read_text().strip()
    runs = sorted(p.name for p in (watched / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(name.endswith(f"-{run_id}") for name in runs), runs


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
