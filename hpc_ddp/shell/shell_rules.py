"""The batch shell's rules that need no Slurm: which step is still unsettled, and whether walltime
allows another.

Pure functions and one small run-dir file, so that tests can table them and
:mod:`hpc_ddp.supervise` stays a thin loop around them. No torch.

**The running step's record.** Before the batch shell starts a step it writes
``RUN_DIR/step.json`` (its job, requeue count, in-job restart, nodes, start). When the
node the batch shell runs on is lost, the shell dies with its step and nobody writes
the attempt's ledger line. The next batch shell of the run (a requeue, or a person's
``--resume``) finds that record without a line and writes the missing ``lost`` line
first, so every attempt is in the ledger and ``slurm.max_failures`` counts it.

**Walltime.** Slurm sends its stop warning once (``--signal=USR2@120``) to the steps that
run at that moment. A step started later never gets it and is killed at the limit, with
no snapshot. So no step starts when less than the warning plus a margin to resume is
left, and a step started inside the warning window gets the warning from the batch shell.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.core.batching import first_step_span
from hpc_ddp.core.codes import blames_a_peer
from hpc_ddp.core.hostlist import expand_hostlist
from hpc_ddp.rundir import jit_files, jit_offers, losses
from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.core.stopping import TICK_S
from hpc_ddp.core.timeline import TIMELINE_VAR, for_attempt, heal_failure, shell_marks
from hpc_ddp.rundir.ledger import append_attempt, attempt_fields, attempt_key, read_attempts

STEP_FILE = "step.json"
# a new step needs this long beyond the stop warning to resume and reach a boundary
RESUME_MARGIN_S = 60.0


def step_file(run_dir: Path) -> Path:
    return Path(run_dir) / STEP_FILE


def note_step(run_dir: Path, job_id: int | None, restart_count: int, in_job: int, hosts: str,
              start: float) -> None:
    """Record the step the batch shell is about to start (replaced at each step; atomic)."""
    record = {**attempt_fields(job_id, restart_count, in_job), "hosts": hosts, "start": start}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(step_file(run_dir), json.dumps(record, sort_keys=True) + "\n")


def unsettled_step(run_dir: Path, attempts: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The step the previous batch shell started and nobody recorded (its node was lost with it), or
    None."""
    try:
        record = json.loads(step_file(run_dir).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(attempt_key(a) == attempt_key(record) for a in attempts):
        return None
    return record


def settle_lost_step(run_dir: Path, job_id: int | None, restart_count: int,
                     now: float) -> dict[str, Any] | None:
    """Write the ``lost`` line of an unsettled step of an earlier batch shell; returns it (None:
    nothing to do). The current attempt's own step is not judged here (its line comes when it
    ends)."""
    record = unsettled_step(run_dir, read_attempts(run_dir))
    if record is None or attempt_key(record)[:2] == (job_id, restart_count):
        return None
    line = {**record, "reason": "lost", "end": None, "noted": round(now, 3),
            "message": "the batch shell ended with this step and wrote nothing: the node it ran on "
                       "(the batch host) "
                       "was most likely lost; recorded by the next batch shell of the run"}
    append_attempt(run_dir, line)
    return line


def walltime_problem(end: float | None, now: float, signal_delay_s: float,
                     margin_s: float = RESUME_MARGIN_S,
                     state: Callable[[], str | None] | None = None) -> str:
    """Why no new step may start with the job ending at ``end`` (epoch s; None: unknown); empty when
    it may.

    squeue's end is start + time limit only while the job runs: a job Slurm is ending (a node taken
    down: NODE_FAIL, COMPLETING) shows its actual end, now, which read as "0 s of walltime left"
    with most of the hour to go. So a near end is checked against the job's ``state`` (asked only
    then), and such a job is said to be ending, with no number."""
    if end is None:
        return ""
    left = end - now
    if left >= signal_delay_s + margin_s:
        return ""
    now_state = state() if state is not None else None
    if now_state and now_state not in ("RUNNING", "CONFIGURING"):
        return (f"Slurm is ending the job (its state is {now_state}, not RUNNING): no new step can "
                "start in it; "
                "its time limit is not what ends it")
    return (f"{max(0.0, left):.0f} s of walltime left, less than the stop warning's "
            f"{signal_delay_s:g} s plus "
            f"{margin_s:g} s to resume: a step started now would be killed at the limit without a "
            "snapshot")


def warning_due_in(end: float | None, start: float, now: float,
                   signal_delay_s: float) -> float | None:
    """Seconds until the batch shell must send the stop warning to a step that started at ``start``
    itself; None when Slurm's own warning will reach it (it started well before the warning time, or
    no end is known). A step started within one Slurm tick of the warning time may have missed it
    (Slurm checks every ~30 s)."""
    if end is None:
        return None
    warn_at = end - signal_delay_s
    if start < warn_at - TICK_S:
        return None
    return max(0.0, warn_at - now)


def batch_host(show_job: str, environ: Mapping[str, str]) -> str:
    """The node the batch shell runs on: scontrol's BatchHost=, else SLURMD_NODENAME (set in the
    batch shell)."""
    for part in show_job.split():
        if part.startswith("BatchHost="):
            return part.partition("=")[2]
    return environ.get("SLURMD_NODENAME", "")


def submitit_step_nodes(environ: Mapping[str, str], slurm: Any) -> list[str]:
    """The nodes submitit's step (the job's first) ran on: its span
    (:func:`hpc_ddp.core.batching.first_step_span`) of the batch shell's own ``SLURM_JOB_NODELIST``,
    the job's nodes when it started, which still holds a node Slurm removed from the job later
    (``--no-kill``). Nothing read from the run dir: each node's beat is a name another node's cached
    view may still call absent (a CI run recorded a 2-node step as n1's alone, and its loss was
    healed as a 1-node step's)."""
    nodes = expand_hostlist(environ.get("SLURM_JOB_NODELIST", "").strip())
    span = first_step_span(slurm)
    return nodes if span is None else nodes[span[0]:span[0] + span[1]]


def lost_nodes(run_dir: Path, job_id: int | None, restart: int, in_job: int, nodes: Sequence[str],
               per_node: int) -> dict[str, str]:
    """The nodes of the ranks the survivors declared lost (they stopped beating for dist.liveness_s:
    frozen, or gone without closing a socket). Hard suspects: a frozen node is not tried again."""
    ranks: dict[str, list[int]] = {}
    for rank, host in sorted(losses.lost_ranks(run_dir, job_id, restart, in_job).items()):
        index = rank // max(1, per_node)
        node = host if host in nodes else nodes[index] if index < len(nodes) else None
        if node is not None:
            ranks.setdefault(node, []).append(rank)
    return {node: f"{losses.who(lost)} stopped beating (liveness): frozen or lost"
            for node, lost in ranks.items()}


def raised_first(run_dir: Path, key: tuple[int | None, int, int], nodes: Sequence[str],
                 per_node: int) -> dict[str, str]:
    """The node of the rank whose own error ended the step (the earliest offer of the survivors'
    snapshot whose error is not a peer's loss), and why: {} when no offer says (snapshot.jit off,
    or that rank died with its node).

    Which rank *exited* first says little: the rank that raised is often the one that writes its
    node's share of the survivors' snapshot, so its peers, whose collectives failed when it left
    the group, exit before it; srun's first "task N: Exited" line and the rehearsal's first failed
    rank then name a bystander's node (a CI run healed a failing program three times, blaming the
    innocent node every other time). The offers carry each rank's error and when it came."""
    own = [o for o in jit_offers.listed(jit_files.folder(run_dir, *key))
           if isinstance(o.get("error"), str) and isinstance(o.get("rank"), int)
           and not blames_a_peer(o["error"])]
    if not own:
        return {}
    first = min(own, key=lambda o: (o.get("time") if isinstance(o.get("time"), (int, float))
                                    else float("inf"), o["rank"]))
    index = first["rank"] // max(1, per_node)
    node = first.get("host") if first.get("host") in nodes else (
        nodes[index] if index < len(nodes) else None)
    return {} if node is None else {
        node: f"rank {first['rank']} raised first there ({first['error'][:120]})"}


def heal_failure_of(run_dir: Path, key: tuple[int | None, int, int],
                    seen_end: float | None) -> tuple[float, str] | None:
    """The instant a failed step failed, for the heal's timeline
    (:func:`hpc_ddp.core.timeline.heal_failure`): from its ledger line (the batch shell wrote it
    before it decided anything), the last beats of the ranks declared lost (their markers, read by
    name after a listing of ``errors/``), and when this shell saw it end."""
    lines = [a for a in read_attempts(run_dir) if attempt_key(a) == key]
    markers = losses.lost_markers(run_dir, *key)
    beats = [m["last_beat_time"] for m in markers.values()
             if isinstance(m.get("last_beat_time"), (int, float))]
    return heal_failure(lines[-1] if lines else {}, beats, seen_end)


def shell_timeline(times: str, in_job: int) -> dict[str, Any]:
    """For the line of a healed step that wrote none (its rank 0's marks died with it): the batch
    shell's part of its timeline (``times``: what :data:`TIMELINE_VAR` gave its ranks), so the line
    still says how long the shell took to start it; {} for a job's first step."""
    part = for_attempt(shell_marks({TIMELINE_VAR: times}), {}, None, in_job) if in_job else None
    return {"timeline": part} if part is not None else {}
