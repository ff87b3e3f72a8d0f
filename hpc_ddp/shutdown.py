"""Leaving a training process quickly and cleanly (no torch here)."""

from __future__ import annotations

import logging
import os
import sys


def exit_fast(code: int = 0) -> None:
    """Flush and exit without the interpreter's teardown.

    Call it last, after the process group is torn down and once everything that
    matters is durable (snapshots, ledger and DONE.json are fsynced). It saves
    ~1.2 s per process with torch loaded, and it avoids a gloo abort ("terminate
    called without an active exception") that torch's finalization hits under load.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
