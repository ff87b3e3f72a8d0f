"""Findings from a newcomer's trial of nanoGPT's train.py (compiled, 2x2 rehearsal with stops): a script that
restarts from scratch on a requeue, its timeline, status in a pipe, compile settings typed on a command line,
``max_steps`` in TensorBoard and the compile record of every attempt. Pure functions first; one cheap rehearsal
(a script without torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.rank.script.publish import started_over
from hpc_ddp.rundir.ledger import read_attempts
from tests.helpers import submit

REACHED_25 = [{"reason": "preemption", "first_step": 0, "last_step": 25}]


@pytest.mark.parametrize(("first", "attempts", "warned"), [
    (0, REACHED_25, True),  # nanoGPT without --init_from=resume: "iter 0" again
    (1, REACHED_25, True),
    (2, REACHED_25, True),  # within a tenth of step 25
    (21, REACHED_25, False),  # resumed from its checkpoint of step 20
    (10, [{"reason": "timeout", "last_step": 1000}], True),  # prints every 10 steps, started over
    (600, [{"reason": "timeout", "last_step": 1000}], False),
    (0, [], False),  # the run's first attempt
    (0, [{"reason": "failed", "last_step": None}], False),  # nothing reached before
    (None, REACHED_25, False),  # no progress line yet
])
def test_a_continued_script_that_starts_again_near_0_is_warned_about(first: int | None, attempts: list[dict],
                                                                       warned: bool) -> None:
    warning = started_over(first, "iter 0: loss 4.5", attempts, [])
    assert bool(warning) == warned
    if warned:
        assert "train.resume_args is not set" in warning and "--init_from=resume" in warning
        assert f"started again at step {first}" in warning


def test_with_resume_args_the_warning_asks_whether_the_script_saved_a_checkpoint() -> None:
    warning = started_over(0, "iter 0: loss 4.5", REACHED_25, ["--init_from=resume"])
    assert "['--init_from=resume'] were appended" in warning and "eval_interval" in warning


def test_the_start_line_does_not_claim_the_script_resumes() -> None:
    from hpc_ddp.rank.script.wrapper import resume_note

    assert "resumes from its own checkpoint if it finds one" in resume_note([])
    assert "train.resume_args is not set" in resume_note([])
    assert "appends train.resume_args ['--resume']" in resume_note(["--resume"])


@pytest.mark.slow
def test_a_requeued_script_that_restarts_from_scratch_warns_and_has_a_timeline(tmp_path: Path) -> None:
    """nanoGPT's train.py without train.resume_args trained 0->40 again after the requeue, silently; its attempt
    had no timeline either (the script's worker never marked one)."""
    script = tmp_path / "fresh.py"  # nanoGPT's shape: 'iter N: loss', and never resumes unless told
    script.write_text("import time\nfor it in range(0, 12):\n    print(f'iter {it}: loss 4.0', flush=True)\n"
                      "    time.sleep(0.1)\n")
    run_dir = tmp_path / "fresh"
    proc = submit("examples/torchrun_script.yaml", "--local", "slurm.nodes=1", "slurm.tasks_per_node=1",
                  f"train.script={script}", "train.args=[]", f"run_dir={run_dir}", "--preempt-at", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = read_attempts(run_dir)
    assert first["reason"] == "preemption" and first["last_step"] >= 4
    assert second["reason"] == "finished" and second["first_step"] == 0
    assert "started again at step 0" in second["note"] and "train.resume_args is not set" in second["note"]
    assert {"imported", "first_step"} <= set(second["timeline"]) and second["timeline"]["kind"] == "requeue"
    assert "started again at step 0" in json.loads((run_dir / "DONE.json").read_text())["warnings"][0]
    log = (run_dir / "logs" / "attempt-1-rank-0.log").read_text()
    assert "resumes from its own checkpoint if it finds one" in log and "started again at step 0" in log
    from hpc_ddp.login.status import render
    from hpc_ddp.login.status.read import collect

    shown = render(collect(run_dir))
    assert "#1: train.script started again at step 0" in shown and "first_step" in shown, shown


def test_max_steps_stays_in_metrics_jsonl_and_is_no_tensorboard_scalar(tmp_path: Path) -> None:
    """own-loop.md has loops log ``max_steps=`` for status's step N/MAX: it became a flat ``train/max_steps``
    curve in TensorBoard (and W&B). The sinks get the metrics only; status still reads max_steps."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpc_ddp.rank.metrics.sinks import TensorBoardSink, log_to

    sink = TensorBoardSink(tmp_path, first_step=1)
    for step in (1, 2):
        assert log_to([sink], step, {"loss": 3.5 - step, "max_steps": 40}) == [sink]
    sink.close(stopped=False)
    tags = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]
    assert tags == ["train/loss"]


def test_every_attempt_that_compiled_has_a_compile_field_and_status_shows_it(tmp_path: Path) -> None:
    """The cold first attempt (79 s compiling) left no compile record: only a requeued attempt's timeline had one."""
    from hpc_ddp.login.status import compile_note, render
    from hpc_ddp.login.status.read import collect
    from hpc_ddp.rank.metrics.timeline import compile_field
    from tests.login.test_status import run_dir

    report = {"ended": 1.0, "seconds": 59.123, "cache": "miss", "graphs": 2, "hits": 0, "misses": 2}
    assert compile_field(report) == {"compile": {"cache": "miss", "s": 59.123, "graphs": 2}}
    assert compile_field(None) == {}
    assert compile_note({"cache": "hit", "s": 4.0, "graphs": 2}) == "compile hit 4.0 s, 2 graph(s)"
    assert compile_note(None) == compile_note({"cache": None}) == ""
    path = run_dir(tmp_path, attempts=[
        {"reason": "preemption", "restart_count": 0, "first_step": 0, "last_step": 21, **compile_field(report)},
        {"reason": "finished", "restart_count": 1, "first_step": 21, "last_step": 40, "resumed_from": 21}], done=True)
    rows = [line for line in render(collect(path)).splitlines() if line.startswith("  0 ") or line.startswith("  1 ")]
    assert rows[0].endswith("compile miss 59.1 s, 2 graph(s)") and rows[1].endswith(" 21"), rows
