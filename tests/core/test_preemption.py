"""The pure parts of the stop protocol: the flag, the reason, the requeue command, the ledger, the caps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.slurm_jobs import PreemptionError, job_spec, requeue
from hpc_ddp.core.stopping import StopFlag, signal_number, stop_reason
from hpc_ddp.rundir.ledger import append_attempt, cap_reached, read_attempts

USR2, TERM = int(signal.SIGUSR2), int(signal.SIGTERM)
LIMITS = {"max_timeouts": 2, "max_preemptions": 1, "max_failures": 0}


def test_the_handler_only_records_the_first_signal() -> None:
    flag = StopFlag()
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        flag.install([signal.SIGUSR2])
        assert not flag.is_set
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.is_set and flag.signum == USR2 and flag.received_at is not None
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize(("signum", "received", "end", "reason"), [
    (TERM, 1000.0, 5000.0, "preemption"),        # SIGTERM: preemption or cancel
    (USR2, 4880.0, 5000.0, "timeout"),           # 120 s before the end: the time-limit warning
    (USR2, 4850.0, 5000.0, "timeout"),           # up to one 30 s tick (+ margin) early
    (USR2, 1000.0, 5000.0, "preemption"),        # long before the end: preempt_send_user_signal
    (USR2, 1000.0, None, "timeout"),             # end unknown (local simulation): the warning means time-out
])
def test_stop_reason(signum: int, received: float, end: float | None, reason: str) -> None:
    assert stop_reason(signum, USR2, received, end, signal_delay_s=120) == reason


def test_job_spec_is_array_aware() -> None:
    assert job_spec({"SLURM_JOB_ID": "42"}) == "42"
    assert job_spec({"SLURM_JOB_ID": "57", "SLURM_ARRAY_JOB_ID": "50", "SLURM_ARRAY_TASK_ID": "7"}) == "50_7"
    assert signal_number("USR2") == USR2


def test_requeue_without_scontrol_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PreemptionError, match="(?s)scontrol is not on PATH.*snapshot is committed"):
        requeue("42")


def test_requeue_failure_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "scontrol"  # fault injection: a scontrol that refuses
    fake.write_text("#!/bin/sh\necho 'Requested operation is disabled' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PreemptionError, match="JobRequeue=1"):
        requeue("42", runner=subprocess.run)


def test_ledger_round_trip_skips_damaged_lines(tmp_path: Path) -> None:
    append_attempt(tmp_path, {"reason": "timeout", "job_id": 1})
    with open(tmp_path / "attempts.jsonl", "a") as out:
        out.write("{not json\n")
    append_attempt(tmp_path, {"reason": "finished", "job_id": 2})
    assert [a["reason"] for a in read_attempts(tmp_path)] == ["timeout", "finished"]


def test_a_resume_starts_the_caps_afresh_and_its_ledger_line_is_no_attempt(tmp_path: Path) -> None:
    from hpc_ddp.rundir.ledger import start_caps_afresh

    append_attempt(tmp_path, {"reason": "preemption", "job_id": 1, "restart_count": 0, "capped": True})
    assert cap_reached("preemption", read_attempts(tmp_path) + [{"reason": "preemption"}], LIMITS)
    start_caps_afresh(tmp_path)  # a person's --resume
    attempts = read_attempts(tmp_path)
    assert [a["reason"] for a in attempts] == ["preemption"] and attempts[0]["before_resume"] is True
    assert cap_reached("preemption", attempts, LIMITS) is None  # what the worker asks at start: it may run
    assert cap_reached("preemption", attempts + [{"reason": "preemption"}], LIMITS) is None  # 1 of 1 allowed
    append_attempt(tmp_path, {"reason": "preemption", "job_id": 2, "restart_count": 0})
    message = cap_reached("preemption", read_attempts(tmp_path) + [{"reason": "preemption"}], LIMITS)
    assert message and "stopped for preemption 2 times since its last --resume, more than slurm.max_preemptions=1" \
        in message and "--resume continues it" in message
    start_caps_afresh(tmp_path)  # the last resume counts: every earlier attempt is before it
    assert all(a.get("before_resume") for a in read_attempts(tmp_path))
    assert cap_reached("failed", read_attempts(tmp_path) + [{"reason": "failed"}], LIMITS) is not None  # 0 allowed


def test_caps_count_this_attempt() -> None:
    assert cap_reached("preemption", [{"reason": "preemption"}], LIMITS) is None
    message = cap_reached("preemption", [{"reason": "preemption"}] * 2, LIMITS)
    assert message and "slurm.max_preemptions=1" in message and "HINT" in message
    assert cap_reached("timeout", [{"reason": "timeout"}] * 3, LIMITS)
    assert cap_reached("finished", [{"reason": "finished"}] * 9, LIMITS) is None


# What `scontrol show job` said at a task's first SIGTERM on the local 22.05 cluster (issue 43, measured)
TERM_CASES = [
    ({"JobState": "COMPLETING", "Reason": "None", "PreemptTime": "None", "Restarts": "0"}, 0, "cancelled"),  # scancel
    ({"JobState": "RUNNING", "Reason": "None", "PreemptTime": "2026-11-26T12:35:13", "Restarts": "0"}, 0,
     "preemption"),  # preempted, Slurm's default SIGTERM, within the grace time
    ({"JobState": "COMPLETING", "Reason": "None", "Restarts": "1"}, 0, "requeued"),  # the grace time's end: requeued
    ({"JobState": "COMPLETING", "Reason": "None", "PreemptTime": "None", "Restarts": "1"}, 0, "requeued"),  # admin's
    ({"JobState": "REQUEUED", "Reason": "None", "PreemptTime": "None", "Restarts": "0"}, 0, "requeued"),  # requeue
    ({"JobState": "COMPLETING", "Reason": "TimeLimit", "PreemptTime": "None", "Restarts": "0"}, 0, "timeout"),
    ({"JobState": "COMPLETING", "Reason": "None", "PreemptTime": "None", "Restarts": "2"}, 2, "cancelled"),
    ({"JobState": "RUNNING", "Reason": "None", "PreemptTime": "None", "Restarts": "0"}, 0, None),  # --signal=TERM
    ({}, 0, None),  # Slurm could not be asked
]


@pytest.mark.parametrize(("fields", "restart_count", "reason"), TERM_CASES)
def test_a_sigterms_reason_comes_from_what_slurm_says_of_the_job(fields: dict[str, str], restart_count: int,
                                                                  reason: str | None) -> None:
    from hpc_ddp.core.stopping import term_reason

    assert term_reason(fields, restart_count) == reason


def test_scontrols_one_line_is_read_for_the_fields_a_reason_needs() -> None:
    from hpc_ddp.core.slurm_jobs import job_fields

    line = ("JobId=5 JobName=x UserId=root(0) Priority=1 JobState=RUNNING Reason=None Dependency=(null) Requeue=1 "
            "Restarts=0 BatchFlag=1 RunTime=00:00:03 TimeLimit=00:10:00 SubmitTime=2026-11-26T12:35:00 "
            "EndTime=2026-11-26T12:35:23 PreemptEligibleTime=2026-11-26T12:35:01 PreemptTime=2026-11-26T12:35:13 "
            "WorkDir=/tmp/a b StdOut=/tmp/o\n")
    calls: list[list[str]] = []

    def runner(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, line, "")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
        fields = job_fields("5", runner)
    assert calls == [["scontrol", "show", "job", "-o", "5"]]
    assert fields == {"JobState": "RUNNING", "Reason": "None", "Restarts": "0", "EndTime": "2026-11-26T12:35:23",
                      "PreemptTime": "2026-11-26T12:35:13"}


def test_the_worker_catches_stop_signals_before_it_imports_the_config() -> None:
    """Slurm's warning can come at a requeued attempt's first 30 s tick, as it starts: a rank still importing
    omegaconf (~0.2 s) died of USR2 with nothing recorded (seen in CI). The handler is now installed first."""
    probe = ("import runpy, signal, sys\n"
             "class Probe:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'omegaconf':\n"
             "            caught = signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None)\n"
             "            print('caught' if caught else 'default', flush=True)\n"
             "            raise SystemExit(0)\n"
             "sys.meta_path.insert(0, Probe())\n"
             "sys.argv = ['hpc_ddp.worker', '--config', 'unused.yaml']\n"
             "runpy.run_module('hpc_ddp.worker', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout.strip() == "caught", proc.stdout + proc.stderr
