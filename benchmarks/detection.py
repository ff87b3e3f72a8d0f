"""B16: seconds from a fault to the moment the job knew, by failure class, and to the first resumed step (issue 60).

On the local cluster of machines (three slurmd nodes, each its own network namespace, freezer cgroup and view of the
run dir), a 2 x 2 own loop (``tests.tasks.loops:nanogpt_shaped``, per-rank state mirrored to a buddy) with a spare
node and no periodic snapshot; one fault per run, on node 1 once its ranks reached step 300 (about 5 s into the
attempt: the steady state; a node cut in its attempt's first second, before its first answer over the network, is
found by its own watcher in 6 s instead, ``tests/rank/test_net_beat.py``):

- ``killed_rank``: rank 3 SIGKILLed (its sockets close: its peers' collectives fail at once);
- ``frozen_rank``: rank 3 stopped with SIGSTOP (nothing closes; its node's watcher sees it stopped in ``/proc``);
- ``frozen_node``: node 1 frozen in its freezer cgroup (a kernel hang, and from outside what a powered-off node
  looks like: nothing sent, nothing answered; its watcher and slurmd frozen too);
- ``partitioned``: node 1's link cut from inside (no FIN, no RST; it still beats into its view of the run dir);
- ``killed_node``: every process of node 1 SIGKILLed by the benchmark (``fault NODE kill``, the host its beat in the
  run dir names) once step 300 is logged: slurmd, the watcher and the ranks; its kernel closes their sockets.

**Known** is the earliest of: a declaration of the lost ranks (its marker's time, written by whoever noticed:
a node's watcher, a rank's liveness thread) and a survivor's offer for the survivors' snapshot (the instant its
collective failed, read as soon as the failed attempt's ledger line is there, before a later settle tidies it).
The fault's instant is stamped by the rank just before it dies or freezes, once the link is down, or by the
benchmark just before it kills the node. Every node's clock is this machine's. The runs are interleaved by class.
A fault that was never noticed (the run finished without a failed attempt) is a run of its own kind: ``missed``.

**The soak** (:func:`soak`): one 2 x 2 run on the local cluster of machines with the defaults (``dist.liveness_s``
30 s, the watchers' 2 s and 3 s) for ``minutes``, doing in turn everything slow that is not dead
(``tests/tasks/soak.py``: the GIL held 60 s in one C call, a 45 s evaluation on rank 0 alone, a 2 GiB synchronous
save, a 40 s loader stall, a node's every core busy for 45 s, a ``torch.compile``). A false alarm is any
declaration, lost-rank marker or failed attempt; the watchers' "file server is slow" warnings are counted apart
(a warning, not a declaration).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import cluster_env, median, wait_until
from hpc_ddp.rundir import jit_files, jit_offers, ledger, losses, metrics_file

ROOT = Path(__file__).resolve().parent.parent
BASE = ["examples/own_loop_gpt.yaml", "train.loop=tests.tasks.loops:nanogpt_shaped", "train.max_steps=330",
        "train.log_every=1", "snapshot.every_steps=null", "snapshot.every_minutes=null", "slurm.spare_nodes=1"]
# dist.liveness_s and dist.timeout_s keep their defaults (30 s, 600 s): the node's watcher runs only where liveness
# is on (2 x liveness_s <= timeout_s), and what is measured is what a user gets
CLASSES: dict[str, str | None] = {
    "killed_rank": "kill:3:300",
    "frozen_rank": "stop:3:300",
    "frozen_node": "freezenode:1:300",
    "partitioned": "partitionnode:1:300",
    "killed_node": None,  # the benchmark kills the node
}
TARGET_MEDIAN_S, TARGET_MAX_S = 5.0, 8.0


def _failed_line(run_dir: Path) -> dict[str, Any] | None:
    try:
        return next((a for a in ledger.read_attempts(run_dir) if a.get("reason") == "failed"), None)
    except (OSError, ValueError):
        return None


def known_at(run_dir: Path, attempt: dict[str, Any]) -> tuple[float | None, str]:
    """When the job first knew of the failure of ``attempt`` (epoch s), and who knew: a declaration's
    marker or a survivor's offer."""
    key = ledger.attempt_key(attempt)
    times: list[tuple[float, str]] = []
    for rank, marker in losses.lost_markers(run_dir, *key).items():
        if isinstance(marker.get("time"), (int, float)):
            times.append((float(marker["time"]), f"declared: {str(marker.get('noticed') or 'missed beats')[:90]}"))
    for offer in jit_offers.listed(jit_files.folder(run_dir, *key)):
        if isinstance(offer.get("time"), (int, float)):
            times.append((float(offer["time"]), f"rank {offer.get('rank')}: {str(offer.get('error'))[:90]}"))
    if not times:
        return None, "nothing noticed"
    return min(times)


