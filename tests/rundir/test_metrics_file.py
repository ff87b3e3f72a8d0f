"""metrics.jsonl read back as the run's history (hpc_ddp.rundir.metrics_file): each step once, the newest attempt's values,
and what an earlier attempt logged past the step a later one resumed from dropped, as TensorBoard's purge_step
and W&B's rewind drop it. Files are written by hand: the reader's only input is the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import metrics_file
from hpc_ddp.rundir.metrics_file import history, line


def lines(*attempts: tuple[int | None, range], marked: bool = False) -> list[str]:
    """Attempt k resumed from its first item (None: from scratch) and logged loss = 100 * k + step at each step."""
    out = []
    for k, (resumed_from, steps) in enumerate(attempts):
        for i, step in enumerate(steps):
            mark: dict[str, Any] = {"resumed_from": resumed_from, "attempt": k} if marked and i == 0 else {}
            out.append(line(step, {"loss": 100.0 * k + step}, now=1000.0 + len(out), **mark))
    return out


def losses(rows: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows}


def test_a_crash_replay_gives_each_step_once_with_the_resumed_attempts_value() -> None:
    for marked in (False, True):  # the writer's marks, or (older files) the steps going down
        got = losses(history(lines((None, range(1, 25)), (20, range(21, 41)), marked=marked)))
        assert got == {**{s: float(s) for s in range(1, 21)}, **{s: 100.0 + s for s in range(21, 41)}}


def test_an_earlier_attempts_steps_past_the_newest_resume_point_are_not_the_runs_any_more() -> None:
    # attempt 0 reached 25 (snapshot 20) and crashed; attempt 1 resumed from 20 and crashed at 22 (status
    # reads the file now): 23-25 belong to a history no attempt continues, as TensorBoard's purge says
    for marked in (False, True):
        got = losses(history(lines((None, range(1, 26)), (20, range(21, 23)), marked=marked)))
        assert got == {**{s: float(s) for s in range(1, 21)}, 21: 121.0, 22: 122.0}, marked


def test_the_mark_says_where_the_attempt_resumed_even_when_its_first_step_is_logged_later() -> None:
    # log_every=10: attempt 0 logged 10, 20, 30 and crashed at 35 (snapshot 25); attempt 1 resumed from 25 and
    # logs 30 again, the step the file ended on: only the mark tells a resume from a second call at step 30
    rows = [line(10, {"loss": 1.0}, resumed_from=None, attempt=0), line(20, {"loss": 0.5}),
            line(30, {"loss": 0.25, "val": 9.0}), line(30, {"loss": 0.2}, resumed_from=25, attempt=1)]
    assert history(rows)[-1] == {"step": 30, "loss": 0.2, "time": json.loads(rows[-1])["time"]}  # no stale val


def test_calls_at_one_step_within_an_attempt_merge_and_a_late_call_in_a_marked_file_is_no_resume() -> None:
    rows = [line(9, {"loss": 1.0}, resumed_from=None, attempt=0), line(10, {"loss": 0.9}), line(10, {"val": 2.0}),
            line(11, {"loss": 0.8}), line(10, {"eval_acc": 0.5})]  # a late eval result for step 10
    got = history(rows)
    assert [(r["step"], r.get("loss"), r.get("val"), r.get("eval_acc")) for r in got] == \
        [(9, 1.0, None, None), (10, 0.9, 2.0, 0.5), (11, 0.8, None, None)]
    assert all("_resumed_from" not in r and "_attempt" not in r for r in got)  # the marks are not metrics


def test_a_line_cut_by_a_crash_and_lines_without_a_step_are_skipped(tmp_path: Path) -> None:
    text = "".join(lines((None, range(1, 4)))) + '{"note": "no step"}\n[1, 2]\n{"step": true}\n{"step": 4, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    assert [r["step"] for r in metrics_file.read(tmp_path)] == [1, 2, 3]
    assert [r["step"] for r in metrics_file.read(tmp_path / "metrics.jsonl")] == [1, 2, 3]  # the file itself too
    assert metrics_file.read(tmp_path / "none") == []


def test_a_line_is_one_json_object_and_only_an_attempts_first_line_carries_the_mark() -> None:
    first, other = line(21, {"loss": 0.5}, resumed_from=20, attempt=3, now=5.0), line(22, {"loss": 0.4}, now=6.0)
    assert json.loads(first) == {"step": 21, "loss": 0.5, "time": 5.0, "_resumed_from": 20, "_attempt": 3}
    assert json.loads(other) == {"step": 22, "loss": 0.4, "time": 6.0} and first.endswith("\n")
    assert json.loads(line(1, {}, resumed_from=None, attempt=0, now=1.0))["_resumed_from"] == 0  # from scratch


def test_a_plain_reader_can_follow_the_rule_from_the_marks_alone() -> None:
    """The recipe docs/submit.md gives for jq or pandas: keep, per step, the last line that no later mark
    (``_resumed_from`` N on a later line) cuts off, i.e. whose step is <= every later mark."""
    raw = lines((None, range(1, 26)), (20, range(21, 23)), (22, range(23, 31)), marked=True)
    records = [json.loads(x) for x in raw]
    kept: dict[int, dict[str, Any]] = {}
    for i, record in enumerate(records):
        later = [r["_resumed_from"] for r in records[i + 1:] if "_resumed_from" in r]
        if all(record["step"] <= mark for mark in later):
            kept[record["step"]] = record
    assert losses(history(raw)) == {s: r["loss"] for s, r in kept.items()}
