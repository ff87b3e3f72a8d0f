"""The ledger's schema: which fields a line of ``RUN_DIR/attempts.jsonl`` may hold, and their types.

Every reader of the ledger (the ranks' start and caps, the batch shell, ``status``) gets its lines
through
:func:`hpc_ddp.rundir.ledger.read_attempts`, which checks each line here: a line with a known field
of the wrong type (``"reason": [...]``, ``"restart_count": "a"``) is named in a warning (file, line
number, field, what it holds and what it should) and skipped, so no reader crashes on it. Fields not
listed are allowed (a newer writer's, a person's note); None is allowed where a writer writes it
(``last_step`` of a run that never logged). Whoever can write the run dir can write this file: a
line here is data, never trusted further than its type. No torch.
"""

from __future__ import annotations

from typing import Any

# A kind of value: the types it may have (bool is never an int here), and how a warning names it.
INT, NUMBER, TEXT, BOOL = "an integer", "a number", "a string", "true or false"
INTS, TEXTS, OBJECT = "a list of integers", "a list of strings", "a JSON object"
OR_NULL = " or null"

FIELDS: dict[str, str] = {
    # an attempt's identity (ledger.attempt_key): job id (a number; a string for an array task),
    # requeue count, in-job restart
    "job_id": INT + "|" + TEXT + OR_NULL, "restart_count": INT + OR_NULL, "in_job": INT + OR_NULL,
    "reason": TEXT, "amends": BOOL, "caps_from": TEXT, "before_resume": BOOL, "capped": BOOL
    + OR_NULL,
    "start": NUMBER + OR_NULL, "end": NUMBER + OR_NULL, "time": NUMBER + OR_NULL, "noted": NUMBER
    + OR_NULL,
    "first_step": INT + OR_NULL, "last_step": INT + OR_NULL, "resumed_from": INT + OR_NULL,
    "snapshot": INT + OR_NULL, "exit_code": INT + OR_NULL, "rank": INT + OR_NULL,
    "world_size": INT + OR_NULL, "nodes": INT + OR_NULL, "grad_accum": INT + OR_NULL,
    "hosts": TEXT + OR_NULL, "next_job": INT + "|" + TEXT + OR_NULL, "chained_from": INT + "|"
    + TEXT + OR_NULL,
    **{name: TEXT + OR_NULL for name in ("message", "note", "requeue_by", "requeue_refused",
                                         "jit_fallback",
                                         "heal_error", "chained_with", "last_step_from",
                                         "collectives",
                                         "stop_ignored", "failure_from", "signal")},
    "lost_ranks": INTS + OR_NULL, "stuck_ranks": INTS + OR_NULL, "lost_hosts": TEXTS + OR_NULL,
    "replace": TEXTS + OR_NULL,
    **{name: OBJECT + OR_NULL for name in ("healed", "timeline", "jit_snapshot", "mirror_broken",
                                           "nccl_net",
                                           "stopped_mid_step", "slurm", "slow_nodes")},
}


def _is(kind: str, value: Any) -> bool:
    """Whether ``value`` is of one simple kind."""
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == TEXT:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind in (INTS, TEXTS):
        each = INT if kind == INTS else TEXT
        return isinstance(value, list) and all(_is(each, v) for v in value)
    return isinstance(value, dict)  # OBJECT


def fits(spec: str, value: Any) -> bool:
    """Whether ``value`` fits a field's spec (``"an integer or null"``, ``"an integer|a
    string"``)."""
    if spec.endswith(OR_NULL):
        if value is None:
            return True
        spec = spec[:-len(OR_NULL)]
    return any(_is(kind, value) for kind in spec.split("|"))


def what_is(value: Any) -> str:
    """What a value is, for a warning: its JSON type and a short view of it."""
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             list: "a list",
             dict: "a JSON object", type(None): "null"}
    shown = repr(value)
    shown = shown[:60] + "..." if len(shown) > 60 else shown
    return f"{names.get(type(value), type(value).__name__)} ({shown})"


def problems(record: Any) -> list[str]:
    """What is wrong with one decoded ledger line ([] for a well-typed one): each known field of the
    wrong type."""
    if not isinstance(record, dict):
        return [f"it is {what_is(record)}, not a JSON object"]
    return [f'"{name}" is {what_is(record[name])}, expected {FIELDS[name].replace("|", " or ")}'
            for name in FIELDS if name in record and not fits(FIELDS[name], record[name])]

