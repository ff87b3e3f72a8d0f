"""Issue 46 (5): the pure decisions of a cluster that refuses requeue (requeue or chain, the sbatch command the
batch shell builds, its environment, the ledger's chain, the caps across it), with Slurm's commands faked
through the command-runner seam. The real chain runs in tests/cluster/test_chain_slurm.py."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.core.requeue_policy import requeue_path, requeue_plan
from hpc_ddp.core.slurm_env import CHAINED_VAR, from_environ, simulated_environ
from hpc_ddp.core.slurm_jobs import PreemptionError, RequeueRefused, refused, requeue
from hpc_ddp.login.sbatch import sbatch_options, submitit_parameters
from hpc_ddp.login.status import render
from hpc_ddp.login.status.read import collect
from hpc_ddp.rundir import layout
from hpc_ddp.rundir.ledger import append_attempt, cap_reached, read_attempts
from hpc_ddp.rundir.ledger_history import chain_jobs
from hpc_ddp.shell.chain import (batch_shell_requeue, chain_environ, parsable_id, requeue_or_chain, sbatch_argv,
                                 submitit_folder, workdir_of)
from hpc_ddp.shell.settle import settle

REFUSAL = "Requested operation is presently disabled for job 5"  # scontrol requeue of a --no-requeue job, 22.05
LIMITS = {"max_timeouts": 3, "max_preemptions": 2, "max_failures": 1}


class FakeSlurm:
    """scontrol and sbatch as a cluster that refuses requeue answers them; every call is kept."""

    def __init__(self, script: str, requeue_code: int = 1, new_job: str = "7") -> None:
        self.script, self.requeue_code, self.new_job = script, requeue_code, new_job
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append((argv, kwargs))
        if argv[:2] == ["scontrol", "requeue"]:
            return subprocess.CompletedProcess(argv, self.requeue_code, "", REFUSAL if self.requeue_code else "")
        if argv[:3] == ["scontrol", "write", "batch_script"]:
            Path(argv[4]).write_text(self.script)
            return subprocess.CompletedProcess(argv, 0, f"batch script for job {argv[3]} written to {argv[4]}\n", "")
        if argv[:3] == ["scontrol", "show", "job"]:
            return subprocess.CompletedProcess(argv, 0, f"JobId={argv[-1]} Requeue=0 WorkDir=/home/u/proj\n", "")
        if argv[0] == "sbatch":
            return subprocess.CompletedProcess(argv, 0, f"{self.new_job}\n", "")
        if argv[0] == "scancel":
            return subprocess.CompletedProcess(argv, 0, "", "")
        raise AssertionError(f"unexpected command {argv}")

    def commands(self) -> list[str]:
        return [" ".join(argv[:3]) for argv, _ in self.calls]


def test_scontrol_requeue_refused_is_told_apart_from_other_failures() -> None:
    assert refused(REFUSAL) and refused("Job is not requeueable") and not refused("Invalid job id specified")
    with pytest.raises(RequeueRefused, match="presently disabled"):
        requeue("5", FakeSlurm(""))
    gone = lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "Invalid job id specified")  # noqa: E731
    with pytest.raises(PreemptionError) as err:
        requeue("5", gone)
    assert not isinstance(err.value, RequeueRefused)


def test_the_plan_is_a_chain_where_the_job_asks_for_no_requeue_and_a_requeue_elsewhere() -> None:
    path, why = requeue_plan({"no-requeue": ""}, "JobRequeue = 1\n")
    assert path == "chain" and "--dependency=afterany" in why
    path, why = requeue_plan({}, "JobRequeue              = 0\n", "PartitionName=gpu PreemptMode=CANCEL", "gpu")
    assert path == "requeue" and "JobRequeue=0 here is only a default" in why and "partition gpu cancels" in why
    assert requeue_plan({}, "")[1].endswith("(Slurm's settings could not be read)")


def test_preflight_reads_the_clusters_settings_through_the_runner_and_names_the_path(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    answers = {"config": "JobRequeue              = 1\n",
               "partition": "PartitionName=debug Default=YES PreemptMode=CANCEL\nPartitionName=high PreemptMode=OFF\n"}

    def runner(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, answers[argv[2]], "")
    cfg = load_config([Path("examples/mlp.yaml")], [f"run_dir={tmp_path}"])
    line = requeue_path(cfg.slurm, runner)
    assert line.startswith("after a stop: requeue") and "partition debug cancels" in line, line
    assert calls == [["scontrol", "show", "partition", "-o"], ["scontrol", "show", "config"]]
    chained = load_config([Path("examples/mlp.yaml")], [f"run_dir={tmp_path}", "slurm.sbatch_extra.no-requeue=''"])
    assert requeue_path(chained.slurm, runner).startswith("after a stop: chain (slurm.sbatch_extra turns requeue off")


def test_no_requeue_in_sbatch_extra_replaces_requeue_in_both_submissions(tmp_path: Path) -> None:
    cfg = load_config([Path("examples/mlp.yaml")], [f"run_dir={tmp_path}", "slurm.sbatch_extra.no-requeue=''"])
    extra = submitit_parameters(cfg)["additional_parameters"]
    assert "requeue" not in extra and extra["no-requeue"] is True  # submitit writes True as a bare flag
    lines = sbatch_options(cfg)
    assert "#SBATCH --no-requeue" in lines and "#SBATCH --requeue" not in lines
    plain = load_config([Path("examples/mlp.yaml")], [f"run_dir={tmp_path}"])
    assert submitit_parameters(plain)["additional_parameters"]["requeue"] is True
    assert "#SBATCH --requeue" in sbatch_options(plain)


def test_the_next_sbatch_gets_the_users_environment_without_this_jobs_slurm_variables() -> None:
    environ = {"PATH": "/usr/bin", "PYTHONPATH": "/proj", "SLURM_CONF": "/etc/slurm.conf", "SLURM_JOB_ID": "5",
               "SLURM_RESTART_COUNT": "2", "SLURM_NTASKS": "4", "SRUN_CPUS_PER_TASK": "2", "SBATCH_ACCOUNT": "a",
               "HPC_DDP_IN_JOB_RESTART": "1", CHAINED_VAR: "3"}
    assert chain_environ(environ, "5") == {"PATH": "/usr/bin", "PYTHONPATH": "/proj", "SLURM_CONF": "/etc/slurm.conf",
                                           "SBATCH_ACCOUNT": "a", CHAINED_VAR: "5"}
    assert sbatch_argv(Path("/r/chain/job-5.sbatch"), "5", "/home/u/proj") == [
        "sbatch", "--parsable", "--dependency=afterany:5", "--chdir=/home/u/proj", "/r/chain/job-5.sbatch"]
    assert parsable_id("12\n") == "12" and parsable_id("12;cluster\n") == "12" and parsable_id("") is None
    submitit_line = "srun ... /v/bin/python -u -m submitit.core._submit /runs/x/slurm\n"
    assert submitit_folder(submitit_line) == Path("/runs/x/slurm")
    assert submitit_folder("srun python -m hpc_ddp.worker --config c.yaml") is None
    assert workdir_of("JobId=5 Requeue=0 WorkDir=/home/u/proj StdErr=x") == "/home/u/proj"
    assert workdir_of("JobId=5 WorkDir=/tmp/a b StdOut=/tmp/o\n") == "/tmp/a b" and workdir_of("JobId=5") is None
    chained = from_environ({**simulated_environ(1, 1, job_id=7)[0], CHAINED_VAR: "5"})
    assert chained.chained_from == 5 and chained.restart_count == 0
    from hpc_ddp.rank.state.per_rank_resume import unattended  # a chained job is no person's --resume: a resize refused is
    assert "job 5 chained" in (unattended(chained) or "")  # a failure on the requeue path, not a config error


def test_a_refused_requeue_chains_the_next_job_and_the_ledger_and_job_json_name_it(tmp_path: Path) -> None:
    folder = tmp_path / "slurm"
    folder.mkdir()
    (folder / "5_submitted.pkl").write_bytes(b"the call")
    slurm = FakeSlurm(f"#!/bin/bash\n#SBATCH --no-requeue\nsrun python -u -m submitit.core._submit {folder}\n")
    append_attempt(tmp_path, {"job_id": 5, "restart_count": 0, "reason": "preemption", "requeue_by": "workers"})
    layout.job(tmp_path).write_text(json.dumps({"job_id": "5", "logs": str(folder)}))
    environ = {"SLURM_JOB_ID": "5", "PATH": "/usr/bin:/bin", "SLURM_CONF": "c"}
    said = requeue_or_chain(tmp_path, {"job_id": 5, "restart_count": 0}, "5", environ, slurm)
    assert "next job 7 after this one (--dependency=afterany:5)" in said
    assert slurm.commands() == ["scontrol requeue 5", "scontrol write batch_script", "scontrol show job", "sbatch "
                                "--parsable --dependency=afterany:5"]
    sbatch, kwargs = slurm.calls[-1]
    assert sbatch[-1] == str(layout.chain_script(tmp_path, "5")) and kwargs["cwd"] == "/home/u/proj"
    assert kwargs["env"][CHAINED_VAR] == "5" and "SLURM_JOB_ID" not in kwargs["env"]
    assert (folder / "7_submitted.pkl").read_bytes() == b"the call"  # submitit's worker finds its call by job id
    line = read_attempts(tmp_path)[0]
    assert line["next_job"] == "7" and line["requeue_by"] == "chain"
    assert json.loads(layout.job(tmp_path).read_text())["job_id"] == "7"


def test_a_next_job_without_submitits_call_is_taken_back_and_the_shell_says_so(tmp_path: Path) -> None:
    slurm = FakeSlurm(f"srun python -u -m submitit.core._submit {tmp_path / 'nowhere'}\n", new_job="8")
    said = batch_shell_requeue(tmp_path, (5, 0, 0), "5", {"SLURM_JOB_ID": "5", "PATH": "/usr/bin:/bin"}, slurm)()
    assert said.startswith("not requeued: job 8 was submitted but submitit's call could not be copied"), said
    assert slurm.calls[-1][0] == ["scancel", "8"] and "next_job" not in str(read_attempts(tmp_path))


def test_the_batch_shell_chains_at_once_after_rank_0_was_refused_and_says_what_it_could_not_do(tmp_path: Path) -> None:
    append_attempt(tmp_path, {"job_id": 5, "restart_count": 0, "reason": "timeout", "requeue_by": "workers"})
    append_attempt(tmp_path, {"job_id": 5, "restart_count": 0, "amends": True, "requeue_by": "batch shell",
                              "requeue_refused": REFUSAL})  # what rank 0 writes when scontrol requeue is refused
    slurm = FakeSlurm("#!/bin/bash\nsrun python -m hpc_ddp.worker\n", new_job="9")
    environ = {"SLURM_JOB_ID": "5", "PATH": "/usr/bin:/bin"}
    out = settle(tmp_path, job_id=5, restart_count=0, exit_code=3, limits=LIMITS,
                 requeue_job=batch_shell_requeue(tmp_path, (5, 0, 0), "5", environ, slurm))
    assert out.startswith("timeout; Slurm refuses requeue, so the batch shell queued the run's next job 9"), out
    assert "scontrol requeue 5" not in slurm.commands()  # refused once is enough
    again = settle(tmp_path, job_id=5, restart_count=0, exit_code=3, limits=LIMITS, requeue_job=None)
    assert again == "recorded by the workers: timeout" and len(slurm.calls) == 3  # idempotent: no second chain
    array = {**environ, "SLURM_ARRAY_JOB_ID": "4", "SLURM_ARRAY_TASK_ID": "1"}
    said = batch_shell_requeue(tmp_path, (6, 0, 0), "4_1", array, FakeSlurm(""))()
    assert said.startswith("not requeued") and "job array" in said and "--resume" in said


def test_a_failure_chains_within_max_failures_and_the_caps_count_every_job_of_the_chain(tmp_path: Path) -> None:
    slurm = FakeSlurm("#!/bin/bash\nsrun python -m hpc_ddp.worker\n", new_job="8")
    environ = {"SLURM_JOB_ID": "7", "PATH": "/usr/bin:/bin"}
    append_attempt(tmp_path, {"job_id": 5, "restart_count": 0, "reason": "preemption", "next_job": "7"})
    out = settle(tmp_path, job_id=7, restart_count=0, exit_code=137, limits=LIMITS,
                 requeue_job=batch_shell_requeue(tmp_path, (7, 0, 0), "7", environ, slurm))
    assert "next job 8 after" in out and "max_failures allows" in out
    attempts = read_attempts(tmp_path)
    assert chain_jobs(attempts) == ["5", "7", "8"]
    more = attempts + [{"job_id": 8, "restart_count": 0, "reason": "failed"}]
    assert cap_reached("failed", more, LIMITS)  # the failure of job 7 and of job 8: two, over max_failures=1
    assert cap_reached("preemption", attempts + [{"reason": "preemption"}] * 2, LIMITS)


def test_status_lists_the_jobs_of_a_chain_as_one_run(tmp_path: Path) -> None:
    layout.config(tmp_path).write_text("train:\n  max_steps: 10\n")
    for job, nxt, reason in ((5, "7", "preemption"), (7, "9", "preemption"), (9, None, "finished")):
        append_attempt(tmp_path, {"job_id": job, "restart_count": 0, "reason": reason,
                                  **({"next_job": nxt} if nxt else {})})
    layout.done(tmp_path).write_text(json.dumps({"step": 10}))
    info = collect(tmp_path)
    assert info["jobs"] == ["5", "7", "9"]
    assert "jobs    5 -> 7 -> 9  (a chain: each job submitted the next" in render(info)
