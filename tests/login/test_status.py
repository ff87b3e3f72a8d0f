"""`python -m hpc_ddp.status`: a state for every kind of run, time used and an ETA, one row per step, and a
clear refusal of a directory that is not a run. Run dirs are written by hand here (ledger, metrics, job.json):
status only reads files, so these are its real inputs."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config, save_config
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.rundir import metrics_file
from hpc_ddp.login.status.read import collect, local_state, timing
from hpc_ddp.login.status import main, render

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.yaml")


def run_dir(tmp_path: Path, attempts: list[dict] = (), metrics: list[dict] = (), done: bool = False,
            alive: bool = False, overrides: tuple[str, ...] = ()) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    save_config(load_config([MLP], [f"run_dir={path}", "train.max_steps=100", *overrides]), path / "config.yaml")
    (path / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "job.json").write_text(json.dumps({"job_id": 5, "local": True, "pid": os.getpid() if alive else 2**22,
                                               "host": socket.gethostname()}))
    if done:
        (path / "DONE.json").write_text(json.dumps({"step": 100, "params_sha256": "ab" * 32}))
    return path


@pytest.mark.parametrize("attempts,done,alive,state", [
    ([], False, True, "RUNNING (local)"),
    ([{"reason": "finished"}], True, False, "FINISHED"),
    ([{"reason": "preemption"}], False, False, "STOPPED (local, --resume continues it)"),
    ([{"reason": "timeout", "capped": True}], False, False, "STOPPED (local, cap reached)"),
    ([{"reason": "failed"}], False, False, "FAILED (local)"),
    ([{"reason": "error"}], False, False, "FAILED (local)"),
    ([], False, False, "NOT STARTED (local)"),
])
def test_a_local_run_has_a_state_from_its_launcher_and_ledger(attempts: list[dict], done: bool, alive: bool,
                                                              state: str) -> None:
    assert local_state(attempts, done, alive) == state


def test_a_step_logged_twice_shows_once_with_the_later_value(tmp_path: Path) -> None:
    path = run_dir(tmp_path, metrics=[{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.5},
                                      {"step": 3, "loss": 1.0}])
    (path / "metrics.jsonl").write_text((path / "metrics.jsonl").read_text() + '{"step": 4, "lo')  # cut by a crash
    assert [(m["step"], m["loss"]) for m in metrics_file.read(path)] == [(1, 3.0), (2, 1.5), (3, 1.0)]


def test_while_an_attempt_replays_steps_status_shows_its_step_not_the_crashed_attempts(tmp_path: Path) -> None:
    # attempt 0 logged up to 25 and crashed (snapshot 20); attempt 1 resumed from 20 and is at step 22 now
    crashed = [{"step": s, "loss": 1.0, "time": 1000.0 + s} for s in range(1, 26)]
    resumed = [{"step": s, "loss": 0.5, "time": 2000.0 + s} for s in (21, 22)]
    path = run_dir(tmp_path, attempts=[{"reason": "failed", "start": 1000.0, "end": 1030.0, "last_step": 25}],
                   metrics=crashed + resumed, alive=True)
    progress = collect(path)["progress"]
    assert (progress["step"], progress["loss"]) == (22, 0.5)  # what the run has now, as TensorBoard shows it


def test_time_used_adds_every_attempt_and_the_eta_comes_from_recent_steps() -> None:
    attempts = [{"start": 1000.0, "end": 1100.0}, {"start": 1200.0, "end": 1260.0}]
    metrics = [{"step": s, "time": 1300.0 + 2 * (s - 40)} for s in range(40, 61)]  # 0.5 steps/s now
    got = timing(metrics, attempts, max_steps=100, running=True, now=1345.0)
    assert got == {"time_used_s": 160 + 45, "attempts": 3, "steps_per_s": 0.5, "eta_s": 80}
    assert timing(metrics, attempts, 100, running=False, now=1345.0) == {"time_used_s": 160, "attempts": 2}
    # the running attempt's lock says when it began: its start-up before the first metric counts too
    assert timing(metrics, attempts, 100, running=True, now=1345.0, started=1280.0)["time_used_s"] == 160 + 65


def test_status_prints_the_state_time_and_eta_of_a_running_local_run(tmp_path: Path) -> None:
    import time

    now = time.time()
    path = run_dir(tmp_path, alive=True, attempts=[{"reason": "preemption", "start": now - 500, "end": now - 400,
                                                     "first_step": 0, "last_step": 30, "restart_count": 0}],
                   metrics=[{"step": s, "loss": 1.0, "time": now - 60 + s - 40} for s in range(40, 61)])
    text = render(collect(path))
    assert "state RUNNING (local)" in text and "step    60/100" in text
    assert "used over 2 attempt(s); about 0m40s left at 1.0 steps/s" in text  # the running one counts
    assert "preemption       0->30" in text


def test_status_says_how_many_steps_each_failure_threw_away(tmp_path: Path) -> None:
    """A failure costs the steps since the snapshot the next attempt resumed from (issue 35): status says how
    many, for a healed failure and for one whose next attempt has not started; a stop loses none."""
    from hpc_ddp.rundir.ledger_history import steps_lost

    attempts = [{"reason": "failed", "job_id": 5, "restart_count": 0, "first_step": 0, "last_step": 37,
                 "snapshot": 30},
                {"reason": "preemption", "job_id": 5, "restart_count": 0, "in_job": 1, "first_step": 31,
                 "last_step": 50, "resumed_from": 30},
                {"reason": "lost", "job_id": 5, "restart_count": 1, "first_step": 51, "last_step": 58, "resumed_from": 50,
                 "snapshot": 50}]
    assert steps_lost(attempts) == {0: {"last_step": 37, "resumed_from": 30, "pending": False, "lost": 7},
                                    2: {"last_step": 58, "resumed_from": 50, "pending": True, "lost": 8}}
    text = render(collect(run_dir(tmp_path, attempts=attempts)))
    assert "#0: lost 7 step(s): got to step 37, resumed from 30" in text
    assert "#2: lost 8 step(s): got to step 58, will resume from 50" in text and "#1: lost" not in text
    # a hung line names no snapshot (a newcomer's status said "will resume from the start" and the run resumed
    # from step 4): the newest committed snapshot is where the next attempt resumes
    hung = [{"reason": "hung", "job_id": 6, "restart_count": 0, "first_step": 0, "last_step": 4}]
    assert steps_lost(hung, newest=4) == {0: {"last_step": 4, "resumed_from": 4, "pending": True, "lost": 0}}
    assert steps_lost(hung)[0]["resumed_from"] is None
    # per_rank(..., mirror=N): the survivors' snapshot lost no step of the model, but the per-rank state is older
    (stale_dir := tmp_path / "stale").mkdir()
    stale = [{"reason": "failed", "job_id": 7, "restart_count": 0, "last_step": 23,
              "jit_snapshot": {"step": 23, "per_rank_stale": {"0": 20, "1": 20, "2": 20, "3": 20}}},
             {"reason": "finished", "job_id": 7, "restart_count": 0, "in_job": 1, "resumed_from": 23}]
    assert "#0: lost 0 step(s): got to step 23, resumed from 23; per-rank state of 4 rank(s) from step 20 " \
           "(per_rank(..., mirror=N))" in render(collect(run_dir(stale_dir, attempts=stale)))
    # the lost ranks' per-rank states came from their buddies' mirror: the ledger and status say which
    (mirrored_dir := tmp_path / "mirrored").mkdir()
    stale[0]["jit_snapshot"] = {"step": 23, "per_rank_held_by": {"3": 1, "2": 0}}
    assert "#0: lost 0 step(s): got to step 23, resumed from 23; per-rank state of rank(s) 2, 3 from their " \
           "buddies' mirror (rank(s) 0, 1)" in render(collect(run_dir(mirrored_dir, attempts=stale)))


def test_an_attempt_whose_line_its_ranks_did_not_write_starts_where_its_first_metrics_line_says(
        tmp_path: Path) -> None:
    """A lost node's attempt is recorded by the batch shell or the launcher, which know where it ended, not
    where it began: a newcomer's status showed ``failed 0->25`` for an attempt resumed from 16. Its rank 0's
    first metrics line says (``_resumed_from``, ``_attempt``)."""
    attempts = [{"reason": "preemption", "job_id": 5, "restart_count": 0, "first_step": 0, "last_step": 8},
                {"reason": "failed", "job_id": 5, "restart_count": 1, "last_step": 25, "snapshot": 25},
                {"reason": "finished", "job_id": 5, "restart_count": 1, "in_job": 1, "first_step": 25,
                 "last_step": 40, "resumed_from": 25}]
    metrics = [{"step": s, "loss": 1.0, **({"_resumed_from": 0, "_attempt": 0} if s == 1 else {}),
                **({"_resumed_from": 8, "_attempt": 1} if s == 9 else {})} for s in range(1, 26)]
    text = render(collect(run_dir(tmp_path, attempts=attempts, metrics=metrics)))
    assert "failed           8->25" in text and "failed           0->25" not in text
    assert "preemption       0->8" in text and "finished         25->40" in text


def test_a_run_that_failed_before_its_first_step_says_so(tmp_path: Path) -> None:
    path = run_dir(tmp_path, attempts=[{"reason": "failed", "job_id": 5, "restart_count": 0}])
    text = render(collect(path))
    assert "state FAILED (local)" in text and "failed           before step 1 " in text and "None" not in text


def test_a_directory_that_is_not_a_run_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run directory (it has no config.yaml)" in capsys.readouterr().err
    assert main([str(tmp_path / "nope")]) == 2
    assert "(it does not exist)" in capsys.readouterr().err


def _plotted(path: Path, out: Path):  # noqa: ANN202
    """status.plot's figure, kept as it is saved."""
    import matplotlib.pyplot as plt

    from hpc_ddp.login import status

    captured, real = {}, plt.Figure.savefig

    def keep(fig, target, *args, **kwargs):  # noqa: ANN001
        captured["fig"] = fig
        return real(fig, target, *args, **kwargs)

    plt.Figure.savefig = keep
    try:
        status.plot(path, out)
    finally:
        plt.Figure.savefig = real
    return captured["fig"]


