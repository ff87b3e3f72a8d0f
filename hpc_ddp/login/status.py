"""``python -m hpc_ddp.status RUN_DIR``: where a run stands, from its files and Slurm.

Job state (squeue, else sacct), the attempts ledger as a table, progress with an
ETA, the newest committed snapshot, and the last error lines of the log that says why
when the run is not going well (the first rank's own exception, not a survivor's view of
it: :mod:`hpc_ddp.login.failure_logs`). ``--json`` prints the same as one object; ``--plot
loss.png`` draws the loss curve (matplotlib, the ``plot`` extra). No torch.
Also installed as the console script ``hpc-ddp-status``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.rundir import layout, metrics_file
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.login.failure_logs import last_errors
from hpc_ddp.core.slurm_jobs import job_state
from hpc_ddp.rundir.ledger import read_attempts

EPILOG = """\
examples:
  python -m hpc_ddp.status runs/mlp
  python -m hpc_ddp.status runs/mlp --json | jq .progress
  python -m hpc_ddp.status runs/mlp --plot loss.png          # needs: pip install 'hpc_ddp[plot]'
"""


def _slurm_state(job_id: str) -> str | None:
    """squeue's state while Slurm holds the job, else sacct's (accounting keeps finished jobs)."""
    state = job_state(job_id)
    if state or not shutil.which("sacct"):
        return state
    proc = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True,
                          timeout=30)
    lines = proc.stdout.split()
    return lines[-1] if proc.returncode == 0 and lines else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def local_state(attempts: list[dict[str, Any]], done: bool, alive: bool) -> str:
    """A local rehearsal's state from its launcher and its ledger (no Slurm to ask)."""
    if alive:
        return "RUNNING (local)"
    if done:
        return "FINISHED"
    if not attempts:
        return "NOT STARTED (local)"
    last = attempts[-1]
    if last.get("reason") in ("timeout", "preemption", "interrupted", "cancelled"):
        why = "cap reached" if last.get("capped") else "--resume continues it"
        return f"STOPPED (local, {why})"
    return "FAILED (local)"


def timing(metrics: list[dict[str, Any]], attempts: list[dict[str, Any]], max_steps: int | None, running: bool,
           now: float, started: float | None = None) -> dict[str, Any]:
    """Time used over all attempts (the running one from ``started``, its lock's time, start-up included; else
    from its first metric), how many attempts that is, the recent steps/s and, with max_steps, the ETA."""
    ended = sum(a["end"] - a["start"] for a in attempts if isinstance(a.get("start"), (int, float))
                and isinstance(a.get("end"), (int, float)))
    since = attempts[-1].get("end", 0) if attempts else 0
    current = [m for m in metrics if isinstance(m.get("time"), (int, float)) and m["time"] > since]
    begun = started if isinstance(started, (int, float)) and started > since else (
        current[0]["time"] if current else None)
    out: dict[str, Any] = {"time_used_s": round(ended + (now - begun if running and begun else 0)),
                           "attempts": len(attempts) + int(running)}
    recent = current[-20:] if running else []
    if len(recent) >= 2 and recent[-1]["time"] > recent[0]["time"]:
        rate = (recent[-1]["step"] - recent[0]["step"]) / (recent[-1]["time"] - recent[0]["time"])
        out["steps_per_s"] = round(rate, 3)
        if max_steps and rate > 0:
            out["eta_s"] = round((max_steps - recent[-1]["step"]) / rate)
    return out


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, minutes = seconds // 3600, seconds % 3600 // 60
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds % 60:02d}s"


def collect(run_dir: Path) -> dict[str, Any]:
    """Everything status shows, as plain data."""
    from hpc_ddp.rundir import snapshot  # manifests only: no torch

    job = _read_json(layout.job(run_dir)) or {}
    metrics = metrics_file.read(run_dir)  # one record per step: a resumed attempt's values replace replays
    done = _read_json(layout.done(run_dir))
    attempts = read_attempts(run_dir)
    job_id = str(job.get("job_id", "")) or _ledger_job(run_dir, attempts)
    if done or not job.get("local"):
        state = "FINISHED" if done else (_slurm_state(job_id) if job_id else None)
    else:  # a local rehearsal's id is no Slurm job's: ask whether its launcher lives, not squeue
        from hpc_ddp.rundir.runlock import holder_alive

        state = local_state(attempts, bool(done), holder_alive({**job, "local": True}))
    progress: dict[str, Any] = {}
    max_steps = _max_steps(run_dir)
    if metrics:
        last = metrics[-1]
        progress = {"step": last["step"], "loss": last.get("loss"), "samples_per_s": last.get("samples_per_s"),
                    **({"max_steps": max_steps} if max_steps else {})}
    running = bool(state) and str(state).startswith("RUNNING") and not done
    lock = _read_json(layout.lock(run_dir)) or {}
    progress.update(timing(metrics, attempts, max_steps, running, time.time(), lock.get("since")))
    steps = snapshot.committed_steps(run_dir)
    result = {"run_dir": str(run_dir), "job_id": job_id, "state": state, "done": done, "progress": progress,
              "attempts": attempts, "newest_snapshot": steps[0] if steps else None, "hangs": _hangs(run_dir, attempts)}
    if not done and (state is None or state.split()[0] in ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY",
                                                           "NODE_FAIL")):
        # a job array's logs are in the sweep's slurm/ (job.json says where), one run's in RUN_DIR/slurm
        result["last_errors"] = last_errors(run_dir, Path(job.get("logs") or layout.slurm_logs(run_dir)))
    return result


