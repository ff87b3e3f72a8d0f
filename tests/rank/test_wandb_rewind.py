"""When the W&B sink rewinds (an attempt will replay steps W&B holds), when it only resumes, and what it does when
the server refuses a rewind (a preview feature): resume instead, say so, and keep W&B's values for the replayed
steps. A stand-in for the wandb module records the calls; tests/rank/test_metrics_sinks.py runs the real one offline."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.rank.metrics.sinks import WandbSink


class FakeRun:
    def __init__(self, starting_step: int) -> None:
        self.starting_step, self.rows = starting_step, []

    def log(self, values: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(values)))

    def mark_preempting(self) -> None:
        pass

    def finish(self) -> None:
        pass


def fake_wandb(monkeypatch: pytest.MonkeyPatch, refuse_rewind: bool = False, server_last: int = -1) -> list[dict]:
    """Install a wandb stand-in; returns the list its init calls are recorded in."""
    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> FakeRun:
        calls.append(kwargs)
        if "resume_from" in kwargs:
            if refuse_rewind:
                raise RuntimeError("failed to rewind run: rewind is not enabled for this entity")
            return FakeRun(int(kwargs["resume_from"].split("?_step=")[1]) + 1)
        return FakeRun(server_last + 1)

    module = types.ModuleType("wandb")
    module.init, module.Settings = init, lambda **kwargs: kwargs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def sink(run_dir: Path, resumed_from: int, sent: int | None = None) -> WandbSink:
    (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
    (run_dir / "wandb_id.txt").write_text("abc123\n")
    if sent is not None:
        (run_dir / "wandb" / "hpc_ddp_last_step.txt").write_text(f"{sent}\n")
    return WandbSink(run_dir, "n", "p", "online", {}, resumed_from)


@pytest.mark.parametrize("sent,resumed_from,rewind", [
    (None, 0, False),  # the first attempt: nothing sent yet
    (24, 20, True),  # a crash after the snapshot at 20: steps 21-24 will be logged again
    (28, 28, False),  # a stop snapshot at the last step sent: nothing to replay, only resume
    (20, 25, False),  # log_every 10, a snapshot at 25: W&B holds nothing above the resume point
])
def test_the_sink_rewinds_only_when_the_attempt_will_replay_steps_w_and_b_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sent: int | None, resumed_from: int, rewind: bool) -> None:
    calls = fake_wandb(monkeypatch)
    opened = sink(tmp_path, resumed_from, sent)
    assert opened.rewound is rewind
    assert [(c.get("resume_from"), c.get("resume")) for c in calls] == \
        [(f"abc123?_step={resumed_from}", None) if rewind else (None, "allow")]


def test_after_a_rewind_the_replayed_steps_are_sent_and_the_marker_moves_to_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_wandb(monkeypatch)
    opened = sink(tmp_path, 20, sent=24)
    opened.log(20, {"hpc_ddp/attempt": 1})  # the attempt's marker at the step it resumed from
    for step in range(21, 27):
        opened.log(step, {"loss": float(step)})
    assert [s for s, _ in opened.run.rows] == list(range(21, 27))
    assert opened.run.rows[0][1] == {"hpc_ddp/attempt": 1.0, "loss": 21.0}
    assert (tmp_path / "wandb" / "hpc_ddp_last_step.txt").read_text() == "26\n"


def test_a_refused_rewind_resumes_says_so_and_keeps_w_and_bs_values_for_the_replayed_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    calls = fake_wandb(monkeypatch, refuse_rewind=True, server_last=24)
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.tracking"):
        opened = sink(tmp_path, 20, sent=24)
    assert not opened.rewound and [c.get("resume") for c in calls] == [None, "allow"]
    assert "W&B did not rewind run abc123 to step 20" in caplog.text and "steps 21..24 keep the values" in caplog.text
    opened.log(20, {"hpc_ddp/attempt": 1})
    for step in range(21, 27):
        opened.log(step, {"loss": float(step)})
    assert [s for s, _ in opened.run.rows] == [25, 26]  # W&B would renumber steps it holds: not sent
    assert opened.run.rows[0][1] == {"hpc_ddp/attempt": 1.0, "loss": 25.0}


def test_steps_a_stop_lost_in_w_and_b_are_sent_again_from_metrics_jsonl_after_a_rewind_to_what_it_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 0 sent steps 1-8 and was stopped at 9 by a SIGTERM that ended W&B's service before it wrote them
    (it never finished: nothing kept). Attempt 1 resumes from 9: it rewinds to step 0 and sends 1-9 again, with
    attempt 0's marker at its first step, before its own steps."""
    from hpc_ddp.rundir import metrics_file

    calls = fake_wandb(monkeypatch)
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "hpc_ddp_kept_step.txt").write_text("-1\n")  # attempt 0's open wrote it
    lines = [metrics_file.line(1, {"loss": 1.0}, resumed_from=None, attempt=0)]
    lines += [metrics_file.line(step, {"loss": float(step), "max_steps": 20}) for step in range(2, 10)]
    lines += [metrics_file.line(10, {"loss": 10.0}, resumed_from=9, attempt=1)]  # attempt 1's first line
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    opened = sink(tmp_path, 9, sent=8)
    assert opened.rewound and [c.get("resume_from") for c in calls] == ["abc123?_step=0"]
    opened.log(10, {"loss": 10.0, "hpc_ddp/attempt": 1})
    assert [s for s, _ in opened.run.rows] == list(range(1, 11))
    assert opened.run.rows[0][1] == {"loss": 1.0, "hpc_ddp/attempt": 0.0}
    # no time, no step, no max_steps (the plan, not a curve)
    assert [v for _, v in opened.run.rows[1:9]] == [{"loss": float(s)} for s in range(2, 10)]
    assert (tmp_path / "wandb" / "hpc_ddp_kept_step.txt").read_text() == "-1\n"
    opened.close(stopped=False)
    assert (tmp_path / "wandb" / "hpc_ddp_kept_step.txt").read_text() == "10\n"  # finish returned: all kept


def test_a_crashed_attempt_after_a_finished_one_rewinds_to_the_kept_step_not_to_what_it_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_wandb(monkeypatch)
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "hpc_ddp_kept_step.txt").write_text("20\n")  # attempt 0 stopped at 20, finished
    opened = sink(tmp_path, 20, sent=26)  # attempt 1 sent 21-26, then its node died (no finish)
    assert opened.rewound and [c.get("resume_from") for c in calls] == ["abc123?_step=20"]
    assert opened.run.rows == []  # nothing at or below the snapshot to send again