def test_the_plot_labels_each_attempt_and_names_the_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is in the dev extra that CI installs")
    path = run_dir(tmp_path, attempts=[{"reason": "preemption", "first_step": 0, "last_step": 30},
                                       {"reason": "finished", "first_step": 30, "last_step": 60}],
                   metrics=[{"step": s, "loss": 3.0 / s} for s in range(1, 61)])
    ax = _plotted(path, tmp_path / "loss.png").axes[0]
    assert ax.get_title() == "mlp: loss" and ax.get_ylabel() == "loss (mean over ranks)"
    assert [t.get_text() for t in ax.texts] == ["#1 after preemption"]
    labels = [t.get_text() for t in ax.get_yticklabels(minor=True) + ax.get_yticklabels() if t.get_text()]
    assert labels and not any("times" in t or "^" in t for t in labels)  # plain numbers, no 2.4x10^0


@pytest.mark.parametrize("span", [1000.0, 3.0])
def test_the_plots_tick_labels_never_overlap(tmp_path: Path, span: float) -> None:
    """A loss over several decades labelled every minor tick (2, 3, ... 9 of each decade): they overlapped."""
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is in the dev extra that CI installs")
    path = run_dir(tmp_path, metrics=[{"step": s, "loss": 0.05 * span ** (1 - s / 100)} for s in range(1, 101)])
    fig = _plotted(path, tmp_path / "loss.png")
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    fig.canvas.draw()
    shown = [t for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)
             if t.get_text() and t.get_visible() and low <= t.get_position()[1] <= high]
    boxes = sorted((t.get_window_extent() for t in shown), key=lambda box: box.y0)
    assert len(boxes) >= 2, [t.get_text() for t in shown]  # a scale can be read off
    assert all(lower.y1 <= upper.y0 for lower, upper in zip(boxes, boxes[1:])), [t.get_text() for t in shown]