def _hangs(run_dir: Path, attempts: list[dict[str, Any]]) -> dict[int, str]:
    """A note per hung attempt whose ranks dumped their flight record: where the dumps are, and which
    collective the ranks waited in and who never reached it (:func:`hpc_ddp.rundir.flight.summarize`)."""
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
                lines.append(f"no dump from ranks {','.join(map(str, missing))}: they ended before their watchdog "
                             "fired (their logs say why)")
            notes[i] = (f"hung; the collectives of ranks {','.join(map(str, sorted(dumps)))} are in "
                        f"{attempt['collectives']}*.json" + "".join(f"\n      {line}" for line in lines))
    return notes


def _ledger_job(run_dir: Path, attempts: list[dict[str, Any]]) -> str | None:
    """The newest attempt's job id for a job submitted by hand with an emitted script (no job.json;
    its log dir RUN_DIR/slurm exists). Local rehearsals have neither, and their ids are not Slurm's."""
    if not layout.slurm_logs(run_dir).is_dir():
        return None
    return next((str(a["job_id"]) for a in reversed(attempts) if a.get("job_id") is not None), None)


def _config(run_dir: Path) -> Any:
    """The run's resolved config, or None when it cannot be read (status still shows the ledger)."""
    from hpc_ddp.core.config import load_config

    try:
        return load_config([layout.config(run_dir)])
    except HpcDdpError:
        return None


def _max_steps(run_dir: Path) -> int | None:
    """train.max_steps of the run's resolved config (None when unset or unreadable)."""
    cfg = _config(run_dir)
    return None if cfg is None else cfg.train.max_steps


def _shape(attempt: dict[str, Any]) -> str:
    """'2x2 accum 2': nodes x tasks per node (or the world size) and accumulation; '-' for older ledgers."""
    world, nodes = attempt.get("world_size"), attempt.get("nodes")
    if not world:
        return "-"
    shape = f"{nodes}x{world // nodes}" if nodes and world % nodes == 0 else f"{world} ranks"
    return shape + (f" accum {attempt['grad_accum']}" if attempt.get("grad_accum") else "")


def done_line(done: dict[str, Any]) -> str:
    """DONE.json in a line, whichever program wrote it: a loop or task (step, params_sha256) or a script (its
    exit code, and no step: a script's steps are its own)."""
    parts = [f"step {done['step']}"] if "step" in done else []
    if "script" in done:
        parts.append(f"script {done['script']} exited {done.get('exit_code', '?')}")
    if done.get("params_sha256"):
        parts.append(f"params_sha256 {str(done['params_sha256'])[:16]}")
    return "  ".join(parts) or "(DONE.json holds no step)"


def render(info: dict[str, Any]) -> str:
    out = [f"run     {info['run_dir']}", f"job     {info['job_id'] or '-'}  state {info['state'] or 'unknown'}"]
    progress = info["progress"]
    if progress.get("step") is not None:
        line = f"step    {progress['step']}"
        if progress.get("max_steps"):
            line += f"/{progress['max_steps']}"
        if isinstance(progress.get("loss"), (int, float)):
            line += f"  loss {progress['loss']:.6g}"
        if progress.get("samples_per_s"):
            line += f"  {progress['samples_per_s']} samples/s"
        out.append(line)
    if progress.get("time_used_s") or progress.get("eta_s") is not None:
        count = progress.get("attempts") or len(info["attempts"]) or 1
        line = f"time    {_duration(progress.get('time_used_s', 0))} used over {count} attempt(s)"
        if progress.get("eta_s") is not None:
            line += f"; about {_duration(progress['eta_s'])} left at {progress['steps_per_s']} steps/s"
        out.append(line)
    if info["done"]:
        out.append(f"done    {done_line(info['done'])}")
    out.append(f"snapshot newest committed step: {info['newest_snapshot'] if info['newest_snapshot'] else '-'}")
    if info["attempts"]:
        out.append("attempts:")
        out.append("  #  job      restart  ended for        steps          geometry     resumed from")
        for i, a in enumerate(info["attempts"]):
            first, last = a.get("first_step"), a.get("last_step")
            steps = "-" if last is None else f"{first or 0}->{last}"
            reason = a.get("reason", "?") + (" (cap)" if a.get("capped") else "")
            if a.get("reason") in ("failed", "error", "hung") and not last and not info["progress"].get("step"):
                steps = "before step 1"
            restart = f"{a.get('restart_count', '-')}" + (f"+{a['in_job']}" if a.get("in_job") else "")
            out.append(f"  {i:<2} {str(a.get('job_id')):<8} {restart:<8} {reason:<16} "
                       f"{steps:<14} {_shape(a):<12} "
                       f"{a.get('resumed_from') if a.get('resumed_from') is not None else '-'}")
    notes = [(i, a["note"]) for i, a in enumerate(info["attempts"]) if a.get("note")]
    notes += [(i, healed_note(a)) for i, a in enumerate(info["attempts"]) if a.get("healed")]
    notes += list(info.get("hangs", {}).items())
    notes.sort(key=lambda item: item[0])
    if notes:
        out.append("notes:")
        out.extend(f"  #{i}: {note}" for i, note in notes)
    if info.get("last_errors"):
        out.append("last errors:")
        out.extend(f"  {line}" for line in info["last_errors"])
    return "\n".join(out)


