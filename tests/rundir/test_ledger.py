"""The ledger (``RUN_DIR/attempts.jsonl``, :mod:`hpc_ddp.rundir.ledger`) under damage (issue 61): an append on a
full disk leaves the file as it was, a torn last line costs itself alone, and a line with a field of the wrong
type is named and skipped by every reader (the ranks' start, the caps, ``status``) instead of crashing it."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.atomic import append_line
from hpc_ddp.core.config import load_config, save_config
from hpc_ddp.rundir.ledger import append_attempt, cap_reached, parse_attempts, read_attempts

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.yaml")
LIMITS = {"max_preemptions": 1, "max_timeouts": 3, "max_failures": 0}


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 12 KiB tmpfs: full after a few ledger lines (needs root to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 12 KiB tmpfs to fill it needs root (this test runs as uid %d)" % os.geteuid())
    where = tmp_path / "tiny"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (a container without CAP_SYS_ADMIN?): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def _fill(where: Path) -> Path:
    """Fill the disk to its last byte; returns the filler (delete it to free the disk)."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as out:
        for size in (4096, 512, 64, 8, 1):
            try:
                while True:
                    out.write(b"x" * size)
            except OSError:
                pass
    return filler


def test_an_append_on_a_full_disk_leaves_the_ledger_as_it_was_and_later_appends_are_read(tiny_disk: Path) -> None:
    run = tiny_disk / "run"
    for n in range(2):
        append_attempt(run, {"job_id": 5, "restart_count": n, "reason": "preemption"})
    before = (run / "attempts.jsonl").read_bytes()
    filler = _fill(tiny_disk)
    big = {"job_id": 5, "restart_count": 2, "reason": "failed", "message": "m" * 6000}  # more than the disk has left
    with pytest.raises(OSError):
        append_attempt(run, big)
    assert (run / "attempts.jsonl").read_bytes() == before  # cut back: no torn line for the next to be glued to
    filler.unlink()
    for n in range(3, 6):
        append_attempt(run, {"job_id": 5, "restart_count": n, "reason": "preemption"})
    assert [a["restart_count"] for a in read_attempts(run)] == [0, 1, 3, 4, 5]


def test_a_metrics_line_on_a_full_disk_is_cut_back_too(tiny_disk: Path) -> None:
    path = tiny_disk / "metrics.jsonl"
    append_line(path, json.dumps({"step": 1}) + "\n", sync=False)
    filler = _fill(tiny_disk)
    with pytest.raises(OSError):
        append_line(path, json.dumps({"step": 2, "note": "n" * 6000}) + "\n", sync=False)
    filler.unlink()
    append_line(path, json.dumps({"step": 3}) + "\n", sync=False)
    assert path.read_text().splitlines() == ['{"step": 1}', '{"step": 3}']


def test_an_append_after_a_torn_line_starts_a_new_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    append_attempt(tmp_path, {"job_id": 5, "restart_count": 0, "reason": "preemption"})
    with open(tmp_path / "attempts.jsonl", "a") as out:
        out.write('{"job_id": 5, "restart_count": 1, "rea')  # a crash in the middle of the line
    append_attempt(tmp_path, {"job_id": 5, "restart_count": 2, "reason": "timeout"})
    append_attempt(tmp_path, {"job_id": 5, "restart_count": 3, "reason": "finished"})
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.ledger"):
        assert [a["restart_count"] for a in read_attempts(tmp_path)] == [0, 2, 3]  # the torn line alone is lost
    assert "attempts.jsonl line 2 skipped: it is not JSON" in caplog.text


def test_a_line_in_the_writing_is_skipped_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.ledger"):
        assert parse_attempts('{"reason": "timeout"}\n{"reason": "fin') == [{"reason": "timeout"}]
    assert caplog.text == ""


BAD_LINES = [  # each crashed a reader before the schema: unhashable reason, int() of a string, a list of hosts
    {"job_id": 5, "restart_count": 1, "reason": ["preemption"]},
    {"job_id": 5, "restart_count": "one", "reason": "preemption"},
    {"job_id": 5, "restart_count": 2, "in_job": [1], "reason": "failed"},
    {"job_id": 5, "restart_count": 3, "reason": "timeout", "start": "noon", "end": 20.0, "last_step": "7"},
    {"job_id": 5, "restart_count": 4, "reason": "lost", "hosts": ["n1"], "healed": "yes", "lost_ranks": ["a"]},
    ["not", "an", "object"],
    {"amends": True, "job_id": 5, "restart_count": 0, "reason": {"why": "merged into line 1"}},
]