def test_an_own_loops_plot_says_whose_loss_and_a_script_run_says_how_to_get_one(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is in the dev extra that CI installs")
    from hpc_ddp.login import status

    for sub in "ab":
        (tmp_path / sub).mkdir()
    loop = run_dir(tmp_path / "a", metrics=[{"step": s, "loss": 1.0 / s} for s in range(1, 9)],
                   overrides=("train.task=null", "train.loop=examples.own_loop_gpt:train"))
    assert _plotted(loop, tmp_path / "loop.png").axes[0].get_ylabel() == "loss (as rank 0 logged it)"
    script = run_dir(tmp_path / "b", overrides=("train.task=null", "train.script=examples/torchrun_script.py"))
    with pytest.raises(HpcDdpError, match="a train.script run writes no metrics of its own"):
        status.plot(script, tmp_path / "script.png")


@pytest.mark.parametrize("done, shown", [
    ({"script": "examples/torchrun_script.py", "world_size": 4, "exit_code": 0},
     "done    script examples/torchrun_script.py exited 0"),  # a train.script run: no step (it crashed: KeyError)
    ({"step": 40, "world_size": 4}, "done    step 40"),  # a loop that tracked no model: no params_sha256
    ({"step": 100, "params_sha256": "ab" * 32, "world_size": 4}, "done    step 100  params_sha256 abababab"),
])
def test_status_shows_every_kind_of_finished_run(tmp_path: Path, done: dict, shown: str) -> None:
    path = run_dir(tmp_path, attempts=[{"reason": "finished", "restart_count": 0, "start": 1.0, "end": 9.0}])
    (path / "DONE.json").write_text(json.dumps(done))
    text = render(collect(path))
    assert "state FINISHED" in text and shown in text


def test_status_runs_as_a_user_runs_it_from_another_directory(tmp_path: Path) -> None:
    """As ``python -m hpc_ddp.status`` (a helper defined below the ``__main__`` guard once passed the in-process
    tests and failed every user with a NameError)."""
    import subprocess
    import sys

    path = run_dir(tmp_path, attempts=[{"reason": "finished", "restart_count": 0, "start": 1.0, "end": 9.0}], done=True)
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "state FINISHED" in proc.stdout and "done    step 100  params_sha256 abababab" in proc.stdout


SURVIVOR = """[rank 0] 14:43:39 ERROR hpc_ddp.worker: training failed
Traceback (most recent call last):
  File "/work/main/hpc_ddp/trainer.py", line 168, in _run_step
    self.scaler.scale(loss / self.grad_accum).backward()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:49871. \
This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.
"""
CRASHED = """[rank 1] 14:43:39 ERROR hpc_ddp.worker: training failed
Traceback (most recent call last):
  File "/work/main/tests/tasks/__init__.py", line 59, in loss
    raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
RuntimeError: injected failure on rank 1 at step 13.0
"""


def _log(path: Path, text: str, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))


