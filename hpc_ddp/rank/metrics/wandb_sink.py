"""The W&B sink: one W&B run per hpc_ddp run, which catches up from metrics.jsonl.

W&B is a copy of ``metrics.jsonl`` that can lose rows: Slurm signals every process of a step, W&B's
service process (``wandb-core``) too, and on SIGTERM (a ``scancel``, a preemption, the time limit's
last signal) it shuts down without writing what it had not written yet (offline, measured: the
whole of a short attempt's rows, its run file left at its 7-byte header). A kill loses the same.
So this sink trusts only what an attempt confirmed: the highest step of an attempt whose
``finish()`` returned is kept in ``RUN_DIR/wandb/hpc_ddp_kept_step.txt``, and the next attempt
sends again, from metrics.jsonl, every step after it up to its own snapshot's step, after rewinding
the run to the kept step where rows past it may exist. ``metrics.jsonl`` is written before the sinks
and fsync-free but never rewritten (:mod:`hpc_ddp.rundir.metrics_file`), so it holds every step a
stop or a crash lost in W&B.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rank.stop.shield import stop_signals_blocked
from hpc_ddp.rundir import layout, metrics_file

log = logging.getLogger("hpc_ddp.tracking")

# a metrics.jsonl record's keys that were never a logged value
NOT_VALUES = ("step", "time")
# the run's plan, logged for status's step N/MAX: no curve in TensorBoard or W&B (sinks.log_to)
NOT_SENT = ("max_steps",)


def numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The values a sink can plot: numbers, not flags or text."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))
            and not isinstance(v, bool)}


class WandbSink:
    """One W&B run per hpc_ddp run: the id is made once and kept in the run dir; a resumed attempt's
    values replace the steps it replays, by W&B's own rewind
    (``wandb.init(resume_from="ID?_step=N")``), and steps W&B lost are sent again.

    Two files in ``RUN_DIR/wandb/``: ``hpc_ddp_last_step.txt``, the highest step any attempt sent
    (rewritten on every logged step above it), and ``hpc_ddp_kept_step.txt``, the highest step W&B
    surely holds (written when an attempt's ``finish()`` returned; set back by a rewind). An attempt
    that resumed from step N takes ``held = min(kept, N)``: W&B holds steps up to ``held`` with the
    values this attempt goes on from. Where more may have been sent (``last > held``: a crash after
    the snapshot, or an attempt whose W&B rows a stop lost) it rewinds the run to ``held``;
    otherwise it resumes it (``resume="allow"``), so a requeue after a clean stop archives nothing.
    Then it sends steps ``held + 1 .. N`` again from metrics.jsonl (none after a clean stop).
    Online, wandb asks the server to rewind at ``init``; rewind is a W&B server feature in preview,
    and a server that refuses it (or a run the server does not hold) is answered by resuming
    instead, with a warning: there, the steps up to the last one sent keep what W&B has. Offline,
    each attempt is its own ``offline-run-*`` fragment and a rewinding one holds the branch point
    in its run record (wandb 0.31); ``wandb sync`` uploads the fragments in start order and asks the
    server to rewind before it uploads that fragment (wandb-core's ``runupserter.InitRun``).
    hpc_ddp's own markers (``hpc_ddp/*``, such as each attempt's ``hpc_ddp/attempt``) logged at a
    step W&B already holds move to the next step that is sent, so every attempt's boundary shows.
    A run dir from before the kept file: what was sent counts as kept, as it did then.
    """

    def __init__(self, run_dir: Path, name: str, project: str, mode: str, config: Mapping[str, Any],
                 resumed_from: int = 0) -> None:
        import wandb

        id_file = layout.wandb_id(run_dir)
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            # W&B ids: up to 64 of [a-z0-9]; made once, kept for every attempt
            run_id = secrets.token_hex(4)
            write_atomic(id_file, run_id + "\n")
        folder = run_dir / "wandb"
        self.step_file = folder / "hpc_ddp_last_step.txt"
        self.kept_file = folder / "hpc_ddp_kept_step.txt"
        # mode=disabled makes no wandb/ of its own
        folder.mkdir(parents=True, exist_ok=True)
        # the highest step sent to W&B so far (-1: none, or unreadable)
        sent = _read_step(self.step_file)
        held = min(_read_step(self.kept_file, absent=sent), resumed_from)
        # quiet is a setting, not an argument of finish(): wandb 0.31 dropped finish(quiet=...)
        args = dict(id=run_id, project=project or name, name=name, dir=str(run_dir), mode=mode,
                    config=dict(config),
                    settings=wandb.Settings(quiet=True))
        # W&B's service process starts here: Slurm's warning signal must not end it
        with stop_signals_blocked():
            self.rewound = sent > held and self._rewind(wandb, args, max(held, 0), sent)
            if not self.rewound:
                self.run = wandb.init(resume="allow", **args)
        # W&B takes this attempt's steps above floor: after a rewind, from held + 1; else past what
        # it may hold
        self.floor = max(held, 0) if self.rewound else max(sent, self.run.starting_step - 1)
        _write_step(self.kept_file, held)
        self.last = max(sent, self.floor)
        self.held: dict[str, float] = {}
        self._send_again(run_dir, resumed_from)

    def _rewind(self, wandb: ModuleType, args: dict[str, Any], step: int, sent: int) -> bool:
        """Open the W&B run rewound to ``step``; False (and a warning) when W&B refuses."""
        try:
            self.run = wandb.init(resume_from=f"{args['id']}?_step={step}", **args)
            return True
        except Exception as err:  # noqa: BLE001 - the server's answer to a preview feature
            log.warning("metrics.wandb: W&B did not rewind run %s to step %d (%s: %s); it is "
                        "resumed instead, and steps %d..%d keep the values W&B already has (or "
                        "lack, where a stop lost them)", args["id"], step, type(err).__name__, err,
                        step + 1, sent)
            return False

    def _send_again(self, run_dir: Path, resumed_from: int) -> None:
        """Send the steps after ``floor`` up to the snapshot's, as metrics.jsonl holds them: what an
        earlier attempt sent and W&B lost (or the rewind dropped)."""
        lines = metrics_file.lines_of(run_dir)
        marks = metrics_file.attempt_marks(lines)
        lost = [r for r in metrics_file.history(lines) if self.floor < r["step"] <= resumed_from]
        for record in lost:
            mark = {"hpc_ddp/attempt": marks[record["step"]]} if record["step"] in marks else {}
            self.log(record["step"],
                     {**{k: v for k, v in record.items() if k not in (*NOT_VALUES, *NOT_SENT)},
                      **mark})
        if lost:
            log.info("metrics.wandb: steps %d..%d sent again from metrics.jsonl (an earlier "
                     "attempt's W&B rows were not kept)", lost[0]["step"], lost[-1]["step"])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        sendable = numbers(values)
        # W&B holds this step already (its marker, or a replay it would not rewind)
        if step <= self.floor:
            self.held.update({k: v for k, v in sendable.items() if k.startswith("hpc_ddp/")})
            return
        self.run.log({**self.held, **sendable}, step=step)
        self.held = {}
        if step > self.last:
            self.last = step
            _write_step(self.step_file, step)

    def close(self, stopped: bool) -> None:
        if stopped:
            # the W&B UI shows "preempted" until the requeued attempt resumes it
            self.run.mark_preempting()
        # writes the attempt's last rows: an attempt that never finishes leaves its file empty
        self.run.finish()
        # finish returned: W&B holds every step this attempt sent
        _write_step(self.kept_file, self.last)


def _read_step(path: Path, absent: int = -1) -> int:
    """The step a file of this sink holds; ``absent`` when there is no file, -1 when it cannot be
    read."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return absent
    except (OSError, ValueError):
        return -1


def _write_step(path: Path, step: int) -> None:
    """Record ``step`` (sent, on every logged step above the last; or kept): the next attempt must
    know whether an attempt killed without ``close`` sent steps it will replay. No fsync: a node
    crash loses W&B's unflushed rows too, and a rename never leaves the file half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{step}\n")
    tmp.replace(path)
