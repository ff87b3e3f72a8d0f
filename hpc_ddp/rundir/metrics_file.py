"""metrics.jsonl read back as the run's history: one record per step, the newest attempt's values.

Rank 0 appends one JSON line per ``run.log_metrics`` call (``{"step": 7, "loss": 0.3, ..., "time":
...}``) and never rewrites one, so a crash can cut at most the last line short (a reader skips it).
An attempt that resumes from an older snapshot logs the steps after it again, so the raw file can
hold a step twice. The rule, the same in every sink (TensorBoard's ``purge_step``, W&B's rewind, see
:mod:`hpc_ddp.rank.metrics.sinks`): **a resumed attempt's values replace the steps it replays**, and
what an earlier attempt logged after the step the new one resumed from is no longer the run's
history.

Where an attempt begins, in the file alone (this module reads no other file, so it stays pure):

- a line whose step is lower than the line before it begins an attempt that resumed before that
  step (steps rise within an attempt, as W&B requires too);
- a writer can say exactly where: :func:`line` with ``attempt`` adds ``"_resumed_from": N`` (the
  snapshot step, 0 for none) and ``"_attempt": K`` (its number in the ledger) to an attempt's first
  line. Such a line drops what earlier lines logged for steps after N, even for steps the new
  attempt has not logged yet, and from the first such line on, a lower step is a late log call, not
  a resume. They are keys of a normal metrics line, so a reader that wants only ``step`` and
  ``loss`` need not know them, and ``jq 'select(._resumed_from != null)'`` lists the boundaries.

Lines of one step within an attempt (a loss and, in a second call, an eval metric) merge into one
record, later keys winning. Used by ``python -m hpc_ddp.status`` (and ``--plot``), the tests and the
benchmarks; no torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout

# on an attempt's first line: the snapshot step it resumed from (0: from scratch)
RESUMED_FROM = "_resumed_from"
ATTEMPT = "_attempt"  # on the same line: the attempt's number in the ledger, as status numbers it
MARKS = (RESUMED_FROM, ATTEMPT)


def line(step: int, values: Mapping[str, Any], *, resumed_from: int | None = None,
         attempt: int | None = None, now: float | None = None) -> str:
    """One metrics.jsonl line (with its newline). Pass ``resumed_from`` (None: from scratch, written
    0) and ``attempt`` on the first line an attempt writes, so readers can drop what it replaces."""
    mark = {} if attempt is None else {RESUMED_FROM: resumed_from or 0, ATTEMPT: attempt}
    stamp = round(time.time() if now is None else now, 3)  # time: status's ETA and time used
    return json.dumps({"step": step, **values, "time": stamp, **mark}) + "\n"


def entries(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The whole lines of metrics.jsonl as dicts with an int ``step``, in file order (a line cut
    short by a crash, or one that is not a metrics line, is skipped)."""
    out = []
    for text in lines:
        try:
            entry = json.loads(text)
        except ValueError:
            continue
        if isinstance(entry, dict) and _is_int(entry.get("step")):
            out.append(entry)
    return out


def resumes(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(index, resumed_from)`` for every entry that begins a resumed attempt (see the module's
    rule).

    Steps going down mark a boundary only before the first marked line: once the writer marks
    attempts, a lower step within one is a late log call, not a resume."""
    marked = [(i, e[RESUMED_FROM]) for i, e in enumerate(rows) if _is_int(e.get(RESUMED_FROM))]
    first_marked = marked[0][0] if marked else len(rows)
    inferred = [(i, rows[i]["step"] - 1) for i in range(1, first_marked)
                if rows[i]["step"] < rows[i - 1]["step"]]
    return inferred + marked


def history(lines: Iterable[str]) -> list[dict[str, Any]]:
    """One record per step in step order, each with the values of the newest attempt that logged
    it."""
    rows = entries(lines)
    cuts = dict(resumes(rows))
    by_step: dict[int, dict[str, Any]] = {}
    for i, entry in enumerate(rows):
        # an attempt begins: what earlier ones logged after its snapshot is not the run's any more
        if i in cuts:
            by_step = {step: record for step, record in by_step.items() if step <= cuts[i]}
        values = {key: value for key, value in entry.items() if key not in MARKS}
        by_step[entry["step"]] = {**by_step.get(entry["step"], {}), **values}
    return [by_step[step] for step in sorted(by_step)]


def attempt_marks(lines: Iterable[str]) -> dict[int, int]:
    """``{step: attempt}``: where each attempt of the run's history began (its first line's step and
    its number), by the writer's marks, dropping those a later attempt replaced as :func:`history`
    drops their values."""
    rows = entries(lines)
    cuts = dict(resumes(rows))
    marks: dict[int, int] = {}
    for i, entry in enumerate(rows):
        if i in cuts:
            marks = {step: number for step, number in marks.items() if step <= cuts[i]}
        if _is_int(entry.get(ATTEMPT)):
            marks[entry["step"]] = entry[ATTEMPT]
    return marks


def attempt_starts(lines: Iterable[str]) -> dict[int, int]:
    """``{attempt: resumed_from}`` by the writer's marks on each attempt's first line, replaced or
    not: where an attempt began, for a ledger line its ranks did not write (a lost node's attempt,
    recorded by the batch shell or the launcher, says only where it ended)."""
    return {e[ATTEMPT]: e[RESUMED_FROM] for e in entries(lines)
            if _is_int(e.get(ATTEMPT)) and _is_int(e.get(RESUMED_FROM))}


def lines_of(run_dir: Path | str) -> list[str]:
    """The lines of ``RUN_DIR/metrics.jsonl`` (or of the file itself, when given), none when there
    is none yet."""
    path = Path(run_dir)
    if path.is_dir() or not path.name.endswith(".jsonl"):
        path = layout.metrics(path)
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def read(run_dir: Path | str) -> list[dict[str, Any]]:
    """:func:`history` of ``RUN_DIR/metrics.jsonl`` (empty when there is none yet). The file itself
    is taken too: a newcomer who passed ``RUN_DIR/metrics.jsonl`` got an empty list, as if nothing
    had been logged."""
    return history(lines_of(run_dir))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
