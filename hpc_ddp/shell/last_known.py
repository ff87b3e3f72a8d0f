"""How far a run got that died without a word: the last step its metrics or its snapshots show.

Apart from :mod:`hpc_ddp.shell.settle`, which writes it into a ``failed`` ledger line, because the
batch shell's supervisor (the healer's plan) and the rehearsal read it too, and it only reads the
run dir's files (the tail of metrics.jsonl, the snapshots' manifests). No torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout
from hpc_ddp.shell.steps import tail_of


def _newest_snapshot(run_dir: Path) -> int | None:
    from hpc_ddp.rundir import snapshot  # manifests only: no torch

    steps = snapshot.committed_steps(run_dir)
    return steps[0] if steps else None


def _last_metrics_step(run_dir: Path) -> int | None:
    """The step of metrics.jsonl's last whole line (its tail only: the file grows with the run)."""
    tail = tail_of(layout.metrics(run_dir), 4096)
    for line in reversed(tail.splitlines() if tail is not None else []):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a line cut by the crash, or the tail's first, partial line
        if isinstance(step, int):
            return step
    return None


def last_known(run_dir: Path) -> dict[str, Any]:
    """How far a run got that died without a word: the newer of metrics.jsonl's last step and the
    newest committed snapshot, which of the two it is, and the snapshot (where the next attempt
    resumes)."""
    logged, snapshot = _last_metrics_step(run_dir), _newest_snapshot(run_dir)
    if logged is not None and (snapshot is None or logged > snapshot):
        return {"last_step": logged, "last_step_from": "metrics.jsonl", "snapshot": snapshot}
    return {"last_step": snapshot, "last_step_from": "snapshot" if snapshot is not None else None,
            "snapshot": snapshot}
