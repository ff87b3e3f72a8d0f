"""What a user sees when a command is refused or a run fails deterministically: pure parts and the CLI.

Each test here failed before the fix it names (issue 15): a deterministic error requeued, a
missing task class let through preflight, ``--resume`` of a run that never existed, a dry run
that passed with errors, an emitted script that only ran from the project directory, a changed
config resumed in silence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.shell import settle as settle_module
from hpc_ddp.core.config import config_diff, describe_diff, flat_values, load_config
from hpc_ddp.rundir.ledger import read_attempts, record_error, recorded_error
from hpc_ddp.login.preflight import check_task, defines
from hpc_ddp.login.submit import main as submit_main

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp.yaml")
LIMITS = {"max_timeouts": 5, "max_preemptions": 5, "max_failures": 3}


def settle(run_dir: Path, exit_code: int, requeued: list[bool], restart: int = 0) -> str:
    return settle_module.settle(run_dir, job_id=7, restart_count=restart, exit_code=exit_code, limits=LIMITS,
                                requeue_job=lambda: requeued.append(True))


# --- deterministic errors are recorded once and never requeued ---------------------------------------------

def test_the_first_rank_to_record_an_attempts_error_writes_the_one_ledger_line(tmp_path: Path) -> None:
    record = {"job_id": 7, "restart_count": 0, "rank": 2}
    assert record_error(tmp_path, record, "cannot import X.\nHINT: fix it")
    assert not record_error(tmp_path, {**record, "rank": 0}, "cannot import X.\nHINT: fix it")  # same attempt
    [line] = read_attempts(tmp_path)
    assert line["reason"] == "error" and line["rank"] == 2 and line["message"] == "cannot import X."
    assert recorded_error(tmp_path, 7, 0) == "cannot import X.\nHINT: fix it"
    assert recorded_error(tmp_path, 7, 1) is None  # another attempt has not failed


def test_settle_never_requeues_an_error_even_with_failures_allowed(tmp_path: Path) -> None:
    record_error(tmp_path, {"job_id": 7, "restart_count": 0, "rank": 0}, "no class Nope in examples.mlp")
    requeued: list[bool] = []
    outcome = settle(tmp_path, 143, requeued)  # srun reports the ranks it terminated, not the error's 2
    assert requeued == [] and outcome.startswith("error; not requeued")
    assert "max_failures" not in outcome and "snapshot" not in outcome
    assert len(read_attempts(tmp_path)) == 1  # nothing added


def test_settle_records_exit_code_2_as_an_error_when_no_rank_could(tmp_path: Path) -> None:
    requeued: list[bool] = []
    outcome = settle(tmp_path, 2, requeued)
    assert requeued == [] and "not requeued" in outcome
    [line] = read_attempts(tmp_path)
    assert line["reason"] == "error" and line["exit_code"] == 2


def test_settle_still_requeues_a_crash_under_max_failures(tmp_path: Path) -> None:
    requeued: list[bool] = []
    assert settle(tmp_path, 137, requeued).startswith("failed; requeued") and requeued == [True]


# --- the batch shell requeues a stop that the workers could not (no scontrol in their container) -----------

def _stopped(run_dir: Path, requeue_by: str) -> None:
    from hpc_ddp.rundir.ledger import append_attempt

    append_attempt(run_dir, {"job_id": 7, "restart_count": 0, "reason": "timeout", "capped": False,
                             "requeue_by": requeue_by})


def test_settle_requeues_once_a_stop_the_workers_left_to_the_batch_shell(tmp_path: Path) -> None:
    _stopped(tmp_path, "batch shell")
    requeued: list[bool] = []
    assert "requeued by the batch shell" in settle(tmp_path, 3, requeued) and requeued == [True]
    assert len(read_attempts(tmp_path)) == 1


def test_settle_does_not_requeue_a_stop_the_workers_requeued_themselves(tmp_path: Path) -> None:
    _stopped(tmp_path, "workers")
    requeued: list[bool] = []
    assert settle(tmp_path, 0, requeued) == "recorded by the workers: timeout" and requeued == []


def test_the_worker_leaves_the_requeue_to_the_batch_shell_where_scontrol_is_missing() -> None:
    from hpc_ddp.core.slurm_jobs import requeue_available

    assert requeue_available(lambda name: f"/usr/bin/{name}")
    assert not requeue_available(lambda name: None)


# --- preflight finds a missing task class without importing anything --------------------------------------

@pytest.mark.parametrize(("source", "name", "expected"), [
    ("class MLPTask:\n    pass\n", "MLPTask", True),
    ("class MLPTask:\n    pass\n", "NoSuch", False),
    ("def make():\n    NoSuch = 1\n", "NoSuch", False),  # a local name is not the module's
    ("from elsewhere import Task as MyTask\n", "MyTask", True),
    ("try:\n    from fast import T\nexcept ImportError:\n    T = None\n", "T", True),
    ("if True:\n    class Late: ...\n", "Late", True),
    ("X: int = 1\n", "X", True),
    ("from elsewhere import *\n", "Anything", None),  # only running it could tell
    ("def __getattr__(name):\n    return 1\n", "Anything", None),
    ("def broken(:\n", "X", None),  # the import in the job reports the syntax error with its line
])
def test_defines_reads_the_module_without_running_it(source: str, name: str, expected: bool | None) -> None:
    assert defines(source, name) is expected


def test_preflight_names_the_missing_class_and_a_class_that_exists(tmp_path: Path) -> None:
    (tmp_path / "mytasks.py").write_text("raise SystemExit('preflight must never run user code')\n"
                                         "class Good:\n    def build_model(self, cfg): ...\n")
    cfg = load_config([MLP], ["train.task=mytasks:Goood"])
    [finding] = check_task(cfg, [str(tmp_path)])
    assert finding.level == "error" and finding.key == "train.task"
    assert "defines no 'Goood'" in finding.message and "mytasks:Good" in finding.hint
    assert check_task(load_config([MLP], ["train.task=mytasks:Good"]), [str(tmp_path)]) == []


def test_submit_refuses_a_missing_task_class_before_submitting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "never"
    code = submit_main([MLP, "train.task=examples.mlp:NoSuch", f"run_dir={run_dir}", "--emit-sbatch",
                        str(tmp_path / "job.sbatch")])
    err = capsys.readouterr().err
    assert code == 2 and "defines no 'NoSuch'" in err and "examples.mlp:MLPTask" in err
    assert not run_dir.exists() and not (tmp_path / "job.sbatch").exists()


# --- --dry-run is a gate: it fails when the submit would be refused ---------------------------------------

def test_dry_run_exits_non_zero_when_preflight_finds_errors(capsys: pytest.CaptureFixture) -> None:
    code = submit_main([MLP, "--dry-run", "train.task=examples.mlp:NoSuch"])
    captured = capsys.readouterr()
    assert code == 2 and "error [train.task]" in captured.out and "submitting would be refused" in captured.err
    assert submit_main([MLP, "--dry-run", "--no-preflight"]) == 0


# --- --resume needs an earlier run ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [["--local"], ["--no-preflight"]])  # the rehearsal and the Slurm submit
def test_resume_of_a_run_that_never_existed_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       mode: list[str]) -> None:
    typo = tmp_path / "runs" / "mpl"
    code = submit_main([MLP, "--resume", f"run_dir={typo}", *mode])
    err = capsys.readouterr().err
    assert code == 2 and f"there is no earlier run in {typo}" in err and "no such directory" in err
    assert "drop --resume" in err and not typo.exists()


# --- a changed config on --resume is named --------------------------------------------------------------

def test_config_diff_names_every_changed_key() -> None:
    old = flat_values(load_config([MLP]))
    new = flat_values(load_config([MLP], ["train.lr=0.5", "slurm.setup=[module load x]"]))
    assert config_diff(old, new) == [("slurm.setup", [], ["module load x"]), ("train.lr", 0.01, 0.5)]
    assert describe_diff(config_diff(old, new)) == "slurm.setup: [] -> ['module load x'], train.lr: 0.01 -> 0.5"
    assert json.loads(json.dumps(new)) == new  # it goes into every snapshot manifest


# --- an emitted script runs from wherever sbatch is called ------------------------------------------------

def test_emitted_script_records_the_submit_directory_and_says_so(tmp_path: Path) -> None:
    script = tmp_path / "elsewhere" / "job.sbatch"
    script.parent.mkdir()
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--emit-sbatch", str(script),
                           f"run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"WORKDIR={ROOT}\n" in script.read_text() and 'cd "$WORKDIR"' in script.read_text()
    assert f"the job runs in {ROOT}" in proc.stdout and "from any directory" in proc.stdout
    # the shell part that picks the directory, run as Slurm would from another directory
    lines = [line for line in script.read_text().splitlines() if line.startswith(("WORKDIR=", "cd "))]
    where = subprocess.run(["bash", "-c", "\n".join(lines + ["pwd"])], cwd=script.parent, capture_output=True,
                           text=True, env={**os.environ, "SLURM_SUBMIT_DIR": str(script.parent)})
    assert where.stdout.strip() == str(ROOT)


@pytest.mark.parametrize(("error", "expected"), [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:49871. This is typically caused by a remote worker crashing.\nmore"),
     "Connection closed by peer [127.0.0.1]:49871. This is typically caused by a remote worker crashing."),
    (RuntimeError("[/pytorch/torch/csrc/distributed/c10d/TCPStore.cpp:125] Timed out"), "Timed out"),
    (RuntimeError("step [3] of [x.cc:1] stays"), "step [3] of [x.cc:1] stays"),
    (ConnectionError(), "ConnectionError"),
])
def test_an_errors_first_line_for_the_ledger_drops_the_cpp_source_location(error: Exception, expected: str) -> None:
    """A survivor's ledger line and offer said "[../third_party/gloo/...pair.cc:553] Connection closed by peer":
    the location in torch's build tree came first and pushed what happened out of a narrow terminal."""
    from hpc_ddp.core.errors import first_line

    assert first_line(error) == expected
