"""`status`'s exit code, a directory of runs as one line each, `--follow` with a fake clock, the loop's own
total and logged metrics, and Slurm's pending reason in words. Run dirs are written by hand (status only
reads files); the pending reason is read from the real cluster in tests/login/test_partition_limits.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.core import codes
from hpc_ddp.login.partition import explain_reason, pending_reason
from hpc_ddp.login.status import main, render
from hpc_ddp.login.status.read import collect, verdict
from hpc_ddp.login.status.runs import follow
from tests.login import test_status


def run_dir(where: Path, **kwargs) -> Path:  # noqa: ANN003
    """tests/login/test_status.py's hand-written run dir, at WHERE/run."""
    where.mkdir(parents=True, exist_ok=True)
    return test_status.run_dir(where, **kwargs)


@pytest.mark.parametrize("state, done, last, expected", [
    ("RUNNING (local)", False, None, "active"),
    ("PENDING", False, "timeout", "active"),  # requeued, waiting for its next attempt
    ("RUNNING", False, None, "active"),
    (None, True, "finished", "finished"),
    ("FAILED (local)", False, "failed", "failed"),
    ("STOPPED (local, cap reached)", False, "timeout", "stopped"),
    ("COMPLETED", False, "failed", "failed"),  # the job ended, the run did not: as its last attempt did
    ("COMPLETED", False, "preemption", "stopped"),
    ("CANCELLED by 1000", False, None, "stopped"),
    (None, False, "error", "failed"),  # Slurm forgot the job: the ledger says
    (None, False, None, "unknown"),
    ("NOT STARTED (local)", False, None, "unknown"),
])
def test_each_state_has_one_verdict(state: str | None, done: bool, last: str | None, expected: str) -> None:
    assert verdict(state, done, [{"reason": last}] if last else []) == expected


def test_status_of_a_failed_run_exits_nonzero_and_a_finished_one_zero(tmp_path: Path) -> None:
    """It exited 0 for a failed run: `status RUN && next-step` went on."""
    failed = run_dir(tmp_path / "a", attempts=[{"reason": "failed", "restart_count": 0}])
    stopped = run_dir(tmp_path / "b", attempts=[{"reason": "timeout", "capped": True, "restart_count": 0}])
    done = run_dir(tmp_path / "c", attempts=[{"reason": "finished"}], done=True)
    assert main([str(failed)]) == codes.STATUS_FAILED == 1
    assert main([str(stopped)]) == codes.STATUS_STOPPED == 3
    assert main([str(done)]) == codes.STATUS_OK == 0


def test_a_directory_of_runs_is_one_line_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    for name, attempts, done in (("a", [{"reason": "failed", "job_id": 7}], False), ("b", [], True)):
        run_dir(runs / name, attempts=attempts, done=done,
                metrics=[{"step": s, "loss": 1.0} for s in (10, 20)])
    code = main([str(runs)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "state", "step", "last", "attempt", "job"]
    assert lines[1].split() == ["a/run", "FAILED", "(local)", "20/100", "#0", "failed", "5"]
    assert lines[2].split() == ["b/run", "FINISHED", "20/100", "-", "5"]
    assert code == codes.STATUS_FAILED  # the worst run's
    assert json.loads(_json(runs, capsys))[1]["verdict"] == "finished"


def _json(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    main([str(path), "--json"])
    return capsys.readouterr().out


def test_follow_refreshes_until_the_run_ends_with_a_fake_clock() -> None:
    views = iter([("pending", ["active"]), ("running", ["active"]), ("failed", ["failed"])])
    slept, shown, now = [], [], [1000.0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    code = follow(lambda: next(views), 15, out=shown.append, sleep=sleep, clock=lambda: now[0])
    assert code == codes.STATUS_FAILED and slept == [15, 15]
    assert [text.splitlines()[1] for text in shown] == ["pending", "running", "failed"]
    assert all(text.startswith("--- ") for text in shown)


def test_follow_on_the_command_line_stops_at_once_for_an_ended_run(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = run_dir(tmp_path, attempts=[{"reason": "finished"}], done=True)
    assert main([str(path), "--follow", "--every", "0.01"]) == 0
    assert "state FINISHED" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(path), "--follow", "--every", "0"])


def test_an_own_loop_that_counts_past_train_max_steps_shows_no_false_max(tmp_path: Path) -> None:
    """`step 1500/100`: the config's max_steps was shown for a loop with its own count."""
    loop = ("train.task=null", "train.loop=examples.own_loop_gpt:train")
    past = run_dir(tmp_path / "a", metrics=[{"step": 1500, "loss": 0.5}], overrides=loop)
    assert "step    1500  loss 0.5" in render(collect(past))
    declared = run_dir(tmp_path / "b", metrics=[{"step": 1500, "loss": 0.5, "max_steps": 3000}], overrides=loop)
    assert "step    1500/3000" in render(collect(declared))
    within = run_dir(tmp_path / "c", metrics=[{"step": 50, "loss": 0.5}], overrides=loop)
    assert "step    50/100" in render(collect(within))


def test_eval_metrics_a_loop_logs_are_shown_with_their_newest_value(tmp_path: Path) -> None:
    path = run_dir(tmp_path, metrics=[{"step": 10, "loss": 1.0}, {"step": 10, "val_loss": 1.5},
                                      {"step": 20, "loss": 0.8}, {"step": 20, "acc": 0.7}, {"step": 25, "loss": 0.6}])
    text = render(collect(path))
    assert "step    25/100  loss 0.6" in text
    assert "metrics val_loss 1.5 (step 10)  acc 0.7 (step 20)" in text


def test_the_plot_has_a_panel_per_logged_metric(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is in the dev extra that CI installs")
    _plotted = test_status._plotted

    path = run_dir(tmp_path, metrics=[{"step": s, "loss": 1.0 / s, **({"val_loss": 2.0 / s} if s % 5 == 0 else {})}
                                      for s in range(1, 21)])
    fig = _plotted(path, tmp_path / "p.png")
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss (mean over ranks)", "val_loss"]
    assert list(fig.axes[1].lines[-1].get_xdata()) == [5, 10, 15, 20]


def test_a_pending_reason_is_read_from_squeue_and_said_in_words() -> None:
    def squeue(cmd, **_kwargs):  # noqa: ANN001
        assert cmd == ["squeue", "-h", "-j", "42", "-o", "%r"]
        return subprocess.CompletedProcess(cmd, 0, "PartitionNodeLimit\n", "")

    assert pending_reason("42", squeue) == "PartitionNodeLimit"
    assert "will never start" in explain_reason("PartitionNodeLimit")
    assert explain_reason("Priority").startswith("Priority: other jobs come first")
    assert explain_reason("Odd") == "Odd (see `man squeue`, JOB REASON CODES)"
    info = {"run_dir": "r", "job_id": "42", "state": "PENDING", "pending_reason": "Resources", "progress": {},
            "attempts": [], "done": None, "newest_snapshot": None}
    assert "waiting Resources: it is next, waiting for enough nodes" in render(info)
