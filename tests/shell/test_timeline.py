"""A heal's (and a requeue's) timeline: the pure model as tables, the rank's marks, the batch shell's part, and
one local rehearsal that heals on a spare and is requeued, read back from the ledger and from ``status``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core import timeline as tl
from hpc_ddp.core.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
T = 1_000_000.0  # an epoch instant


@pytest.mark.parametrize("record, beats, seen_end, expected", [
    ({}, [], None, None),  # nothing known
    ({}, [], T + 5, (T + 5, "step end")),  # a killed rank: when srun returned
    ({"end": T + 5}, [], T + 7, (T + 5, "ledger line")),  # a rank wrote the line as it noticed (hung)
    ({"end": T + 9}, [T + 2, T + 3], T + 9.5, (T + 2, "last beat")),  # a lost node: its last beat
    ({"end": None}, [0, "x"], T, (T, "step end")),  # no beat time, no end: not taken for one
])
def test_the_failure_of_a_healed_step_is_its_earliest_sign(record, beats, seen_end, expected) -> None:
    assert tl.heal_failure(record, beats, seen_end) == expected


@pytest.mark.parametrize("previous, expected", [
    (None, None),  # a run's first attempt
    ({"reason": "timeout", "end": T}, (T, "previous end")),
    ({"reason": "preemption", "end": T}, (T, "previous end")),
    ({"reason": "failed", "end": T}, (T, "previous end")),  # a failure requeued under slurm.max_failures
    ({"reason": "finished", "end": T}, None),  # a person ran it again: no requeue
    ({"reason": "cancelled", "end": T}, None),
    ({"reason": "timeout", "end": T, "before_resume": True}, None),  # a person's --resume
    ({"reason": "lost", "end": None}, None),  # the batch host was lost: no end known
])
def test_the_failure_of_a_requeue_is_the_previous_attempts_end(previous, expected) -> None:
    assert tl.requeue_failure(previous) == expected


@pytest.mark.parametrize("shell, previous, in_job, expected", [
    ({"failure": T, "failure_from": "last beat", "detected": T + 31, "launched": T + 40}, {"reason": "failed",
     "end": T + 31}, 1, {"kind": "heal", "failure": T, "failure_from": "last beat", "detected": 31.0,
                         "launched": 40.0, "imported": 45.0, "first_step": 50.0}),
    ({"detected": T + 100, "launched": T + 101}, {"reason": "timeout", "end": T + 10}, 0,
     {"kind": "requeue", "failure": T + 10, "failure_from": "previous end", "detected": 90.0, "launched": 91.0,
      "imported": 35.0, "first_step": 40.0}),  # the ranks' marks come out before the shell's: skew, shown as such
    ({"detected": T, "launched": T}, None, 0, None),  # the run's first attempt: no timeline
    ({}, {"reason": "hung", "end": T + 20}, 2, {"kind": "heal", "failure": T + 20, "failure_from": "previous end",
                                                "imported": 25.0, "first_step": 30.0}),  # a shell that gave none
])
def test_rank_0_composes_seconds_after_the_failure(shell, previous, in_job, expected) -> None:
    assert tl.for_attempt(shell, {"imported": T + 45, "first_step": T + 50}, previous, in_job) == expected


@pytest.mark.parametrize("timeline, wrong", [
    ({"detected": 1.0, "launched": 2.0, "imported": 2.0, "first_step": 9.0}, []),  # equal is in order
    ({"detected": 1.0, "launched": 0.5, "imported": 3.0}, ["launched"]),
    ({"detected": -0.2}, ["detected"]),  # before the failure: the shell's clock behind the failed node's
    ({"restored": 5.0, "compiled": 4.0, "first_step": 4.5}, ["compiled", "first_step"]),
    ({"kind": "heal", "failure": T}, []),
])
def test_phases_out_of_order_are_named(timeline, wrong) -> None:
    assert tl.out_of_order(timeline) == wrong


def test_the_shell_part_round_trips_and_bad_values_are_ignored() -> None:
    text = tl.encode_shell((T, "last beat"), detected=T + 3.14159, launched=None, imported=T)
    assert json.loads(text) == {"failure": T, "failure_from": "last beat", "detected": round(T + 3.14159, 3)}
    assert tl.shell_marks({tl.TIMELINE_VAR: text}) == {"failure": T, "failure_from": "last beat",
                                                       "detected": round(T + 3.14159, 3)}
    for bad in ("", "{", "[1]", '{"detected": "soon", "failure": true}'):
        assert tl.shell_marks({tl.TIMELINE_VAR: bad}) == {}
    assert tl.shell_marks({}) == {}


def test_status_lines_show_each_phase_the_cache_and_skew() -> None:
    timeline = tl.compose((T, "step end"), {"detected": T + 0.5, "launched": T + 4, "started": T + 6, "imported": T + 9,
                                            "group_ready": T + 11, "restored": T + 12, "compiled": T + 40,
                                            "first_step": T + 39}, "heal", {"compile_cache": "hit", "other": 1})
    assert "other" not in timeline and timeline["compile_cache"] == "hit"
    out = tl.lines(timeline, 3)
    assert out[0] == "timeline of attempt #3 (heal), seconds after the failure (step end):"
    assert [line.split()[0] for line in out[1:9]] == list(tl.PHASES)
    assert "40.0 s" in out[7] and "(cache hit)" in out[7]
    assert out[-1].startswith("  WARNING: first_step end(s) before the phase before")
    short = tl.lines(tl.compose((T, "previous end"), {"first_step": T + 2}, "requeue"), 0)
    assert short[0] == "timeline of attempt #0 (requeue), seconds after the previous attempt's end:"  # no failure
    assert short[-1] == "  not timed: detected, launched, started, imported, group_ready, restored"  # compiled: if used
    assert tl.last_timeline([{"timeline": timeline}, {"reason": "finished"}]) == (0, timeline)


def test_a_rank_marks_in_memory_the_first_mark_wins_and_typos_are_refused() -> None:
    from hpc_ddp.rank.metrics import timeline

    timeline.reset()
    try:
        timeline.mark("compiled", T + 7, compile_cache="miss")
        timeline.mark("compiled", T + 9, compile_cache="hit")  # a recompile: the phase had ended already
        timeline.mark("first_step", T + 8)
        with pytest.raises(UsageError, match="unknown phase 'compile'") as err:
            timeline.mark("compile")
        assert "expected started, imported, group_ready, restored, compiled, first_step" in str(err.value)
        with pytest.raises(UsageError, match="unknown fact 'cache'"):
            timeline.mark("compiled", cache="hit")
        field = timeline.ledger_field({tl.TIMELINE_VAR: tl.encode_shell((T, "step end"), detected=T + 1)}, [], 1)
        assert field == {"timeline": {"kind": "heal", "failure": T, "failure_from": "step end", "detected": 1.0,
                                      "compiled": 7.0, "first_step": 8.0, "compile_cache": "miss"}}
        assert timeline.ledger_field({}, [], 0) == {}  # a run's first attempt
    finally:
        timeline.reset()


def test_the_batch_shell_takes_a_lost_nodes_last_beat_for_the_failure(tmp_path: Path) -> None:
    """The supervisor's part (shell_rules.heal_failure_of): the failed line and the lost-rank markers, by the
    step's key; the shell's own view of the step's end when nothing earlier is known."""
    from hpc_ddp.rundir import layout
    from hpc_ddp.rundir.ledger import append_attempt, attempt_tag
    from hpc_ddp.shell.shell_rules import heal_failure_of

    append_attempt(tmp_path, {"job_id": 7, "restart_count": 0, "reason": "failed", "end": T + 40})
    assert heal_failure_of(tmp_path, (7, 0, 0), T + 39) == (T + 39, "step end")
    marker = layout.lost_marker(tmp_path, attempt_tag(7, 0), 3)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"rank": 3, "host": "n2", "last_beat_time": T + 1.5, "time": T + 33}))
    assert heal_failure_of(tmp_path, (7, 0, 0), T + 39) == (T + 1.5, "last beat")
    assert heal_failure_of(tmp_path, (7, 0, 1), None) is None  # another step: nothing of it known