def test_last_errors_show_the_crashed_ranks_exception_not_a_survivors_connection_closed_by_peer(tmp_path) -> None:
    """The survivor writes its traceback last; the newest log with a traceback was shown, and it blamed a peer."""
    path = run_dir(tmp_path, attempts=[{"reason": "failed", "job_id": 5, "restart_count": 0, "last_step": 10}])
    _log(path / "logs" / "attempt-0-rank-0.log", "older attempt\n" + CRASHED.replace("13.0", "3.0"), 100.0)
    _log(path / "logs" / "attempt-1-rank-1.log", CRASHED, 200.0)
    _log(path / "logs" / "attempt-1-rank-0.log", SURVIVOR, 201.0)
    text = render(collect(path))
    assert f"{path / 'logs' / 'attempt-1-rank-1.log'}:" in text
    assert "injected failure on rank 1 at step 13.0" in text and "Connection closed by peer" not in text
    submitit = tmp_path / "submitit"  # a job's per-task logs (%j_%t_log.err): the same choice
    _log(submitit / "slurm" / "77_0_log.err", SURVIVOR, 301.0)
    _log(submitit / "slurm" / "77_1_log.err", CRASHED, 300.0)
    assert collect_errors(submitit)[0] == f"{submitit / 'slurm' / '77_1_log.err'}:"
    killed = tmp_path / "killed"  # a rank killed outright writes no traceback: the survivor's view is all there is
    _log(killed / "logs" / "attempt-0-rank-0.log", SURVIVOR, 400.0)
    _log(killed / "logs" / "attempt-0-rank-1.log", "[rank 1] 14:43:38 INFO step 10\n", 399.0)
    assert "Connection closed by peer" in collect_errors(killed)[-1]


