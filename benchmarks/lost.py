"""B11: the steps a failure throws away, with the survivors' just-in-time snapshot (issue 35).

Each trial is a real local rehearsal of ``examples/own_loop_gpt.yaml`` (2 nodes x 2 gloo ranks, dropout,
AdamW, a spare node to heal on) with periodic snapshots off. Node 1's ranks are SIGKILLed at a random
point: after rank 0 reported step S (random in 8..32), plus a random fraction of one step's time
(``HPC_DDP_LOCAL_KILL_DELAY_S``), so the kill lands anywhere in the next step: the boundary's agreement,
the batch being drawn, the forward, the backward's all-reduce, the optimizer update. Figures per trial:
the steps lost, ``last_step`` of the failed attempt (the newer of rank 0's last logged step and the
newest snapshot) less the step the healed attempt resumed from, and whether the run ended
bit-identical to one that never failed (``params_sha256``). Compared with the periodic path: without
the survivors' snapshot, a failure at step S with ``snapshot.every_steps=N`` loses ``S mod N`` steps,
and with the default 30 minutes, 15 minutes of steps on average (computed from the same steps and the
measured step rate: the periodic path itself is measured by B10 and the healing tests).

``--per-rank`` runs ``tests.tasks.loops:nanogpt_shaped`` instead: per_rank objects (a prefetched batch, counters,
a module of each rank's own) mirrored to a buddy on the other node (rank/salvage/mirror.py); a trial is exact when the
whole DONE record (params_sha256 and every rank's own state) equals the reference's. ``--batchnorm`` runs
``tests.tasks.loops:batchnorm`` (DDP with BatchNorm and broadcast_buffers: params_sha256 covers the buffers),
losing node 0, rank 0 with it, in every other trial.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUN = ["examples/own_loop_gpt.yaml", "--local", "slurm.spare_nodes=1", "train.max_steps=40", "train.log_every=1",
       "snapshot.every_steps=null", "snapshot.every_minutes=null"]


PER_RANK = ["train.loop=tests.tasks.loops:nanogpt_shaped"]
BATCHNORM = ["train.loop=tests.tasks.loops:batchnorm"]


def rehearse(run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    shutil.rmtree(run_dir, ignore_errors=True)
    return subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *RUN, f"run_dir={run_dir}", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def _done(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "DONE.json").read_text())


def step_seconds(run_dir: Path) -> float:
    """The median time between rank 0's metrics lines (one per step)."""
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def trial(run_dir: Path, step: int, delay_s: float, reference: dict[str, Any], *extra: str,
          env: dict[str, str] | None = None, node: int = 1) -> dict[str, Any]:
    from hpc_ddp.rundir.ledger import read_attempts

    proc = rehearse(run_dir, *extra, "--fail-at", f"{step}:{node}",
                    env={**(env or {}), "HPC_DDP_LOCAL_KILL_DELAY_S": f"{delay_s:.4f}"})
    attempts = read_attempts(run_dir)
    if proc.returncode != 0 or len(attempts) < 2:
        return {"step": step, "delay_s": round(delay_s, 4), "error": proc.stderr[-800:]}
    first, healed = attempts[0], attempts[-1]
    resumed = healed.get("resumed_from") or 0
    return {"step": step, "node": node, "delay_s": round(delay_s, 4), "last_step": first.get("last_step"),
            "resumed_from": resumed, "lost": (first.get("last_step") or 0) - resumed,
            "jit": first.get("jit_snapshot"), "fallback": first.get("jit_fallback"),
            "exact": _done(run_dir) == reference, "uncommitted": uncommitted(run_dir)}


def uncommitted(run_dir: Path) -> list[str]:
    """Step directories left without a manifest: none should outlive the attempt after the one that left them."""
    from hpc_ddp.rundir import layout
    from hpc_ddp.rundir.snapshot.steps import MANIFEST

    return sorted(p.name for p in layout.snapshots(run_dir).glob("step-*") if not (p / MANIFEST).exists())


def b11(scratch: Path, trials: int = 30, seed: int = 11, per_rank: bool = False,
        compute_s: float = 0.0, batchnorm: bool = False) -> dict[str, Any]:
    """``compute_s``: every step of the per-rank loop computes that much longer before its forward, as a GPU step
    does, while the work after the gradient all-reduce stays what it is. ``batchnorm``: the BatchNorm own loop
    (``tests.tasks.loops:batchnorm``: running statistics that differ by rank between forwards), and the lost
    node alternates, node 0 (rank 0 with it) in every other trial."""
    extra = PER_RANK if per_rank else BATCHNORM if batchnorm else []
    env = {"HPC_DDP_TEST_FAULT": f"slow:-1:{compute_s}"} if compute_s else None
    reference_dir = scratch / "b11-reference"
    proc = rehearse(reference_dir, *extra, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"B11 reference run failed: {proc.stderr[-2000:]}")
    reference, per_step = _done(reference_dir), step_seconds(reference_dir)
    rng = random.Random(seed)
    rows = [trial(scratch / "b11-trial", rng.randint(8, 32), rng.random() * per_step, reference, *extra, env=env,
                  node=index % 2 if batchnorm else 1) for index in range(trials)]
    good = [r for r in rows if "error" not in r]
    lost = [r["lost"] for r in good]
    every_50 = [r["step"] % 50 for r in good]
    return {"trials": trials, "per_rank": per_rank, "batchnorm": batchnorm, "compute_s": compute_s,
            "completed": len(good),
            "step_s": round(per_step, 4), "rows": rows,
            "lost_histogram": {str(k): lost.count(k) for k in sorted(set(lost))},
            "max_lost": max(lost, default=None), "jit_written": sum(1 for r in good if r["jit"]),
            "exact": sum(1 for r in good if r["exact"]),
            "periodic_every_50_mean_lost": round(statistics.mean(every_50), 1) if every_50 else None,
            "periodic_30_min_mean_lost": round(15 * 60 / per_step),
            "target": "0 steps lost in every trial where a consistent source exists, every trial bit-identical",
            "met": len(good) == trials and all(r["exact"] for r in good)
            and all(r["lost"] == 0 for r in good if r["jit"])}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    compute = next((float(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--compute-s=")), 0.0)
    print(json.dumps(b11(Path(args[0]), int(args[1]) if len(args) > 1 else 30, per_rank="--per-rank" in sys.argv,
                         compute_s=compute, batchnorm="--batchnorm" in sys.argv), indent=1))
