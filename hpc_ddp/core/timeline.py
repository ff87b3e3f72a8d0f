"""A heal's (or a requeue's) timeline: where the seconds between a failure and the first step after
it go.

Pure (no torch, no files). The batch shell knows when it saw the failure and when it started the
next step; the new step's rank 0 knows when it had imported torch, formed its process group,
restored the state and done its first step. The shell's wall-clock times reach the ranks in one
environment variable (:data:`TIMELINE_VAR`, beside ``HPC_DDP_HEALED``); rank 0 keeps its own in
memory and writes them all into its attempt's ledger line, as seconds after the failure
(:func:`compose`). Nothing per step, no file per rank.

**The failure instant** (``failure`` in the object, epoch seconds, ``failure_from`` says which):

- an in-job heal (:func:`heal_failure`): the earliest of the lost ranks' last liveness beat
  (``last beat``: a frozen or lost node), the failed attempt's ledger line, when a rank wrote it
  as it noticed (``ledger line``: a hang, a survivors' snapshot), and the moment the batch shell
  saw the step end (``step end``: srun returned; a killed rank, a crash);
- a requeue (:func:`requeue_failure`): the previous attempt's end, as its ledger line says
  (``previous end``: the stop snapshot committed, or the failed step settled); the time in
  Slurm's queue is part of a requeue's cost.

Times are ``time.time()`` on different hosts: a phase measured on another node than the one
before it carries the clock skew between them (NTP keeps it to milliseconds; an unsynced
node shows as a phase that ends before the one before it, :func:`out_of_order`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# JSON from the batch shell: failure, failure_from, detected, launched (epoch s)
TIMELINE_VAR = "HPC_DDP_TIMELINE"
PHASES = ("detected", "launched", "started", "imported", "group_ready", "restored", "compiled",
          "first_step")
SHELL_PHASES = ("detected", "launched")  # the batch shell's (or the rehearsal's launcher's)
RANK_PHASES = PHASES[2:]  # rank 0's, in memory (hpc_ddp.rank.metrics.timeline.mark)
# optional facts beside "compiled": "hit"|"miss"|"partial", dynamo's seconds
EXTRAS = ("compile_cache", "compile_s")
MEANING = {
    "detected": "the batch shell knew (srun returned; for a requeue: Slurm started the job again)",
    "launched": "the batch shell started the new step (srun)",
    "started": "rank 0's process started (from launched: the step's start on the node, a pyxis "
               "container's image import included)",
    "imported": "rank 0 had imported torch and hpc_ddp (train.script: the wrapper started the "
                "script)",
    "group_ready": "the process group was formed (every rank had joined)",
    "restored": "the state was restored (snapshot or survivors')",
    "compiled": "the first compiled step was done (its compile included; the cache's verdict "
                "beside it)",
    "first_step": "the first run.boundary of the new attempt was reached (train.script: its first "
                  "progress line)",
}
# the previous attempt's reasons after which the next attempt is a requeue (or a chain's next job)
REQUEUED_AFTER = ("timeout", "preemption", "requeued", "failed", "hung", "lost")
BAR_WIDTH = 40


def encode_shell(failure: tuple[float, str] | None = None, **times: float | None) -> str:
    """The batch shell's part for :data:`TIMELINE_VAR`: the failure (instant, where from) and the
    :data:`SHELL_PHASES` it timed, as epoch seconds."""
    record: dict[str, Any] = {k: round(v, 3) for k, v in times.items() if k in SHELL_PHASES
                              and v is not None}
    if failure is not None:
        record.update(failure=round(failure[0], 3), failure_from=failure[1])
    return json.dumps(record, sort_keys=True)


def shell_marks(environ: Mapping[str, str]) -> dict[str, Any]:
    """What :func:`encode_shell` put in the environment; {} when absent or unreadable (a timeline is
    a report, never a reason to fail a step)."""
    try:
        record = json.loads(environ.get(TIMELINE_VAR) or "{}")
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    found: dict[str, Any] = {k: float(v) for k, v in record.items()
                             if k in (*SHELL_PHASES, "failure") and _number(v)}
    if "failure" in found:
        found["failure_from"] = str(record.get("failure_from") or "batch shell")
    return found


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def heal_failure(record: Mapping[str, Any], last_beats: Iterable[float], seen_end: float | None,
                 ) -> tuple[float, str] | None:
    """The failure instant of a step healed in the job: the earliest of the lost ranks' last beats,
    the failed line's ``end`` and when the batch shell saw the step end; None when none is known."""
    found = [(t, "last beat") for t in last_beats if _number(t) and t > 0]
    if _number(record.get("end")):
        found.append((float(record["end"]), "ledger line"))
    if _number(seen_end):
        found.append((float(seen_end), "step end"))  # type: ignore[arg-type]
    return min(found) if found else None


