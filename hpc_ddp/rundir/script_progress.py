"""``RUN_DIR/script_progress.json``: a ``train.script``'s recent steps, as rank 0's worker read
them.

A wrapped script writes no metrics of hpc_ddp's, but rank 0's worker reads its output for
``train.script_progress`` lines. So that ``status`` can show the step, ``step/max`` and an ETA as it
does for a loop's ``metrics.jsonl``, the worker keeps the last :data:`KEEP` points (step, time, and
the loss where the line shows one) in this one file, rewritten in place at most every
:data:`EVERY_S` seconds: rank 0 only, nothing per rank, not a line per step. ``status`` reads it
only when the run has no ``metrics.jsonl`` (a script with ``hpc_ddp.session()`` logs its own).
No torch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout

KEEP = 20  # points: status's rate is taken over its last 20 metrics too
EVERY_S = 2.0  # at most one rewrite per this many seconds (and one at the end)
LOSS = re.compile(r"(?i)\bloss\b\D{0,3}?(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


def point(step: int, line: str, now: float) -> dict[str, Any]:
    """A point for ``step`` from its progress line: the loss too, where the line says ``loss
    0.123``."""
    found = LOSS.search(line)
    return {"step": step, "time": round(now, 3),
            **({"loss": float(found.group(1))} if found else {})}


def write(run_dir: Path, record: dict[str, Any]) -> None:
    """Replace the file (a temporary name, then a rename: a reader sees the old file or the new
    one)."""
    path = layout.script_progress(run_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass  # progress for status only: a full or read-only run dir fails where it matters


def points(run_dir: Path) -> list[dict[str, Any]]:
    """The newest attempt's points (step, time, maybe loss), oldest first; [] without the file."""
    try:
        record = json.loads(layout.script_progress(run_dir).read_text())
    except (OSError, ValueError):
        return []
    found = record.get("points") if isinstance(record, dict) else None
    return [p for p in found or [] if isinstance(p, dict) and isinstance(p.get("step"), int)]
