"""What ``status`` knows of a run, read from its run dir (ledger, metrics, DONE.json, hang dumps,
config) and, for a live job, from Slurm: one dict that :func:`hpc_ddp.login.status.render.render`
turns into text. No torch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout, metrics_file, script_progress
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.login.failure_logs import last_errors
from hpc_ddp.core.slurm_jobs import job_state
from hpc_ddp.rundir.ledger import attempt_key, read_attempts
from hpc_ddp.rundir.ledger_history import chain_jobs, steps_lost


def _slurm_state(job_id: str) -> str | None:
    """squeue's state while Slurm holds the job, else sacct's (accounting keeps finished jobs)."""
    state = job_state(job_id)
    if state or not shutil.which("sacct"):
        return state
    proc = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True,
                          text=True,
                          timeout=30)
    lines = proc.stdout.split()
    return lines[-1] if proc.returncode == 0 and lines else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# a ledger's reasons that --resume continues
STOPS = ("timeout", "preemption", "requeued", "interrupted", "cancelled")


def local_state(attempts: list[dict[str, Any]], done: bool, alive: bool) -> str:
    """A local rehearsal's state from its launcher and its ledger (no Slurm to ask)."""
    if alive:
        return "RUNNING (local)"
    if done:
        return "FINISHED"
    if not attempts:
        return "NOT STARTED (local)"
    last = attempts[-1]
    if last.get("reason") in STOPS:
        why = "cap reached" if last.get("capped") else "--resume continues it"
        return f"STOPPED (local, {why})"
    return "FAILED (local)"


ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING",
          # Slurm's STOPPED: SIGSTOPped, still holds its nodes
          "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED")


def verdict(state: str | None, done: bool, attempts: list[dict[str, Any]]) -> str:
    """"active", "finished", "failed", "stopped" (short of its end; --resume continues it) or
    "unknown": what status's exit code says (:data:`hpc_ddp.core.codes.STATUS_OK` and after).
    Slurm's state first; where the job is gone, the ledger's last attempt (a job that COMPLETED
    without DONE.json ended as its last attempt did)."""
    if done:
        return "finished"
    word = state.split()[0].rstrip("+") if state and state.split() else ""
    if state and "(local" in state:  # local_state's words
        return {"RUNNING": "active", "STOPPED": "stopped", "FAILED": "failed"}.get(word, "unknown")
    if word in ACTIVE:
        return "active"
    if word == "CANCELLED":
        return "stopped"
    last = attempts[-1].get("reason") if attempts else None
    if last is None:
        return "failed" if word in ("FAILED", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "TIMEOUT",
                                    "PREEMPTED",
                                    "DEADLINE") else "unknown"  # ended without an attempt line
    return "stopped" if last in STOPS else "failed"


def timing(metrics: list[dict[str, Any]], attempts: list[dict[str, Any]], max_steps: int | None,
           running: bool,
           now: float, started: float | None = None) -> dict[str, Any]:
    """Time used over all attempts (the running one from ``started``, its lock's time, start-up
    included; else from its first metric), how many attempts that is, the recent steps/s and, with
    max_steps, the ETA."""
    ended = sum(a["end"] - a["start"] for a in attempts if isinstance(a.get("start"), (int, float))
                and isinstance(a.get("end"), (int, float)))
    since = attempts[-1].get("end", 0) if attempts else 0
    current = [m for m in metrics if isinstance(m.get("time"), (int, float)) and m["time"] > since]
    begun = started if isinstance(started, (int, float)) and started > since else (
        current[0]["time"] if current else None)
    out: dict[str, Any] = {"time_used_s": round(ended + (now - begun if running and begun else 0)),
                           "attempts": len(attempts) + int(running)}
    # an older batch shell's
    untimed = sum(1 for a in attempts if not isinstance(a.get("start"), (int, float)))
    if untimed:  # lines had none: said, so that the sum is not taken for the whole
        out["untimed"] = untimed
    recent = current[-20:] if running else []
    if len(recent) >= 2 and recent[-1]["time"] > recent[0]["time"]:
        rate = (recent[-1]["step"] - recent[0]["step"]) / (recent[-1]["time"] - recent[0]["time"])
        out["steps_per_s"] = round(rate, 3)
        if max_steps and rate > 0:
            out["eta_s"] = round((max_steps - recent[-1]["step"]) / rate)
    return out


def duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, minutes = seconds // 3600, seconds % 3600 // 60
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds % 60:02d}s"


def with_starts(attempts: list[dict[str, Any]], starts: dict[int, int]) -> list[dict[str, Any]]:
    """The ledger's lines, each with where its attempt began: a line the batch shell or the launcher
    wrote for ranks that could not (a lost node) has no ``first_step``, and status showed such an
    attempt as run from step 0 (a newcomer's rehearsal: ``failed 0->25`` for one resumed from 16);
    its rank 0's first metrics line says (:func:`hpc_ddp.rundir.metrics_file.attempt_starts`)."""
    out = []
    for i, attempt in enumerate(attempts):
        start = starts.get(i)
        if attempt.get("first_step") is None and start is not None:
            attempt = {**attempt, "first_step": start,
                       **({"resumed_from": start} if start and attempt.get("resumed_from") is None
                          else {})}
        out.append(attempt)
    return out


def collect(run_dir: Path) -> dict[str, Any]:
    """Everything status shows, as plain data."""
    from hpc_ddp.rundir.snapshot import steps as snapshot_steps  # manifests only: no torch

    job = _read_json(layout.job(run_dir)) or {}
    # one record per step: a resumed attempt's values replace replays
    lines = metrics_file.lines_of(run_dir)
    # a train.script's steps, as rank 0's worker read them
    metrics = metrics_file.history(lines) or script_progress.points(run_dir)
    done = _read_json(layout.done(run_dir))
    attempts = with_starts(read_attempts(run_dir), metrics_file.attempt_starts(lines))
    job_id = str(job.get("job_id", "")) or _ledger_job(run_dir, attempts)
    if done or not job.get("local"):
        state = "FINISHED" if done else (_slurm_state(job_id) if job_id else None)
    else:  # a local rehearsal's id is no Slurm job's: ask whether its launcher lives, not squeue
        from hpc_ddp.rundir.runlock import holder_alive

        state = local_state(attempts, bool(done), holder_alive({**job, "local": True}))
    progress: dict[str, Any] = {}
    cfg = read_config(run_dir)
    max_steps = total_steps(cfg, metrics)
    if metrics:
        last = metrics[-1]
        progress = {"step": last["step"], "loss": newest(metrics).get("loss", (None,))[0],
                    "samples_per_s": last.get("samples_per_s"),
                    **({"max_steps": max_steps} if max_steps else {})}
    running = bool(state) and str(state).startswith("RUNNING") and not done
    lock = _read_json(layout.lock(run_dir)) or {}
    progress.update(timing(metrics, attempts, max_steps, running, time.time(), lock.get("since")))
    steps = snapshot_steps.committed_steps(run_dir)
    result = {"run_dir": str(run_dir), "job_id": job_id, "state": state, "done": done,
              "progress": progress,
              "attempts": attempts, "newest_snapshot": steps[0] if steps else None,
              "hangs": _hangs(run_dir, attempts),
              # by attempt (JSON keys)
              "steps_lost": {str(i): entry for i, entry in steps_lost(
                  attempts, steps[0] if steps else None).items()},
              "jobs": chain_jobs(attempts, job_id or None)
              if any(a.get("next_job") for a in attempts) else []}
    result["profile"] = (cfg.profile or None) if cfg is not None else None
    # a failed attempt's geometry
    result["tasks_per_node"] = None if cfg is None else cfg.slurm.tasks_per_node
    result["logged"] = {key: value for key, value in newest(metrics).items() if key not in SHOWN}
    result["verdict"] = verdict(state, bool(done), attempts)
    result["slow_now"] = _slow_now(run_dir, attempts) if running else None
    if state and state.startswith("PENDING") and not job.get("local"):
        from hpc_ddp.login.partition import pending_reason

        result["pending_reason"] = pending_reason(job_id)
    if not done and (state is None or state.split()[0] in ("FAILED", "CANCELLED", "TIMEOUT",
                                                           "OUT_OF_MEMORY",
                                                           "NODE_FAIL")):
        # a job array's logs are in the sweep's slurm/ (job.json says where), one run's in
        # RUN_DIR/slurm
        result["last_errors"] = last_errors(run_dir,
                                            Path(job.get("logs") or layout.slurm_logs(run_dir)))
    return result