def requeue_failure(previous: Mapping[str, Any] | None) -> tuple[float, str] | None:
    """The failure instant of a requeued (or chained) attempt: the previous attempt's end, when that
    attempt ended in a way that requeues (not a finished run, a cancel or a person's
    ``--resume``)."""
    if (previous is None or previous.get("before_resume")
            or previous.get("reason") not in REQUEUED_AFTER):
        return None
    end = previous.get("end")
    return (float(end), "previous end") if _number(end) else None


def compose(failure: tuple[float, str], marks: Mapping[str, float], kind: str,
            extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ledger's ``timeline``: ``failure`` (epoch s), ``failure_from``, ``kind`` ("heal" or
    "requeue") and each phase marked, as seconds after the failure (phases in :data:`PHASES` order),
    with the
    :data:`EXTRAS` given."""
    at, source = failure
    timeline: dict[str, Any] = {"kind": kind, "failure": round(at, 3), "failure_from": source}
    for phase in PHASES:
        if _number(marks.get(phase)):
            timeline[phase] = round(float(marks[phase]) - at, 3)
    for key, value in (extras or {}).items():
        if key in EXTRAS and isinstance(value, (str, int, float, bool)):
            timeline[key] = value
    return timeline


def for_attempt(shell: Mapping[str, Any], marks: Mapping[str, float],
                previous: Mapping[str, Any] | None,
                in_job: int, extras: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """Rank 0's timeline of its attempt: the shell's failure instant (a heal), else the previous
    attempt's end (a requeue, or a heal whose shell gave none); None for a run's first attempt or
    one after a finished, cancelled or resumed run."""
    failure: tuple[float, str] | None = None
    if _number(shell.get("failure")):
        failure = (float(shell["failure"]), str(shell.get("failure_from") or "batch shell"))
    failure = failure or requeue_failure(previous)
    if failure is None:
        return None
    return compose(failure, {**{k: v for k, v in shell.items() if k in SHELL_PHASES}, **marks},
                   "heal" if in_job else "requeue", extras)


def out_of_order(timeline: Mapping[str, Any]) -> list[str]:
    """The phases that end before the failure or before a phase listed before them: clock skew
    between the hosts that timed them (or a phase marked out of its place)."""
    wrong, latest = [], 0.0
    for phase in PHASES:
        seconds = timeline.get(phase)
        if not _number(seconds):
            continue
        if seconds < latest:
            wrong.append(phase)
        latest = max(latest, seconds)
    return wrong


def last_timeline(attempts: Sequence[Mapping[str, Any]]) -> tuple[int, dict[str, Any]] | None:
    """The newest attempt with a timeline (its index in the ledger, the timeline)."""
    for i in range(len(attempts) - 1, -1, -1):
        if isinstance(attempts[i].get("timeline"), dict):
            return i, dict(attempts[i]["timeline"])
    return None


def lines(timeline: Mapping[str, Any], index: int) -> list[str]:
    """``status``'s view: a line per phase, seconds after the failure, a bar of the phase's own
    share."""
    source = timeline.get("failure_from", "?")
    # a requeue after a stop had no failure: its clock starts at the attempt before's end
    since = ("the previous attempt's end" if source == "previous end"
             else f"the failure ({source})")
    head = f"timeline of attempt #{index} ({timeline.get('kind', '?')}), seconds after {since}:"
    marked = [(p, float(timeline[p])) for p in PHASES if _number(timeline.get(p))]
    total = max([s for _, s in marked] + [1e-9])
    out, before = [head], 0.0
    for phase, seconds in marked:
        start, end = (min(before, seconds), max(before, seconds))
        lead = min(BAR_WIDTH - 1, int(round(BAR_WIDTH * max(0.0, start) / total)))
        bar = " " * lead + "#" * max(1, min(BAR_WIDTH - lead,
                                            int(round(BAR_WIDTH * (end - max(0.0,
                                                                             start)) / total))))
        note = _compile_note(timeline) if phase == "compiled" else ""
        out.append(f"  {phase:<12} {seconds:>8.1f} s  +{seconds - before:>6.1f}  "
                   f"|{bar:<{BAR_WIDTH}}|{note}")
        before = max(before, seconds)
    missing = [p for p in PHASES if p not in timeline and p != "compiled"]
    if missing:
        out.append(f"  not timed: {', '.join(missing)}")
    skewed = out_of_order(timeline)
    if skewed:
        out.append(f"  WARNING: {', '.join(skewed)} end(s) before the phase before: the hosts' "
                   "clocks disagree")
    return out


def _compile_note(timeline: Mapping[str, Any]) -> str:
    """Beside the compiled phase: the cache's verdict and dynamo's own count of seconds spent
    compiling."""
    facts = [f"cache {timeline['compile_cache']}"] if "compile_cache" in timeline else []
    if "compile_s" in timeline:
        facts.append(f"{timeline['compile_s']} s compiling")
    return f"  ({', '.join(facts)})" if facts else ""