def collect_errors(run: Path) -> list[str]:
    from hpc_ddp.login.failure_logs import last_errors

    return last_errors(run, run / "slurm")


@pytest.mark.slow
def test_status_of_a_rehearsal_where_rank_1_raised_shows_rank_1s_exception(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(MLP).parent.parent
    path = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", MLP, "--local", "slurm.nodes=2",
                           "slurm.tasks_per_node=1", "train.max_steps=40", "snapshot.every_steps=10",
                           "slurm.max_restarts_in_job=0", "train.task=tests.tasks:Faulty", f"run_dir={path}"],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HPC_DDP_TEST_FAULT": "raise:1:13"})
    assert proc.returncode != 0 and "injected failure on rank 1" in proc.stderr, proc.stderr[-3000:]
    shown = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(path)], cwd=root, capture_output=True,
                           text=True, timeout=120).stdout
    errors = shown.split("last errors:")[1]
    assert "attempt-0-rank-1.log:" in errors and "RuntimeError: injected failure on rank 1 at step 13" in errors
    assert "Connection closed by peer" not in errors


def test_a_stop_that_broke_a_step_is_a_note_that_says_what_it_cost_and_the_fix() -> None:
    from hpc_ddp.login.status import broken_stop_note

    kept = broken_stop_note({"error": "DataLoader worker (pid 7) is killed by signal: Terminated.", "held": 15,
                             "snapshot": 15, "child_killed": True})
    assert "kept the step every rank held" in kept and "worker_init_fn=hpc_ddp.worker_init()" in kept
    lost = broken_stop_note({"error": "EOFError", "held": 15, "snapshot": 10, "child_killed": False})
    assert "resumes from step 10 (5 step(s) lost)" in lost and "worker_init" not in lost


def test_a_scripts_progress_file_gives_status_its_step_and_eta(tmp_path: Path) -> None:
    """A train.script writes no metrics.jsonl: status read no step and no ETA while it ran. Rank 0's worker keeps
    the script's recent steps in script_progress.json (rundir/script_progress.py); status reads them."""
    from hpc_ddp.rundir import script_progress

    line = "[rank 0] epoch 1 step 40 loss 0.25"
    points = [script_progress.point(30, "step 30", 1000.0), script_progress.point(40, line, 1010.0)]
    script_progress.write(tmp_path, {"attempt": "job-1-restart-0", "points": points})
    assert script_progress.points(tmp_path) == [{"step": 30, "time": 1000.0}, {"step": 40, "time": 1010.0, "loss": 0.25}]
    shown = timing(script_progress.points(tmp_path), [], 100, True, now=1011.0)
    assert shown["steps_per_s"] == 1.0 and shown["eta_s"] == 60


def test_status_piped_into_a_reader_that_closed_exits_quietly(tmp_path: Path) -> None:
    """``status RUN | head`` once ended in a BrokenPipeError traceback: a real pipe whose read end is closed."""
    import subprocess
    import sys

    path = run_dir(tmp_path, attempts=[{"reason": "finished", "restart_count": 0, "start": 1.0, "end": 9.0}], done=True)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before status writes a byte: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(path)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 141, proc.stderr


