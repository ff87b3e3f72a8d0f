"""The rehearsal's tee of rank 0's output outlives the launch when a child still holds rank 0's pipe: it must
not write to the launcher's streams once they may be closed (a test's captured output is closed when the test
ends: pytest reported PytestUnhandledThreadExceptionWarning, "I/O operation on closed file")."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest

from hpc_ddp.rehearsal import local_tee


def test_the_tee_writes_its_log_only_once_the_launch_is_over_and_never_raises(tmp_path: Path) -> None:
    raised: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda args: raised.append(args.exc_value)
    read_fd, write_fd = os.pipe()
    stream, err, quiet = io.StringIO(), io.StringIO(), threading.Event()
    tee = threading.Thread(target=local_tee.tee, args=(os.fdopen(read_fd, "rb"), tmp_path / "rank-0.log",
                                                       stream, err, lambda step: None, None, None, quiet))
    try:
        tee.start()
        os.write(write_fd, b"before the end\n")
        while "before the end" not in stream.getvalue():
            tee.join(timeout=0.01)
        quiet.set()  # the launch returned; the caller closes its streams
        stream.close()
        err.close()
        os.write(write_fd, b"after the end\n")
        os.write(write_fd, b"Traceback (most recent call last):\n")  # would go to err
    finally:
        os.close(write_fd)
        tee.join(timeout=10)
        threading.excepthook = hook
    assert not tee.is_alive() and not raised, raised
    assert (tmp_path / "rank-0.log").read_text() == "before the end\nafter the end\nTraceback (most recent call last):\n"


def test_the_line_that_says_why_a_stop_never_fired_is_the_programs_not_a_warning_of_hpc_ddps(tmp_path: Path) -> None:
    """A newcomer's --preempt-at that never fired quoted, as the script's last line, hpc_ddp's own warning about
    the script (the program's own last line is what tells)."""
    watch: dict[str, object] = {}
    text = ("Unable to locate sufficient 2 gpus to run this example. Exiting.\n"
            "[rank 0] 13:11:58 WARNING hpc_ddp.script: train.script exited 0 but printed no line matching\n")
    local_tee.tee(io.BytesIO(text.encode()), tmp_path / "rank-0.log", io.StringIO(), io.StringIO(), lambda step: None,
                  None, watch, None)
    assert watch["line"] == "Unable to locate sufficient 2 gpus to run this example. Exiting."


def test_a_progress_mark_that_another_threads_line_landed_in_is_still_a_step(tmp_path: Path) -> None:
    """The node's binding line is logged from a thread while rank 0 prints its first mark: ``print`` wrote the
    mark and its newline apart, the log line landed between them, and the tee died on ``int("0[rank 0] ...")``:
    no injected stop fired, the run finished unstopped (the skewed-stop test, 1 run in 24 under load). Now a mark
    is one write, and the tee reads one wherever it lands."""
    steps: list[int] = []
    binding = "[rank 0] 13:55:25 INFO hpc_ddp.placement: binding on node0 (node 0 of 1)\n"
    text = f"@@hpc_ddp step 0{binding}\n@@hpc_ddp step 1\nstep 1 loss 0.5\n"
    stream = io.StringIO()
    local_tee.tee(io.BytesIO(text.encode()), tmp_path / "rank-0.log", stream, io.StringIO(), steps.append, None,
                  None, None)
    assert steps == [0, 1]
    assert "@@hpc_ddp" not in stream.getvalue() and binding in stream.getvalue()
    assert (tmp_path / "rank-0.log").read_text().strip().splitlines() == [binding.strip(), "", "step 1 loss 0.5"]


def test_a_mark_is_written_whole_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """One write of the whole line, so no other thread's line can land inside it (``print`` made two)."""
    from hpc_ddp.rank.attempt.injection import print_progress

    class Writes(io.StringIO):
        calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    monkeypatch.setattr("sys.stdout", Writes())
    print_progress(7)
    assert Writes.calls == ["@@hpc_ddp step 7\n"]