def _slow_now(run_dir: Path, attempts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The slow nodes the running attempt named (rank/loop/pace.py), until its ledger line has
    them."""
    record = _read_json(layout.slow_nodes(run_dir))
    if not isinstance(record, dict) or not isinstance(record.get("slow_nodes"), dict):
        return None
    ended = attempt_key(record) in {attempt_key(a) for a in attempts}
    return None if ended else record["slow_nodes"]


def _hangs(run_dir: Path, attempts: list[dict[str, Any]]) -> dict[int, str]:
    """A note per hung attempt whose ranks dumped their flight record: where the dumps are, and
    which collective the ranks waited in and who never reached it
    (:func:`hpc_ddp.rundir.flight.summarize`)."""
    from hpc_ddp.rundir import flight  # no torch at import

    notes = {}
    for i, attempt in enumerate(attempts):
        if attempt.get("reason") == "hung" and attempt.get("collectives"):
            prefix = str(Path(run_dir) / attempt["collectives"])
            dumps = flight.read(prefix)
            lines = flight.summarize(dumps)
            world = attempt.get("world_size")
            missing = [r for r in range(world) if r not in dumps] if isinstance(world, int) else []
            if missing:  # e.g. a rank whose connection broke when a peer's watchdog ended it first
                lines.append(f"no dump from ranks {','.join(map(str, missing))}: they ended before "
                             "their watchdog "
                             "fired (their logs say why)")
            notes[i] = (f"hung; the collectives of ranks {','.join(map(str, sorted(dumps)))} are "
                        "in "
                        f"{attempt['collectives']}*.json"
                        + "".join(f"\n      {line}" for line in lines))
    return notes


def _ledger_job(run_dir: Path, attempts: list[dict[str, Any]]) -> str | None:
    """The newest attempt's job id for a job submitted by hand with an emitted script (no job.json;
    its log dir RUN_DIR/slurm exists). Local rehearsals have neither, and their ids are not
    Slurm's."""
    if not layout.slurm_logs(run_dir).is_dir():
        return None
    return next((str(a["job_id"]) for a in reversed(attempts) if a.get("job_id") is not None), None)


def read_config(run_dir: Path) -> Any:
    """The run's resolved config, or None when it cannot be read (status still shows the ledger)."""
    from hpc_ddp.core.config import load_config

    try:
        return load_config([layout.config(run_dir)])
    except HpcDdpError:
        return None


# on status's step line, or not a metric
SHOWN = ("step", "time", "loss", "samples_per_s", "max_steps")


def newest(metrics: list[dict[str, Any]]) -> dict[str, tuple[Any, int]]:
    """Every key the run logged (``run.log_metrics(step, val_loss=...)``), with its newest value and
    that step."""
    latest: dict[str, tuple[Any, int]] = {}
    for record in metrics:
        latest.update((key, (value, record["step"])) for key, value in record.items()
                      if key not in ("step", "time") and value is not None)
    return latest


def total_steps(cfg: Any, metrics: list[dict[str, Any]]) -> int | None:
    """The run's last step, where it is known: what the loop logged as ``max_steps``
    (``run.log_metrics(step, loss=..., max_steps=N)``); else the config's train.max_steps, which the
    Trainer obeys. An own loop or script decides its own end: its train.max_steps is shown only
    while the run has not passed it (a loop with its own count would read ``step 1500/100``)."""
    logged = newest(metrics).get("max_steps", (None,))[0]
    if isinstance(logged, int) and not isinstance(logged, bool) and logged > 0:
        return logged
    configured = None if cfg is None else cfg.train.max_steps
    if configured is None or cfg.train.task:
        return configured
    return configured if not metrics or metrics[-1]["step"] <= configured else None
