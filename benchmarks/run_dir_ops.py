"""B14: operations on the run dir per event, counted, not timed (issue 45).

What a 512-node job costs the shared filesystem's administrator is how many creates, renames, unlinks, opens and
listings it makes in the run dir, and whether that grows with the ranks per node. Each rehearsal here runs with
``benchmarks/opcount`` first on ``PYTHONPATH``: every process of it (the launcher, which plays the batch shell,
and every rank) counts its operations on the run dir through the interpreter's audit hook, whatever code path
makes them (``benchmarks/opcount/sitecustomize.py``); liveness beats are counted apart (per period, not per event),
as are metrics lines (one open-append of ``metrics.jsonl`` by rank 0 per line the loop logs: ``train.log_every``),
and the rehearsal's own per-rank logs (``logs/``, its launcher's; on a cluster srun writes the task logs) not at all.

Events are differences between runs of one geometry (examples/mlp.yaml, no periodic snapshot unless said, and
resumes read as on a cluster, ``snapshot.load=spread``):

- **per step**: (16 steps - 6 steps) / 10;
- **per periodic snapshot**: (16 steps with a snapshot every 5 steps - 16 steps) / 3;
- **per failure**: 16 steps with node 1 SIGKILLed after step 8 (a spare replaces it) - 16 steps: the
  survivors' snapshot, the failed line, the healed attempt's start and its resume (from 2 nodes);
- **per stop**: 16 steps preempted after step 8 - 16 steps: the stop's snapshot, the requeue, the next attempt's
  start and its resume;
- **per run**: 6 steps - 6 x per step: the attempt's start, the final snapshot, DONE and the ledger.

A failure's count is the median of the runs (three a geometry) with the writer count most runs at that node count
had (``alike``: which nodes write a share before the commit is timing, and each writer is about a node's worth).
Each count is fitted as ``a + b x nodes + c x ranks`` by least squares over the geometries; the target is met
when no count grows with the ranks per node (at each node count, the count at 4 ranks a node is at most the
count at 1 plus 10% and 2) and the per-step count is 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "benchmarks" / "opcount"
KINDS = ("open_read", "open_write", "rename", "unlink", "listdir", "mkdir", "rmdir")
BEATS = ("beat_open_read", "beat_open_write")
METRICS = ("metrics_line",)
# snapshot.load=spread: a cluster's read (auto's choice on more than one node). The rehearsal's own default,
# every_node, has each node read every file, which one page cache makes free in bytes but not in opens (N x N).
BASE = ["examples/mlp.yaml", "--local", "train.log_every=1", "snapshot.every_minutes=null",
        "snapshot.every_steps=null", "slurm.max_restarts_in_job=2", "snapshot.load=spread"]
SCENARIOS: dict[str, list[str]] = {
    "short": ["train.max_steps=6"],
    "long": ["train.max_steps=16"],
    "snapshots": ["train.max_steps=16", "snapshot.every_steps=5"],
    "failure": ["train.max_steps=16", "slurm.spare_nodes=1", "--fail-at", "8:1"],
    "stop": ["train.max_steps=16", "--preempt-at", "8"],
}
GRID = [(n, p) for n in (1, 2, 4, 8) for p in (1, 2, 4)]


def counted(scratch: Path, nodes: int, per_node: int, scenario: str) -> dict[str, Any]:
    """One rehearsal's counts: {"rank": {kind: n}, "shell": {kind: n}} (shell: the launcher), or an error."""
    run_dir, out = scratch / f"b14-{nodes}x{per_node}-{scenario}", scratch / f"b14-{nodes}x{per_node}-{scenario}.ops"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HPC_DDP_OPS_RUN_DIR": str(run_dir), "HPC_DDP_OPS_OUT": str(out)}
    cmd = [sys.executable, "-m", "hpc_ddp.submit", *BASE, f"slurm.nodes={nodes}", f"slurm.tasks_per_node={per_node}",
           f"run_dir={run_dir}", *SCENARIOS[scenario]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    fields = KINDS + BEATS + METRICS
    totals: dict[str, dict[str, int]] = {"rank": dict.fromkeys(fields, 0), "shell": dict.fromkeys(fields, 0)}
    for path in out.glob("*.ops"):
        raw = path.read_bytes()
        values = [int.from_bytes(raw[8 * i:8 * i + 8], "little", signed=True) for i in range(len(fields))]
        role = "rank" if path.stem.endswith("-rank") else "shell"
        for kind, value in zip(fields, values):
            totals[role][kind] += value
    found = writers(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return {**totals, "writers": found}


def writers(run_dir: Path) -> int:
    """How many survivors wrote a share, from their offers (read after the run, as the batch shell does). The
    shares cover the state once each slice has a writer, and a node freed after the commit compares instead of
    writing: at 4 nodes, 2 or 3 writers as timing has it, and the third's share, its node's file, its tally
    entries and the commit's read of it are about 20 operations (dev/b14_trace.py, 2026-12-04)."""
    from hpc_ddp.rundir import jit_offers

    found = set()
    for folder in (run_dir / "jit").glob("*") if (run_dir / "jit").is_dir() else []:
        found |= {(folder.name, o.get("rank")) for o in jit_offers.listed(folder)
                  if isinstance(o.get("written"), dict)}
    return len(found)


FAILURE_RUNS, MORE_RUNS = 3, 2  # a failure's count depends on how many survivors wrote: see alike


def total(run: dict[str, Any]) -> int:
    """One run's count, ranks and launcher together, beats apart."""
    return sum(run["rank"][k] + run["shell"][k] for k in KINDS)


def alike(runs: dict[int, list[dict[str, Any]]], more: Any = None) -> dict[int, dict[str, Any]]:
    """A failure's counts at one node count, like with like: ``runs`` per ranks a node (``FAILURE_RUNS`` each),
    the writer count most runs had, and per geometry the median of its runs with that many writers (``more(p)``
    adds a run of a geometry that has none, up to ``MORE_RUNS``; without one, the median of all its runs, said in
    ``alike``). Which nodes write a share before the commit is timing (a node freed after it compares instead),
    and each writer costs about a node's worth: one run a geometry, or the median of three, read that as growth
    with the ranks per node (4 x 2 at 176 and 174 against 155 and 152 at 4 x 1 on 2026-12-03)."""
    if any("error" in r for rs in runs.values() for r in rs):
        return {p: next((r for r in rs if "error" in r), rs[0]) for p, rs in runs.items()}
    counts = [r["writers"] for rs in runs.values() for r in rs]
    usual = max(sorted(set(counts)), key=counts.count)
    chosen = {}
    for per_node, rs in runs.items():
        while more is not None and not any(r.get("writers") == usual for r in rs) \
                and len(rs) < FAILURE_RUNS + MORE_RUNS:
            rs.append(more(per_node))
        ok = [r for r in rs if "error" not in r]
        same = [r for r in ok if r["writers"] == usual]
        pick = sorted(same or ok, key=total)[len(same or ok) // 2]
        chosen[per_node] = {**pick, "totals": [total(r) for r in ok], "kinds": [r["writers"] for r in ok],
                            "alike": bool(same)}
    return chosen


def events(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-event counts (ranks and shell together, beats apart) from one geometry's scenario runs."""
    def total(name: str) -> dict[str, float] | None:
        run = runs.get(name)
        if run is None or "error" in run:
            return None
        return {k: float(run["rank"][k] + run["shell"][k]) for k in KINDS}

    def diff(a: dict[str, float] | None, b: dict[str, float] | None, scale: float = 1.0) -> dict[str, float] | None:
        return None if a is None or b is None else {k: round((a[k] - b[k]) / scale, 2) for k in KINDS}

    short, long = total("short"), total("long")
    step = diff(long, short, 10)
    found = {"step": step, "snapshot": diff(total("snapshots"), long, 3), "failure": diff(total("failure"), long),
             "stop": diff(total("stop"), long),
             "run": None if short is None or step is None else {k: round(short[k] - 6 * step[k], 2) for k in KINDS}}
    return {name: value for name, value in found.items() if value is not None}


def fit(points: list[tuple[int, int, float]]) -> dict[str, float] | None:
    """count = a + b x nodes + c x ranks, least squares over (nodes, ranks per node, count)."""
    if len(points) < 3:
        return None
    import numpy as np

    matrix = np.array([[1.0, n, n * p] for n, p, _ in points])
    values = np.array([c for _, _, c in points])
    (a, b, c), *_ = np.linalg.lstsq(matrix, values, rcond=None)
    return {"a": round(float(a), 2), "per_node": round(float(b), 2), "per_rank": round(float(c), 2)}


def flat_in_ranks_per_node(table: dict[tuple[int, int], float]) -> list[str]:
    """Where a count grows with the ranks per node: at 4 a node above the count at 1 by more than 10% and 2."""
    grows = []
    for (nodes, per_node), count in sorted(table.items()):
        base = table.get((nodes, 1))
        if per_node > 1 and base is not None and count > base * 1.1 + 2:
            grows.append(f"{nodes} node(s) x {per_node}: {count} against {base} at 1 rank a node")
    return grows


# the scenarios each event is a difference of
NEEDS = {"run": ("short", "long"), "step": ("short", "long"), "snapshot": ("long", "snapshots"),
         "failure": ("long", "failure"), "stop": ("long", "stop")}


def b14(scratch: Path, grid: list[tuple[int, int]] = GRID, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """B14's rows; ``only``: these events alone (the scenarios they need), e.g. ("failure",)."""
    rows: dict[str, Any] = {}
    wanted = {name for event in only for name in NEEDS[event]} if only else set(SCENARIOS)
    failures: dict[tuple[int, int], dict[str, Any]] = {}
    if "failure" in wanted:  # one node lost is every rank lost: nothing to survive at 1 node
        for nodes in sorted({n for n, _ in grid if n >= 2}):
            def again(per_node: int, nodes: int = nodes) -> dict[str, Any]:
                return counted(scratch, nodes, per_node, "failure")
            picked = alike({p: [again(p) for _ in range(FAILURE_RUNS)] for n, p in grid if n == nodes}, again)
            failures.update({(nodes, p): run for p, run in picked.items()})
    for nodes, per_node in grid:
        runs = {name: counted(scratch, nodes, per_node, name) for name in SCENARIOS
                if name in wanted and name != "failure"}
        if (nodes, per_node) in failures:
            runs["failure"] = failures[(nodes, per_node)]
        failure = runs.get("failure", {})
        rows[f"{nodes}x{per_node}"] = {"events": events(runs), "failure_totals": failure.get("totals"),
                                       "failure_writers": failure.get("kinds"),
                                       "failure_alike": failure.get("alike"),
                                       "beats": {
            name: {k: run["rank"][k] + run["shell"][k] for k in BEATS + METRICS} for name, run in runs.items()
            if "error" not in run},
            "errors": {name: run["error"] for name, run in runs.items() if "error" in run}}
    return summarize(rows)


def merged(old: dict[str, Any], fresh: dict[str, Any], events: tuple[str, ...]) -> dict[str, Any]:
    """``old`` B14 section with ``fresh``'s counts of ``events`` in place of its own (a row re-measured
    alone: ``--only B14-FAILURE``), summarized again."""
    rows = {key: {**row, "events": dict(row.get("events", {})), "errors": dict(row.get("errors", {}))}
            for key, row in (old.get("rows") or {}).items()}
    for key, row in fresh["rows"].items():
        into = rows.setdefault(key, {"events": {}, "beats": {}, "errors": {}})
        for event in events:
            if event in row["events"]:
                into["events"][event] = row["events"][event]
        if "failure" in events and row.get("failure_totals"):
            for field in ("failure_totals", "failure_writers", "failure_alike"):
                into[field] = row.get(field)
        rerun = {name for event in events for name in NEEDS[event]}  # their old errors go with their old counts
        into["errors"] = {**{k: v for k, v in into["errors"].items() if k not in rerun}, **row["errors"]}
    return summarize(rows)


def summarize(rows: dict[str, Any]) -> dict[str, Any]:
    """Fits, growth with the ranks per node, and the verdict of B14's rows."""
    fits, grows, per_step = {}, [], {}
    for event in ("run", "step", "snapshot", "failure", "stop"):
        table = {}
        for key, row in rows.items():
            if event in row["events"]:
                nodes, per_node = map(int, key.split("x"))
                table[(nodes, per_node)] = sum(row["events"][event].values())
        fits[event] = fit([(n, p, c) for (n, p), c in table.items()])
        grows += [f"{event}: {g}" for g in flat_in_ranks_per_node(table)]
        if event == "step":
            per_step = {f"{n}x{p}": c for (n, p), c in table.items()}
    errors = {key: row["errors"] for key, row in rows.items() if row["errors"]}
    met = not errors and not grows and all(abs(c) < 0.5 for c in per_step.values())
    return {"rows": rows, "fits": fits, "grows_with_ranks_per_node": grows, "per_step": per_step,
            "target": "no count grows with the ranks per node; 0 per step outside the beats", "met": met}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):  # a flag is no scratch folder (it wrote ./--help/)
        sys.exit("usage: python -m benchmarks.run_dir_ops SCRATCH_DIR [NODESxRANKS ...] [EVENT ...]  (B14's counts,"
                 f" as JSON; events: {', '.join(NEEDS)}, all by default)")
    grid = [tuple(map(int, g.split("x"))) for g in sys.argv[2:] if "x" in g] or GRID
    events_only = tuple(a for a in sys.argv[2:] if a in NEEDS)
    print(json.dumps(b14(Path(sys.argv[1]), grid, events_only), indent=1))  # type: ignore[arg-type]
