"""Findings from a newcomer's trial of pytorch/examples' minGPT-ddp as ``train.script``: an admin's requeue,
status's time, ``${run_dir}`` at resume, ``--local`` program checks, a script that exits 0 at once, script-run
hints and messages. Pure functions and fault injection (fakes of Slurm's answers); no job is submitted."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.core.slurm_jobs import AlreadyRequeued, PreemptionError, RequeueRefused, requeue
from hpc_ddp.core.stopping import StopFlag
from hpc_ddp.rundir.ledger import read_attempts

PENDING = "Job is pending execution for job 58"  # what 22.05's `scontrol requeue 58` said after an admin's requeue


def test_scontrol_requeue_of_a_job_slurm_requeued_already_is_no_failure() -> None:
    answer = lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", PENDING)  # noqa: E731
    with pytest.raises(AlreadyRequeued) as err:
        requeue("58", answer)
    assert isinstance(err.value, PreemptionError) and not isinstance(err.value, RequeueRefused)
    assert "HINT" not in str(err.value) and "JobRequeue" not in str(err.value)


def _attempt(tmp_path: Path, restart_count: int = 0) -> Any:
    env = DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=2, node_rank=0, num_nodes=2,
                  master_addr="n2", master_port=1, job_id=58, restart_count=restart_count, source="slurm")
    flag = StopFlag()
    flag.signum, flag.received_at = signal.SIGTERM, 0.0
    cfg = SimpleNamespace(run_dir=str(tmp_path), slurm=SimpleNamespace(signal="USR2", signal_delay_s=120),
                          train=SimpleNamespace(script="main.py"))
    return SimpleNamespace(cfg=cfg, env=env, environ={"SLURM_JOB_ID": "58"}, flag=flag, attempts=[],
                           limits={"max_timeouts": 3, "max_preemptions": 3, "max_failures": 3}, wrapped=False,
                           record={"job_id": 58, "restart_count": restart_count, "in_job": 0, "start": 1.0},
                           ending=None, local=False, run_dir=tmp_path, end_time=None)


@pytest.mark.parametrize("fields", [
    {"JobState": "COMPLETING", "Reason": "None", "Restarts": "1"},  # the trial's job 58 at rank 0's SIGTERM
    {"JobState": "RUNNING", "Reason": "None", "PreemptTime": "None", "Restarts": "0"},  # asked before Slurm moved
])
def test_an_admins_requeue_is_recorded_as_slurms_and_no_false_error_is_logged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        fields: dict[str, str]) -> None:
    from hpc_ddp.rank.attempt import conclude

    requeued_fields = {"JobState": "PENDING", "Reason": "BeginTime", "Restarts": "1"}
    asked = iter([fields, requeued_fields, requeued_fields])
    monkeypatch.setattr(conclude, "job_fields", lambda spec, runner=None: next(asked))
    monkeypatch.setattr(conclude, "requeue_available", lambda: True)
    tried: list[str] = []

    def refuse(spec: str, runner: Any = None) -> None:
        tried.append(spec)
        raise PreemptionError(f"`scontrol requeue {spec}` failed: {PENDING}\nHINT: requeueing needs JobRequeue=1")

    monkeypatch.setattr(conclude, "requeue", refuse)
    with caplog.at_level(logging.INFO, logger="hpc_ddp.session"):
        conclude.conclude(_attempt(tmp_path), stopped=True, step=None)
    line = read_attempts(tmp_path)[-1]
    assert line["requeue_by"] == "slurm", line
    assert line["reason"] == ("requeued" if fields["JobState"] == "COMPLETING" else "preemption")
    assert tried == ([] if line["reason"] == "requeued" else ["58"])  # nobody requeues what Slurm requeued
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "JobRequeue" not in caplog.text and "resubmitting" not in caplog.text
    assert json.loads((tmp_path / "attempts.jsonl").read_text().splitlines()[0])["job_id"] == 58


def test_run_dir_in_train_args_is_the_same_absolute_dir_at_submit_and_at_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.core.config import save_config
    from hpc_ddp.login.resolve import resolve
    from hpc_ddp.rundir import layout

    monkeypatch.chdir(tmp_path)
    (tmp_path / "main.py").write_text("print('hi')\n")
    (tmp_path / "gpt.yaml").write_text("name: gpt\ntrain:\n  script: main.py\n  args:\n"
                                       "    - trainer_config.max_epochs=3\n"
                                       "    - trainer_config.snapshot_path=${run_dir}/snapshot.pt\n")
    cfg = resolve(["gpt.yaml"], ["run_dir=runs/m4"])
    absolute = str(tmp_path.resolve() / "runs" / "m4")
    assert cfg.run_dir == absolute
    assert cfg.train.args[-1] == f"trainer_config.snapshot_path={absolute}/snapshot.pt"  # was runs/m4/snapshot.pt
    save_config(cfg, layout.config(cfg.run_dir))
    capsys.readouterr()
    again = resolve(["gpt.yaml"], ["run_dir=runs/m4"], resume=True)
    assert "differs" not in capsys.readouterr().out
    assert again.train.args == cfg.train.args


def test_local_refuses_a_train_script_that_is_not_there_before_it_creates_the_run_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.login.submit import main

    (tmp_path / "gpt.yaml").write_text("name: gpt\ntrain:\n  script: mingpt/main.py\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(tmp_path / "gpt.yaml"), "--local", "run_dir=runs/x"]) == 2
    err = capsys.readouterr().err
    assert "train.script=mingpt/main.py does not exist" in err and "nothing was rehearsed" in err, err
    assert not (elsewhere / "runs").exists()


MINGPT_NO_GPU = "Unable to locate sufficient 2 gpus to run this example. Exiting."  # unmodified minGPT, exit 0


@pytest.mark.parametrize(("pattern", "lines", "ran_s", "warned"), [
    ("Epoch (\\d+)", ["Data has 2230 characters", MINGPT_NO_GPU], 30.0, True),  # no progress line, however long
    ("Epoch (\\d+)", ["[RANK0] Epoch 1 | Iter 0", "done"], 0.5, False),  # it trained
    (None, [MINGPT_NO_GPU], 0.4, True),  # no pattern: exit 0 within seconds
    (None, ["trained"], 60.0, False),
])
def test_a_script_that_exits_0_early_is_finished_with_a_warning_quoting_its_last_line(
        caplog: pytest.LogCaptureFixture, pattern: str | None, lines: list[str], ran_s: float, warned: bool) -> None:
    import re

    from hpc_ddp.rank.script.outcome import exited_early
    from hpc_ddp.rank.script.output import Progress

    progress = Progress(re.compile(pattern) if pattern else None)
    for line in lines:
        progress.feed(line + "\n")
    attempt = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(script_progress=pattern)), record={})
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.script"):
        note = exited_early(attempt, progress, ran_s)
    assert bool(note) == warned
    if warned:
        assert attempt.record["note"] == note and lines[-1] in note and "may have exited early" in note
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
    else:
        assert "note" not in attempt.record and not caplog.records


def test_a_rehearsed_script_that_exits_0_at_once_is_finished_with_the_warning_in_its_log_and_status(
        tmp_path: Path) -> None:
    from tests.helpers import submit

    script = tmp_path / "main.py"
    script.write_text(f"print('Data has 2230 characters')\nprint({MINGPT_NO_GPU!r})\n")
    run_dir = tmp_path / "early"
    proc = submit("examples/torchrun_script.yaml", "--local", "slurm.nodes=1", "slurm.tasks_per_node=1",
                  f"train.script={script}", "train.args=[]", "train.script_progress=Epoch (\\d+)", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "may have exited early" in out and MINGPT_NO_GPU in out, out[-2000:]
    [line] = read_attempts(run_dir)
    assert line["reason"] == "finished" and MINGPT_NO_GPU in line["note"]
    from hpc_ddp.login.status import render
    from hpc_ddp.login.status.read import collect

    assert "may have exited early" in render(collect(run_dir))


def test_the_batch_shells_line_for_a_failed_step_has_its_start_and_status_counts_its_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import datetime

    from hpc_ddp.core.config import load_config, save_config
    from hpc_ddp.core.slurm_jobs import start_time
    from hpc_ddp.login.status.read import timing
    from hpc_ddp.rundir import layout
    from hpc_ddp.shell import settle

    assert start_time({"StartTime": "2026-11-27T09:04:36"}) == datetime(2026, 11, 27, 9, 4, 36).timestamp()
    assert start_time({"StartTime": "Unknown"}) is None and start_time({}) is None
    run_dir = tmp_path / "s1"
    cfg = load_config([], ["name=s1", "train.script=main.py", f"run_dir={run_dir}",
                           "slurm.max_failures=0"])  # capped: nothing is requeued
    config = save_config(cfg, layout.config(run_dir))
    asked: list[str] = []
    monkeypatch.setattr(settle, "job_fields", lambda spec: asked.append(spec) or {"StartTime": "2026-11-27T09:04:36"})
    assert settle.main(["--exit-code", "137", str(config)], {"SLURM_JOB_ID": "44", "SLURM_RESTART_COUNT": "1"}) == 137
    [line] = read_attempts(run_dir)
    assert asked == ["44"] and line["reason"] == "failed"
    assert line["start"] == datetime(2026, 11, 27, 9, 4, 36).timestamp()
    assert timing([], [line], None, False, now=line["end"] + 99)["time_used_s"] == round(line["end"] - line["start"])


def test_a_script_runs_config_errors_say_its_arguments_go_in_train_args_and_list_items_can_be_named(
        tmp_path: Path) -> None:
    from hpc_ddp.core.config import load_config
    from hpc_ddp.core.errors import ConfigError

    config = tmp_path / "gpt.yaml"
    config.write_text("name: gpt\ntrain:\n  script: main.py\n  args:\n    - data_config.block_size=32\n"
                      "    - trainer_config.max_epochs=3\n")
    with pytest.raises(ConfigError) as err:
        load_config([config], ["trainer_config.max_epochs=5"])
    text = str(err.value)
    assert "its own arguments go in train.args" in text and "'train.args.1=trainer_config.max_epochs=5'" in text
    assert '\'train.args=["data_config.block_size=32", "trainer_config.max_epochs=5"]\'' in text
    assert "user.trainer_config" not in text  # the own-loop hint does not fit a script
    assert load_config([config], ["train.args.1=trainer_config.max_epochs=5"]).train.args[1].endswith("=5")
    assert load_config([config], ["train.args.2=--compile"]).train.args == [
        "data_config.block_size=32", "trainer_config.max_epochs=3", "--compile"]
    with pytest.raises(ConfigError) as past:
        load_config([config], ["train.args.8=x"])
    assert "train.args has 2 item(s)" in str(past.value).replace("train.args, which has", "train.args has")
    assert "cannot be unset" not in str(past.value) and "train.args.2=VALUE adds one at the end" in str(past.value)
    with pytest.raises(ConfigError) as own_loop:  # no train.script: the hint is as it was
        load_config([], ["name=x", "train.loop=m:f", "trainer_config.max_epochs=5"])
    assert "train.args" not in str(own_loop.value) and "user.trainer_config" in str(own_loop.value)


def test_a_script_runs_resume_says_what_is_true_for_a_script(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.core.config import load_config
    from hpc_ddp.login.guards import write_config
    from hpc_ddp.rundir import layout

    run_dir = tmp_path / "m6"
    args = ["name=m6", "train.script=main.py", f"run_dir={run_dir}"]
    write_config(load_config([], [*args, "train.args=[trainer_config.max_epochs=3]"]), resume=False)
    for n in (1, 2):  # finished, trained longer, finished again: both DONE.json are kept
        layout.done(run_dir).write_text(json.dumps({"script": "main.py", "world_size": 4, "exit_code": 0}))
        write_config(load_config([], [*args, f"train.args=[trainer_config.max_epochs={3 + n}]"]), resume=True)
        out = capsys.readouterr().out
        assert f"DONE.json is kept as {run_dir / f'DONE-finished-{n}.json'}" in out
        assert "goes on from its own checkpoint" in out and "train.args" in out
        for wrong in ("optimizer state", "learning rate", "None", "step 0", "metrics.jsonl are replaced"):
            assert wrong not in out, out
    assert sorted(p.name for p in run_dir.glob("DONE*")) == ["DONE-finished-1.json", "DONE-finished-2.json"]


def test_ctrl_c_of_a_script_rehearsal_says_no_snapshot_is_committed_by_hpc_ddp_on_rank_0_and_the_launcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.core.codes import EXIT_INTERRUPTED
    from hpc_ddp.core.config import load_config
    from hpc_ddp.login import rehearse
    from hpc_ddp.rank.attempt import conclude
    from hpc_ddp.rehearsal import local

    attempt = _attempt(tmp_path)
    attempt.flag.signum = signal.SIGINT
    with caplog.at_level(logging.INFO, logger="hpc_ddp.session"):
        assert conclude.conclude(attempt, stopped=True, step=None) == 0
    assert "interrupted (Ctrl-C): the script was ended (hpc_ddp commits no snapshot" in caplog.text
    assert "snapshot committed" not in caplog.text
    (tmp_path / "main.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local, "rehearse", lambda *a, **k: EXIT_INTERRUPTED)  # the ranks took Ctrl-C
    cfg = load_config([], ["name=g", "train.script=main.py", f"run_dir={tmp_path / 'g'}", "slurm.nodes=1"])
    assert rehearse.run_local(cfg, [], []) == EXIT_INTERRUPTED
    out = capsys.readouterr().out
    assert "interrupted: the script was ended (hpc_ddp commits no snapshot" in out and "no snapshot committed yet" \
        not in out


def test_status_says_how_many_attempts_it_could_not_time(tmp_path: Path) -> None:
    from hpc_ddp.login.status import render
    from hpc_ddp.login.status.read import collect, timing
    from hpc_ddp.rundir.ledger import append_attempt

    lines = [{"job_id": 44, "restart_count": 0, "reason": "preemption", "start": 100.0, "end": 160.0},
             {"job_id": 44, "restart_count": 1, "reason": "failed", "end": 300.0, "exit_code": 137}]  # an old shell's
    assert timing([], lines, None, False, now=400.0) == {"time_used_s": 60, "attempts": 2, "untimed": 1}
    for line in lines:
        append_attempt(tmp_path, line)
    (tmp_path / "job.json").write_text(json.dumps({"job_id": 44, "local": True, "host": socket.gethostname(),
                                                   "pid": 4194000}))  # a rehearsal whose launcher is gone
    assert "1m00s used over 2 attempt(s) (1 of them with no recorded start: not counted)" in render(collect(tmp_path))