def one(kind: str, run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """One run: seconds from the fault to the moment it was known, and to the resumed attempt's first step."""
    fault = CLASSES[kind]
    stamp = run_dir.with_suffix(".fault")
    extra = {"HPC_DDP_TEST_FAULT": fault, "HPC_DDP_TEST_FAULT_STAMP": str(stamp)} if fault else {}
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *BASE, f"run_dir={run_dir}"], cwd=ROOT,
                          env={**env, **extra}, capture_output=True, text=True, check=True)
    job = proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    try:
        if kind == "killed_node":
            metrics = run_dir / "metrics.jsonl"
            wait_until(lambda: metrics.exists() and any(r["step"] >= 300 for r in metrics_file.read(run_dir)), 240, 0.1)
            _kill_node(json.loads((run_dir / "liveness" / "node-1.json").read_text())["host"], stamp)
        wait_until(lambda: _failed_line(run_dir) is not None or (run_dir / "DONE.json").exists(), 300, 0.1)
        failed = _failed_line(run_dir)
        known, who = known_at(run_dir, failed) if failed else (None, "missed: the run went on unharmed")
        wait_until(lambda: (run_dir / "DONE.json").exists(), 300)
    finally:
        if kind in ("frozen_node", "partitioned", "killed_node"):
            _back_to_normal()
    faulted = float(stamp.read_text()) if stamp.exists() else None
    lines = metrics_file.entries((run_dir / "metrics.jsonl").read_text().splitlines())
    starts = metrics_file.resumes(lines)
    resumed = lines[starts[-1][0]]["time"] - faulted if faulted and starts else None
    return {"known_s": None if known is None or faulted is None else round(known - faulted, 2),
            "resumed_s": None if resumed is None else round(resumed, 2), "who": who}


def _kill_node(node: str, stamp: Path) -> None:
    from hpc_ddp.slurm_local import ClusterSpec, faults, running_spec

    spec = running_spec(ClusterSpec())  # what the running cluster isolates
    stamp.write_text(repr(time.time()))
    faults.fault(spec, node, "kill")


def _back_to_normal() -> None:
    """Every node as it was (a frozen one killed first: it never runs again, as the tests' node_faults)."""
    from hpc_ddp.slurm_local import ClusterSpec, faults, isolation, running_spec

    spec = running_spec(ClusterSpec())
    for state in faults.states(spec):
        if state.freezer not in ("THAWED", "n/a"):
            faults.fault(spec, state.name, "kill")
        faults.normal(spec, isolation.machine_of(spec, state.name))


SOAK = ["examples/mlp.yaml", "train.task=null", "train.loop=tests.tasks.soak:false_alarms", "train.max_steps=1000000",
        "snapshot.every_steps=null", "snapshot.every_minutes=null", "slurm.max_restarts_in_job=0"]