def test_a_rehearsed_heal_and_requeue_time_every_phase_and_status_shows_the_last(tmp_path: Path) -> None:
    """One rehearsal: node 1 is lost after step 13 (a spare takes its place in the job), a preemption at step 30
    requeues it. Both new attempts' lines carry every phase but ``compiled`` (no compile here), in order; status,
    run from another directory, shows the newest (the requeue's) a line per phase."""
    from hpc_ddp.rundir.ledger import read_attempts

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local",
                           "slurm.tasks_per_node=1", "train.max_steps=36", "snapshot.every_steps=10",
                           "train.log_every=5", "train.global_batch_size=64", "slurm.nodes=2", "slurm.spare_nodes=1",
                           f"run_dir={run_dir}", "--fail-at", "13", "--preempt-at", "30"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed, healed, requeued = read_attempts(run_dir)
    assert (failed["reason"], healed["in_job"], requeued["restart_count"]) == ("failed", 1, 1)
    assert "timeline" not in failed
    every = [p for p in tl.PHASES if p != "compiled"]
    for line, kind in ((healed, "heal"), (requeued, "requeue")):
        timeline = line["timeline"]
        assert timeline["kind"] == kind and all(p in timeline for p in every) and "compiled" not in timeline
        assert tl.out_of_order(timeline) == [] and timeline["detected"] >= 0, timeline
    assert healed["timeline"]["failure_from"] == "step end"  # killed: when the launcher saw the step end
    assert requeued["timeline"]["failure"] == healed["end"]  # the stop: the healed attempt's end
    status = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run_dir)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                                "PYTHONPATH": str(ROOT)})
    shown = status.stdout.split("timeline of attempt #2 (requeue), seconds after the previous attempt's end:\n")
    assert len(shown) == 2, status.stdout
    rows = shown[1].splitlines()[:len(every)]
    assert [row.split()[0] for row in rows] == every and all(" s  +" in row for row in rows), status.stdout


