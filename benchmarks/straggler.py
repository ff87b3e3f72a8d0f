"""B17: a slow node, steps until it is named (issue 60).

On the local cluster of machines, a 2 x 2 own loop (``examples/own_loop_gpt.yaml`` as it is: a small GPT, about
0.12 s a step here; the defaults of ``slurm.straggler``); once its ranks logged step 100, node 1's machine
gets its CPU capped (``fault NODE slow=FRACTION``, FRACTION of this machine: 0.35 is 70 % of the one CPU a node of
the two gets when neither is capped). Measured per run: the step rank 0 named the node at, less the step logged when
the cap came (target <= 50), and the job's step rate in the 50 steps before the cap and after the naming (what a
straggler costs: every rank waits for it). The control: the same run uncapped, where no node may be named. (A
model of a few thousand parameters, ``tests.tasks.loops:nanogpt_shaped``, 15 ms a step of mostly gloo and Python,
barely felt the cap, 0.8-0.9 x its rate, and one of three capped runs was never named.)

With ``slurm.straggler.action: replace`` and a spare node (the third kind of run): the step every rank stopped at
with a snapshot, the step the next attempt (on the spare) resumed from (steps lost: their difference, target 0),
and the job's step rate after the replacement against its rate before the cap.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cluster_env, median, wait_until
from hpc_ddp.rundir import ledger, metrics_file

ROOT = Path(__file__).resolve().parent.parent
BASE = ["examples/own_loop_gpt.yaml", "train.max_steps=250", "train.log_every=1", "snapshot.every_steps=null",
        "snapshot.every_minutes=null"]
CAP_AT, FRACTION, TARGET_STEPS, LAST = 100, 0.35, 50, 250
REPLACE = ["slurm.straggler.action=replace", "slurm.spare_nodes=1"]


def _logged(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return metrics_file.read(run_dir) if path.exists() else []


def _rate(lines: list[dict[str, Any]], first: int, last: int) -> float | None:
    """Steps a second between two logged steps (rank 0's clock)."""
    at = {line["step"]: line["time"] for line in lines if isinstance(line.get("time"), (int, float))}
    if first not in at or last not in at or at[last] <= at[first]:
        return None
    return round((last - first) / (at[last] - at[first]), 2)


def one(run_dir: Path, env: dict[str, str], kind: str) -> dict[str, Any]:
    """One run (``kind``: capped, replace or control): the step the cap came at, the step the node was named
    at (and, replaced, the step every rank stopped at and the step the next attempt resumed from), the rates."""
    from hpc_ddp.slurm_local import ClusterSpec, faults, isolation, running_spec

    extra = REPLACE if kind == "replace" else []
    subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *BASE, *extra, f"run_dir={run_dir}"], cwd=ROOT, env=env,
                   capture_output=True, text=True, check=True)
    capped_at, host = None, None
    spec = running_spec(ClusterSpec())
    try:
        if kind != "control":
            wait_until(lambda: any(r["step"] >= CAP_AT for r in _logged(run_dir)), 300, 0.05)
            host = json.loads((run_dir / "liveness" / "node-1.json").read_text())["host"]
            faults.fault(spec, host, f"slow={FRACTION}")
            capped_at = max(r["step"] for r in _logged(run_dir))
        wait_until(lambda: (run_dir / "DONE.json").exists(), 600)
    finally:
        if host is not None:
            faults.normal(spec, isolation.machine_of(spec, host))
    attempts = ledger.read_attempts(run_dir)
    slow = {h: s for a in attempts for h, s in (a.get("slow_nodes") or {}).items()}
    named = slow.get(host) if host else None
    lines, since = _logged(run_dir), (named["since_step"] if named else None)
    figures = {"capped_at": capped_at, "named_at": since, "others_named": sorted(h for h in slow if h != host),
               "steps_to_name": since - capped_at if since is not None and capped_at is not None else None,
               "x": named["x"] if named else None, "reasons": [a.get("reason") for a in attempts],
               "rate_before": _rate(lines, CAP_AT - 50, CAP_AT),
               "rate_after": _rate(lines, since, min(since + 50, LAST)) if since is not None else None}
    stopped = next((a for a in attempts if a.get("reason") == "slow"), None)
    if kind == "replace" and stopped is not None:
        after = attempts[attempts.index(stopped) + 1] if attempts[-1] is not stopped else {}
        resumed = after.get("resumed_from")
        figures.update(stopped_at=stopped.get("last_step"), replaced=stopped.get("replace"),
                       steps_lost=stopped["last_step"] - resumed if isinstance(resumed, int) else None,
                       hosts_after=after.get("hosts"),
                       rate_after=_rate(lines, resumed + 10, min(resumed + 60, LAST)) if isinstance(resumed, int)
                       else None)
    return figures


def b17_straggler(trials: int = 3) -> dict[str, Any]:
    env, why_not = cluster_env()
    if env is None:
        return {"skipped": why_not, "met": None}
    scratch = ROOT / "runs" / f"b17-{time.strftime('%H%M%S')}"
    scratch.mkdir(parents=True)
    runs: dict[str, list[dict[str, Any]]] = {"capped": [], "replace": [], "control": []}
    for i in range(trials):  # interleaved
        for kind in runs:
            try:
                runs[kind].append(one(scratch / f"{kind}-{i}", env, kind))
            except (subprocess.CalledProcessError, TimeoutError) as err:
                runs[kind].append({"error": repr(err)[:300]})
            print(f"B17 {kind} #{i}: {runs[kind][-1]}", file=sys.stderr, flush=True)
    capped = runs["capped"] + runs["replace"]
    steps = [r["steps_to_name"] for r in capped if r.get("steps_to_name") is not None]
    slowdown, healed = ([r["rate_after"] / r["rate_before"] for r in runs[kind] if r.get("rate_after")
                         and r.get("rate_before")] for kind in ("capped", "replace"))
    lost = [r.get("steps_lost") for r in runs["replace"] if "error" not in r]
    false = sum(len(r.get("others_named", [])) for r in capped) + sum(
        1 for r in runs["control"] if r.get("others_named") or r.get("named_at") is not None)
    missed = sum(1 for r in capped if "error" not in r and r.get("steps_to_name") is None)
    errors = [r["error"] for rs in runs.values() for r in rs if "error" in r]
    met = (bool(steps) and max(steps) <= TARGET_STEPS and not missed and not false and not errors
           and all(n == 0 for n in lost))
    return {"runs": runs, "trials": trials, "geometry": "2 x 2", "fraction": FRACTION, "cap_at": CAP_AT,
            "steps_to_name_median": median(steps) if steps else None, "steps_to_name_max": max(steps, default=None),
            "rate_after_over_before": round(median(slowdown), 3) if slowdown else None,
            "replaced_rate_over_before": round(median(healed), 3) if healed else None,
            "replace_stopped_after": [r.get("stopped_at", 0) - (r.get("capped_at") or 0) for r in runs["replace"]
                                      if r.get("stopped_at") is not None],
            "steps_lost": lost, "missed": missed, "false_namings": false, "errors": errors,
            "target": f"named within {TARGET_STEPS} steps of the cap, every time; with replace 0 steps lost; no node "
                      "named uncapped",
            "met": met, "scratch": str(scratch)}


if __name__ == "__main__":
    # python -m benchmarks.straggler [TRIALS]
    print(json.dumps(b17_straggler(int(sys.argv[1]) if len(sys.argv) > 1 else 3), indent=1))
