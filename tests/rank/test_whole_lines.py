"""A rank's output comes out in whole lines: its stdout and stderr share one pipe (the rehearsal) or file (srun),
and a print written unbuffered (PYTHONUNBUFFERED, as the rehearsal's ranks run) is two writes, its text and its
newline, between which another thread's log record could land: a newcomer's rehearsal log read
`loss 2.1[rank 0] 08:00:01 INFO ...`."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

from hpc_ddp.rank.attempt.start import whole_lines


class Writes(io.RawIOBase):
    """A raw stream that keeps each write apart, as the pipe sees them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def test_a_print_is_one_write_once_lines_are_whole() -> None:
    raw = Writes()
    unbuffered = io.TextIOWrapper(raw, write_through=True)  # what python -u gives sys.stdout
    print("loss 2.1", file=unbuffered)
    assert raw.writes == [b"loss 2.1", b"\n"]  # the defect: another thread's line fits between them
    raw.writes.clear()
    whole_lines(unbuffered)
    print("loss 2.1", file=unbuffered)
    print("step", 3, file=unbuffered)
    assert raw.writes == [b"loss 2.1\n", b"step 3\n"]  # each line whole, and written at once


def test_a_closed_or_foreign_stream_is_left_alone() -> None:
    closed = io.TextIOWrapper(Writes())
    closed.close()
    whole_lines(closed, io.StringIO(), None)


def test_no_rank_line_is_joined_with_another_threads_log_record() -> None:
    """The real thing: an unbuffered process prints from its main thread while a thread logs to stderr, both into
    one pipe; every line comes out whole."""
    program = textwrap.dedent("""
        import logging, sys, threading
        from hpc_ddp.rank.attempt.start import whole_lines
        whole_lines(sys.stdout, sys.stderr)
        logging.basicConfig(stream=sys.stderr, format="[rank 0] %(message)s", level=logging.INFO)
        def chatter():
            for i in range(3000):
                logging.info("beat %d", i)
        side = threading.Thread(target=chatter)
        side.start()
        for i in range(3000):
            print("loss", i)
        side.join()
    """)
    out = subprocess.run([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=True, timeout=120).stdout.decode()
    lines = out.splitlines()
    assert len(lines) == 6000
    joined = [line for line in lines if not (line.startswith("loss ") and line[5:].isdigit()
                                             or line.startswith("[rank 0] beat "))]
    assert not joined, joined[:5]
