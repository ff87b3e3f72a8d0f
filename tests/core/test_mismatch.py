"""A collective mismatch (the ranks called different collectives) is a bug of the program: recognised in what a
rank printed or raised, recorded as an ``error`` that points at the troubleshooting section, never retried."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.core.mismatch import SECTION, mismatch_line, mismatch_message
from hpc_ddp.login.failure_logs import last_errors
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.shell.settle import settle

# What gloo printed on rank 0 of tests.tasks.loops:rank0_only_eval_with_ddp (torch 2.13), and its peer's view.
GLOO_ABORT = ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
              "  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
              "op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size. Is there a "
              "distributed collective mismatch in your code?"]
PEER = ["RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5"]
# torch's own check (TORCH_DISTRIBUTED_DEBUG=DETAIL), gloo or NCCL, as a Python RuntimeError
DETAIL = ["RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
          "CollectiveFingerPrint(SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[3]), but Rank 1 is running "
          "collective: CollectiveFingerPrint(SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[5])."]


@pytest.mark.parametrize("lines, found", [
    (GLOO_ABORT, "op.preamble.length <= op.nbytes. 8 vs 4."),
    (DETAIL, "Detected mismatch between collectives on ranks."),
    (PEER, None),  # a survivor's view of any peer's death: never the cause by itself
    (["Traceback (most recent call last):", "ValueError: bad"], None),
])
def test_a_mismatch_is_recognised_by_what_the_rank_said(lines: list[str], found: str | None) -> None:
    line = mismatch_line(lines)
    assert (line is None) if found is None else (found in line and "enforce fail at" not in line), line


def test_settle_records_a_step_that_gloo_aborted_for_a_mismatch_as_an_error_it_does_not_retry(tmp_path: Path) -> None:
    """The aborted rank leaves no ledger line (SIGABRT from gloo's thread): the batch shell (and the rehearsal)
    read the step's logs, and the attempt is an `error`, neither healed nor requeued; before, a `failed` line,
    healed in the job and requeued, and at the cap a suggestion to raise slurm.max_failures."""
    log = tmp_path / "slurm" / "7_0_log.err"
    log.parent.mkdir()
    log.write_text("\n".join(["[rank 0] INFO started", *GLOO_ABORT, *PEER]) + "\n")
    healed, requeued = [], []
    outcome = settle(tmp_path, job_id=7, restart_count=0, exit_code=-6, limits={"max_failures": 3},
                     requeue_job=lambda: requeued.append(1), heal=lambda record: healed.append(record) or "heal",
                     logs=lambda: [log])
    [line] = read_attempts(tmp_path)
    assert line["reason"] == "error" and SECTION in line["message"] and "7_0_log.err" in line["message"], line
    assert not healed and not requeued and "max_failures" not in outcome, outcome
    assert "HINT:" in next((tmp_path / "errors").glob("*.txt")).read_text()
    assert settle(tmp_path / "other", job_id=7, restart_count=0, exit_code=-6, limits={"max_failures": 3},
                  requeue_job=lambda: requeued.append(1), logs=lambda: []).startswith("failed")  # no sign: as before


def test_status_shows_the_aborted_ranks_lines_though_they_hold_no_traceback(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "attempt-0-rank-0.log").write_text("\n".join(["[rank 0] INFO started", *GLOO_ABORT]) + "\n")
    shown = last_errors(tmp_path, tmp_path / "slurm")
    assert shown and "collective mismatch" in "\n".join(shown)


def test_the_message_says_what_was_said_where_and_the_fix() -> None:
    message = mismatch_message("op.preamble.length <= op.nbytes. 8 vs 4.", "logs/attempt-0-rank-0.log")
    first, hint = message.split("\nHINT: ")
    assert SECTION in first and "8 vs 4" in first and "attempt-0-rank-0.log" in first
    assert "model.module" in hint and "max_failures" not in message


def test_a_rank_that_raises_a_mismatch_records_a_usage_error_not_a_failure() -> None:
    """torch's own check (TORCH_DISTRIBUTED_DEBUG=DETAIL) raises in Python on every rank: the worker turns it into
    a usage error (exit 2, an `error` line, never retried), as for its other program mistakes. (Not run for real:
    DETAIL crashes at start with gloo in this torch build, 2.13.0+cpu.)"""
    from hpc_ddp.core.errors import UsageError
    from hpc_ddp.rank.worker import _explained

    explained = _explained(RuntimeError(DETAIL[0].removeprefix("RuntimeError: ")))
    assert isinstance(explained, UsageError) and SECTION in str(explained) and not explained.retry_may_help
    assert _explained(RuntimeError(PEER[0])) is None  # a peer's death stays a failure