def soak(minutes: float, run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """One long healthy run full of slow things: how many declarations, failed attempts and cases done."""
    subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *SOAK, f"run_dir={run_dir}"], cwd=ROOT,
                   env={**env, "HPC_DDP_SOAK_S": str(int(minutes * 60))}, capture_output=True, text=True, check=True)
    wait_until(lambda: (run_dir / "DONE.json").exists() or _failed_line(run_dir) is not None, minutes * 60 + 600)
    attempts = ledger.read_attempts(run_dir)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm").glob("*_log.*")))
    markers = sorted(p.name for p in (run_dir / "errors").glob("*lost-rank*")) if (run_dir / "errors").exists() \
        else []
    cases = [line.split("soak case ", 1)[1].split(" ", 1)[0] for line in logs.splitlines() if "soak case " in line]
    return {"minutes": minutes, "reasons": [a.get("reason") for a in attempts], "lost_markers": markers,
            "false_alarms": len(markers) + sum(1 for a in attempts if a.get("reason") != "finished"),
            "cases_done": {c: cases.count(c) for c in sorted(set(cases))},
            "slow_file_server_warnings": logs.count("its file server is slow")}


def b16_detection(trials: int = 5, only: tuple[str, ...] = tuple(CLASSES), soak_minutes: float = 20) -> dict[str, Any]:
    env, why_not = cluster_env()
    if env is None:
        return {"skipped": why_not, "met": None}
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in only}
    scratch = ROOT / "runs" / f"b16-{time.strftime('%H%M%S')}"
    scratch.mkdir(parents=True)
    for i in range(trials):  # interleaved: a slow minute of the machine hits every class alike
        for kind in only:
            try:
                runs[kind].append(one(kind, scratch / f"{kind}-{i}", env))
            except (subprocess.CalledProcessError, TimeoutError) as err:
                runs[kind].append({"error": repr(err)[:300]})
            print(f"B16 {kind} #{i}: {runs[kind][-1]}", file=sys.stderr, flush=True)
    rows = {kind: summary(values) for kind, values in runs.items()}
    soaked = None
    if soak_minutes:
        try:
            soaked = soak(soak_minutes, scratch / "soak", env)
        except (subprocess.CalledProcessError, TimeoutError) as err:
            soaked = {"error": repr(err)[:300], "false_alarms": None}
        print(f"B16 soak: {soaked}", file=sys.stderr, flush=True)
    met = (soaked is None or soaked.get("false_alarms") == 0) and all(
        r.get("median_s") is not None and r["median_s"] <= TARGET_MEDIAN_S and r["max_s"] <= TARGET_MAX_S
        and not r["missed"] and not r["errors"] for r in rows.values())
    return {"rows": rows, "trials": trials, "geometry": "2 x 2 with a spare node", "soak": soaked,
            "target": f"every class known within {TARGET_MEDIAN_S:g} s (median) and {TARGET_MAX_S:g} s (max); "
                      "0 false alarms in the soak",
            "met": met, "scratch": str(scratch)}


def summary(values: list[dict[str, Any]]) -> dict[str, Any]:
    """One class's figures: known (median, max), resumed (median), who noticed first, missed and failed runs."""
    known = [v["known_s"] for v in values if v.get("known_s") is not None]
    resumed = [v["resumed_s"] for v in values if v.get("resumed_s") is not None]
    return {"median_s": round(median(known), 2) if known else None, "max_s": max(known) if known else None,
            "resumed_median_s": round(median(resumed), 2) if resumed else None, "known": known,
            "who": sorted({v["who"] for v in values if "who" in v}),
            "missed": sum(1 for v in values if v.get("known_s") is None and "error" not in v),
            "errors": [v["error"] for v in values if "error" in v]}


if __name__ == "__main__":
    # python -m benchmarks.detection TRIALS [CLASSES [SOAK_MINUTES]]: a part of B16 alone
    kinds = tuple(k for k in sys.argv[2].split(",") if k) if len(sys.argv) > 2 else tuple(CLASSES)
    minutes = float(sys.argv[3]) if len(sys.argv) > 3 else 0
    print(json.dumps(b16_detection(int(sys.argv[1]) if len(sys.argv) > 1 else 1, kinds, minutes), indent=1))