def healed_note(attempt: dict[str, Any]) -> str:
    """One line on an in-job restart: after what, how, on which nodes, and what was left out and why."""
    healed = attempt["healed"]
    left_out = "; ".join(f"{node}: {why}" for node, why in (healed.get("excluded") or {}).items())
    return (f"in-job restart {attempt.get('in_job')} after a {healed.get('after')} step on "
            f"{healed.get('nodes_before')}: {healed.get('how')}, now on {attempt.get('hosts')}"
            + (f" (left out {left_out})" if left_out else ""))


def _no_loss_hint(cfg: Any) -> str:
    if cfg is not None and cfg.train.script:
        return ("a train.script run writes no metrics of its own (hpc_ddp sees only its output); to plot one, log "
                "from the script: `with hpc_ddp.session() as run:` ... `run.log_metrics(step, loss=...)`")
    if cfg is not None and cfg.train.loop:
        return "wait for the loop's first run.log_metrics(step, loss=...) call (rank 0 writes it)"
    return "wait for the first log step (train.log_every)"


def _log_scale(ax: Any, span: float) -> None:
    """A log axis labelled 0.5, 2 rather than 5x10^-1; minor ticks are labelled only within one decade,
    where there are few of them (over several decades their labels overlap)."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g") if span < 10 else NullFormatter())


def plot(run_dir: Path, out: Path) -> str:
    """Write the loss curve of ``run_dir`` to ``out``: each step once, with the value of the newest attempt
    that logged it (:mod:`hpc_ddp.rundir.metrics_file`), and a dotted line where each requeued attempt resumed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # login nodes have no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise HpcDdpError(explain("--plot needs matplotlib, which is not installed",
                                  hint="pip install 'hpc_ddp[plot]' (or pip install matplotlib)"),
                          key="--plot") from None
    cfg = _config(run_dir)
    metrics = [m for m in metrics_file.read(run_dir) if isinstance(m.get("loss"), (int, float))]
    if not metrics:
        raise HpcDdpError(explain(f"nothing to plot: {run_dir / 'metrics.jsonl'} has no loss yet", hint=_no_loss_hint(
            cfg)), key="--plot")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.2, label="loss")
    attempts = read_attempts(run_dir)
    for number, attempt in enumerate(attempts[1:], start=1):
        if attempt.get("first_step"):  # where a requeued attempt resumed, and why the one before ended
            ax.axvline(attempt["first_step"], color="grey", ls=":", lw=1)
            ax.annotate(f"#{number} after {attempts[number - 1].get('reason', '?')}", (attempt["first_step"], 1),
                        xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8,
                        color="dimgrey")
    trainer = cfg is None or not (cfg.train.loop or cfg.train.script)  # only the Trainer averages over ranks
    ax.set(xlabel="step", ylabel="loss (mean over ranks)" if trainer else "loss (as rank 0 logged it)",
           title=f"{run_dir.name if cfg is None else cfg.name}: loss")
    losses = [m["loss"] for m in metrics]
    if min(losses) > 0:
        _log_scale(ax, max(losses) / min(losses))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return f"wrote {out}: {len(metrics)} points, steps {metrics[0]['step']}..{metrics[-1]['step']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.status", description=for_help(__doc__), epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    parser.add_argument("run_dir", type=Path, help="the run directory (printed by submit)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also write the loss curve to this image")
    args = parser.parse_args(argv)
    if not layout.config(args.run_dir).is_file():
        found = "does not exist" if not args.run_dir.exists() else f"has no {layout.CONFIG}"
        print(f"error: {args.run_dir} is not a run directory (it {found}).\nHINT: pass the run dir that submit "
              "printed, e.g. runs/NAME", file=sys.stderr)
        return 2
    if args.plot:
        try:
            print(plot(args.run_dir, args.plot), file=sys.stderr if args.json else sys.stdout)
        except HpcDdpError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    info = collect(args.run_dir)
    print(json.dumps(info, default=str) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

