"""W&B's offline run files read back with W&B's own reader (``wandb leet inspect --json``, wandb-core's
transaction-log reader), and the run's history as ``wandb sync`` would upload it. Used by the sink's tests in the
rehearsal and on the local cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def wandb_fragments(run_dir: Path) -> list[dict[str, Any]]:
    """Each attempt's offline run file as W&B's own reader sees it, in start order (the folder's name,
    ``offline-run-YYYYMMDD_HHMMSS-ID``): its run record's branch point (a rewind: where W&B truncates the run
    before this fragment), history rows and record types. A file that holds only its header (an attempt whose
    W&B service a stop ended before it wrote anything) is a fragment with no records."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}  # no telemetry upload
    fragments = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name):
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        runs = [r["run"] for r in records if r["type"] == "run"]
        assert runs or not records, f"{path} ({path.stat().st_size} bytes) holds records but no run"
        fragments.append({"name": path.parent.name, "branch": runs[0].get("branch_point") if runs else None,
                          "types": [r["type"] for r in records], "size": path.stat().st_size,
                          "rows": [r["history"]["item"] for r in records if r["type"] == "history"]})
    return fragments


def wandb_history(fragments: list[dict[str, Any]], run_id: str) -> dict[int, dict[str, Any]]:
    """The run's history once `wandb sync` has uploaded the fragments in start order (as it does): a fragment
    whose run record holds a branch point on its own run rewinds the run to that step first (wandb-core
    runupserter.InitRun -> RewindRun: W&B truncates the history after it), then its rows are appended. Rows
    must rise above what the run holds: wandb-core renumbers one that does not (historystep.go)."""
    rows: dict[int, dict[str, Any]] = {}
    for fragment in fragments:
        point = fragment["branch"]
        if point:
            # protobuf leaves a default out: a branch point at step 0 has no value
            assert (point["run"], point["metric"]) == (run_id, "_step"), point
            rows = {step: row for step, row in rows.items() if step <= point.get("value", 0)}
        for row in fragment["rows"]:
            assert row["_step"] > max(rows, default=-1), (row["_step"], sorted(rows)[-3:])
            rows[row["_step"]] = row
    return rows