def _damaged(run: Path) -> None:
    good = [{"job_id": 5, "restart_count": 0, "reason": "preemption", "start": 1.0, "end": 2.0, "first_step": 0,
             "last_step": 10}]
    later = [{"job_id": 5, "restart_count": 5, "reason": "timeout", "start": 3.0, "end": 4.0, "first_step": 10,
              "last_step": 20, "resumed_from": 10, "unknown_field": ["allowed"]}]
    run.mkdir(parents=True, exist_ok=True)
    (run / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in good + BAD_LINES + later))


def test_a_wrong_typed_line_is_named_and_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _damaged(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.ledger"):
        attempts = read_attempts(tmp_path)
    assert [(a["restart_count"], a["reason"]) for a in attempts] == [(0, "preemption"), (5, "timeout")]
    assert attempts[1]["unknown_field"] == ["allowed"]  # fields the schema does not know are kept
    for number in range(2, 2 + len(BAD_LINES)):
        assert f"attempts.jsonl line {number} skipped" in caplog.text
    assert '"reason" is a list' in caplog.text and "expected a string" in caplog.text
    assert '"restart_count" is a string' in caplog.text and "not a JSON object" in caplog.text
    assert cap_reached("preemption", attempts, LIMITS) is None  # no crash; one preemption of one allowed
    assert cap_reached("preemption", attempts + [{"reason": "preemption"}], LIMITS) is not None


def _prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_preemptions: int) -> object:
    """What a rank's start (start.prepare: the preemption cap) makes of the run dir; signals and logging left
    alone."""
    from hpc_ddp.core.stopping import StopFlag
    from hpc_ddp.rank.attempt import start

    monkeypatch.setattr(StopFlag, "install", lambda self, signums: None)
    monkeypatch.setattr(start, "setup_logging", lambda env: None)
    cfg = load_config([MLP], [f"run_dir={tmp_path / 'run'}", f"slurm.max_preemptions={max_preemptions}",
                              "slurm.nodes=1", "slurm.tasks_per_node=1"])  # a world of one: no rank variables
    return start.prepare(cfg, {}, StopFlag())


def test_a_ranks_start_reads_past_a_wrong_typed_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    _damaged(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.ledger"):
        prepared = _prepared(tmp_path, monkeypatch, max_preemptions=1)
    assert isinstance(prepared, tuple) and len(prepared[4]) == 2  # it starts, with the two good attempts
    assert "line 2 skipped" in caplog.text
    assert _prepared(tmp_path, monkeypatch, max_preemptions=0) == 1  # the good lines still count for the cap


def test_status_shows_a_run_whose_ledger_has_a_wrong_typed_line(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.login.status import main

    run = tmp_path / "run"
    _damaged(run)
    save_config(load_config([MLP], [f"run_dir={run}", "train.max_steps=100"]), run / "config.yaml")
    (run / "job.json").write_text(json.dumps({"job_id": 5, "local": True, "pid": 2**22,
                                              "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.ledger"):
        assert main([str(run)]) == 3  # stopped: --resume continues it
    assert "timeout" in capsys.readouterr().out and "attempts.jsonl line 2 skipped" in caplog.text
    assert main([str(run), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["attempts"][-1]["reason"] == "timeout"
    # as a user runs it: the warning on stderr, the table on stdout
    shown = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert shown.returncode == 3 and "STOPPED" in shown.stdout, shown.stderr
    assert 'line 2 skipped: "reason" is a list' in shown.stderr and "Traceback" not in shown.stderr


def test_a_capped_hang_points_to_the_stuck_ranks_stacks_before_a_higher_cap() -> None:
    hung = cap_reached("hung", [{"reason": "hung"}], LIMITS | {"max_failures": 0})
    failed = cap_reached("failed", [{"reason": "failed"}], LIMITS | {"max_failures": 0})
    assert hung is not None and failed is not None
    assert "failures and hangs once, more than slurm.max_failures=0" in hung
    assert hung.index("repeats wherever it runs") < hung.index("slurm.max_failures=10")
    assert "repeats" not in failed and "slurm.max_failures=10" in failed


def test_failures_that_all_came_before_the_first_step_point_to_the_error_before_a_higher_cap() -> None:
    """A newcomer's script that fails at its start (a missing module, no GPU) was told to raise
    slurm.max_failures: the same failure again. Where every counted failure came before the first step, the fix
    comes first; a failure after some steps keeps the cap's advice alone."""
    limits = LIMITS | {"max_failures": 0}
    early = cap_reached("failed", [{"reason": "failed"}], limits)
    later = cap_reached("failed", [{"reason": "failed", "last_step": 40}], limits)
    assert early is not None and later is not None
    assert early.index("every failure came before the program's first step") < early.index("slurm.max_failures=10")
    assert "first step" not in later and "slurm.max_failures=10" in later