def test_status_says_which_node_a_failure_lost_how_it_was_noticed_by_whom_and_when(tmp_path: Path) -> None:
    """Issue 60: a partitioned node's declaration, as the ledger has it (losses.ledger_fields), in status."""
    import time

    declared = 1796400000.0
    message = ("ranks 2, 3 on n1 lost (no answer over the training network for 3s, its beats in the run dir still "
               "came (0s ago): its link is down or cut off, seen by node 0's watcher (n0))")
    attempts = [{"reason": "failed", "job_id": 5, "restart_count": 0, "first_step": 0, "last_step": 23,
                 "lost_ranks": [2, 3], "lost_hosts": ["n1"], "message": message, "lost_at": declared},
                {"reason": "finished", "job_id": 5, "restart_count": 0, "in_job": 1, "resumed_from": 22}]
    text = render(collect(run_dir(tmp_path, attempts=attempts)))
    assert f"#0: at {time.strftime('%H:%M:%S', time.localtime(declared))}: {message}" in text, text


def test_status_says_which_node_was_slow_by_how_much_and_since_when() -> None:
    from hpc_ddp.login.status.render import slow_note

    note = slow_note({"n2": {"node": 1, "x": 1.7, "since_step": 31, "until_step": 90},
                             "n4": {"node": 3, "x": 1.3, "since_step": 50, "until_step": None}})
    assert note == ("slow node(s): n2 (node 1): busy 1.7 x the other nodes' median per step from step 31 to step 90; "
                    "n4 (node 3): busy 1.3 x the other nodes' median per step from step 50")


def test_status_says_which_nodes_failed_the_health_check_why_and_whether_they_were_kept(tmp_path: Path) -> None:
    from hpc_ddp.login.status.render import health_note

    health = {"checks": "quick", "seconds": 0.9, "nodes": {}, "sick": {"n3": "a matmul at 5 GFLOP/s against the "
                                                                           "other nodes' median of 100"}}
    assert health_note(health) == ("health check (quick, 0.9s): sick: n3: a matmul at 5 GFLOP/s against the other "
                                   "nodes' median of 100")
    assert health_note({**health, "kept": "no spare"}).endswith("median of 100 (kept: no spare)")
    attempts = [{"reason": "slow", "job_id": 5, "restart_count": 0, "replace": ["n3"], "health": health},
                {"reason": "finished", "job_id": 5, "restart_count": 0, "in_job": 1, "resumed_from": 1,
                 "health": {**health, "sick": {}}}]
    text = render(collect(run_dir(tmp_path, attempts=attempts)))
    assert "#0: health check (quick, 0.9s): sick: n3" in text and "#1: health" not in text, text


def test_status_of_a_running_job_shows_the_slow_nodes_its_attempt_named_until_its_ledger_line_has_them(
        tmp_path: Path) -> None:
    from hpc_ddp.login.status.read import _slow_now
    from hpc_ddp.rundir.ledger import append_attempt, read_attempts

    (tmp_path / "liveness").mkdir()
    named = {"n2": {"node": 1, "x": 1.9, "since_step": 31, "until_step": None}}
    (tmp_path / "liveness" / "slow.json").write_text(json.dumps({"job_id": 7, "restart_count": 0, "in_job": 0,
                                                                 "slow_nodes": named}))
    assert _slow_now(tmp_path, []) == named
    append_attempt(tmp_path, {"job_id": 7, "restart_count": 0, "reason": "finished", "slow_nodes": named})
    assert _slow_now(tmp_path, read_attempts(tmp_path)) is None  # the ledger line has them now
    (tmp_path / "liveness" / "slow.json").write_text("{not json")
    assert _slow_now(tmp_path, []) is None


def test_an_attempts_shape_says_accumulation_only_where_there_is_some() -> None:
    """A newcomer's 2x2 rehearsal showed '2x2' for its failed attempt and '2x2 accum 1' for the others: read as two
    shapes. One micro-step is no accumulation; two or more are said."""
    from hpc_ddp.login.status.render import _shape

    assert _shape({"world_size": 4, "nodes": 2, "grad_accum": 1}) == "2x2"
    assert _shape({"world_size": 2, "nodes": 1, "grad_accum": 4}) == "1x2 accum 4"
    assert _shape({"hosts": "node[0-1]"}, tasks_per_node=2) == "2x2"  # a failed line: no world size
    assert _shape({"world_size": 3, "nodes": 2}) == "3 ranks"