def test_a_healed_step_that_wrote_no_line_keeps_the_shells_part() -> None:
    """Its rank 0's marks died with it: the line settle writes has the batch shell's times; a job's first step
    (no heal) adds nothing, whatever the shell passed."""
    from hpc_ddp.shell.shell_rules import shell_timeline

    times = tl.encode_shell((T, "step end"), detected=T + 0.5, launched=T + 6)
    assert shell_timeline(times, 1) == {"timeline": {
        "kind": "heal", "failure": T, "failure_from": "step end", "detected": 0.5, "launched": 6.0}}
    assert shell_timeline(tl.encode_shell(detected=T, launched=T), 0) == {}


def test_a_process_start_is_read_from_proc_in_epoch_seconds() -> None:
    """The timeline's ``started``: /proc/self/stat's start (clock ticks after boot) against how long ago boot was;
    a command with spaces and parentheses in its name does not shift the fields."""
    from hpc_ddp.rank.metrics.timeline import process_start

    fields = ["S"] + ["0"] * 18 + ["12345"] + ["0"] * 10  # field 22 (starttime) is the 20th after the name
    stat = "4242 (python (a b)) " + " ".join(fields)
    now = __import__("time").time()
    assert process_start(stat, since_boot=200.0, ticks=100) == pytest.approx(now - (200.0 - 123.45), abs=0.5)
    assert process_start("garbage") is None
    mine = process_start()
    assert mine is not None and now - 3600 < mine <= now + 0.1
