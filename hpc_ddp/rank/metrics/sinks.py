"""Where rank 0's metrics go besides metrics.jsonl: TensorBoard and Weights & Biases, one run across
requeues.

A run that is stopped and requeued five times is still one run to the person watching it, and every
sink follows the rule of :mod:`hpc_ddp.rundir.metrics_file`: **a resumed attempt's values replace
the steps it replays** (an attempt that crashed after its last snapshot logged steps the next one
logs again).

- **TensorBoard** (``metrics.tensorboard=true``, extra ``hpc_ddp[tensorboard]``): event files
  under ``RUN_DIR/tensorboard``. Each attempt opens its writer with ``purge_step`` = the first
  step it will log, so TensorBoard's reader drops what an earlier attempt logged from there on:
  one value per step, the newest attempt's, one continuous curve.
- **Weights & Biases** (``metrics.wandb=true``, extra ``hpc_ddp[wandb]``): the W&B run id is kept
  in ``RUN_DIR/wandb_id.txt``; an attempt that will replay steps W&B holds rewinds that run to its
  snapshot's step (``wandb.init(resume_from="ID?_step=N")``), any other attempt resumes it
  (``resume="allow"``); see :class:`WandbSink`, and where W&B cannot rewind.
  ``metrics.wandb_mode=offline`` writes one ``RUN_DIR/wandb/offline-run-*`` per attempt with no
  network (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later, in order, as the one run).

Both also get the attempt boundaries (an ``attempt`` scalar at each attempt's first step). The
extras are checked at submit (:func:`missing_extras`, no import) and when the sink opens.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from hpc_ddp.rank.stop.shield import stop_signals_blocked
from hpc_ddp.rundir import layout
from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.core.extras import require_extras
from hpc_ddp.core.errors import UsageError, a_type, explain

if TYPE_CHECKING:
    from hpc_ddp.core.config import RunConfig

log = logging.getLogger("hpc_ddp.tracking")


class Sink(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, stopped: bool) -> None: ...


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))
            and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars under ``train/``; ``purge_step`` hides an earlier attempt's steps from ``first_step``
    on."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(layout.tensorboard(run_dir)), purge_step=first_step)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in _numbers(values).items():
            self.writer.add_scalar(key if "/" in key else f"train/{key}", value, step)
        # once per logged step: a watcher sees it now, and a crash loses none of it
        self.writer.flush()

    def close(self, stopped: bool) -> None:
        # flushes: a stopped attempt's last steps are on disk before the requeue
        self.writer.close()


class WandbSink:
    """One W&B run per hpc_ddp run: the id is made once and kept in the run dir; a resumed attempt's
    values replace the steps it replays, by W&B's own rewind
    (``wandb.init(resume_from="ID?_step=N")``).

    ``RUN_DIR/wandb/hpc_ddp_last_step.txt`` holds the highest step this run dir has sent to W&B
    (rewritten on every logged step above it). An attempt that resumed from step N while that file
    says more (a crash after the last snapshot: it will log those steps again) rewinds the W&B run
    to N; otherwise it resumes it (``resume="allow"``), so a requeue after a clean stop archives
    nothing. The file is never set back: a rewind that an attempt killed early did not record is
    asked for again by the next one (rewinding to a step W&B already ends at changes nothing).
    Online, wandb asks the server to rewind at ``init``; rewind is a W&B server feature in preview,
    and a server that refuses it (or a run the server does not hold) is answered by resuming
    instead, with a warning: there, the replayed steps keep their first value. Offline, each attempt
    is its own ``offline-run-*`` fragment and a rewinding one holds the branch point in its run
    record (wandb 0.31); ``wandb sync`` uploads the fragments in start order and asks the server to
    rewind before it uploads that fragment (wandb-core's ``runupserter.InitRun``). hpc_ddp's own
    markers (``hpc_ddp/*``, such as each attempt's ``hpc_ddp/attempt``) logged at a step W&B already
    holds move to the next step that is sent, so every attempt's boundary still shows.
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
        self.step_file = run_dir / "wandb" / "hpc_ddp_last_step.txt"
        # mode=disabled makes no wandb/ of its own
        self.step_file.parent.mkdir(parents=True, exist_ok=True)
        # the highest step sent to W&B so far (-1: none, or unreadable)
        sent = _read_step(self.step_file)
        # quiet is a setting, not an argument of finish(): wandb 0.31 dropped finish(quiet=...)
        args = dict(id=run_id, project=project or name, name=name, dir=str(run_dir), mode=mode,
                    config=dict(config),
                    settings=wandb.Settings(quiet=True))
        # W&B's service process starts here: Slurm's stop signals must not end it
        with stop_signals_blocked():
            self.rewound = sent > resumed_from and self._rewind(wandb, args, resumed_from, sent)
            if not self.rewound:
                self.run = wandb.init(resume="allow", **args)
        # W&B takes this attempt's steps above floor: after a rewind, from N + 1; else past what it
        # holds
        self.floor = resumed_from if self.rewound else max(sent, self.run.starting_step - 1)
        self.last = max(sent, self.floor)
        self.held: dict[str, float] = {}

    def _rewind(self, wandb: ModuleType, args: dict[str, Any], step: int, sent: int) -> bool:
        """Open the W&B run rewound to ``step``; False (and a warning) when W&B refuses."""
        try:
            self.run = wandb.init(resume_from=f"{args['id']}?_step={step}", **args)
            return True
        except Exception as err:  # noqa: BLE001 - the server's answer to a preview feature
            log.warning("metrics.wandb: W&B did not rewind run %s to step %d (%s: %s); it is "
                        "resumed instead, and "
                        "steps %d..%d keep the values W&B already has", args["id"], step,
                        type(err).__name__, err,
                        step + 1, sent)
            return False

    def log(self, step: int, values: Mapping[str, float]) -> None:
        numbers = _numbers(values)
        # W&B holds this step already (its marker, or a replay it would not rewind)
        if step <= self.floor:
            self.held.update({k: v for k, v in numbers.items() if k.startswith("hpc_ddp/")})
            return
        self.run.log({**self.held, **numbers}, step=step)
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


def _read_step(path: Path) -> int:
    """The highest step an earlier attempt sent to W&B; -1 when none did (or the file is
    unreadable)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


def _write_step(path: Path, step: int) -> None:
    """Record ``step`` as sent, on every logged step above the last: the next attempt must know
    whether an attempt killed without ``close`` sent steps it will replay. No fsync: a node crash
    loses W&B's unflushed rows too, and a rename never leaves the file half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{step}\n")
    tmp.replace(path)


def open_sinks(cfg: RunConfig, run_dir: Path, first_step: int,
               config: Mapping[str, Any]) -> list[Sink]:
    """The sinks ``cfg.metrics`` switches on (rank 0 only); a missing package is a ConfigError
    naming the extra.

    A sink that fails to open for another reason (no network for W&B online, a full disk) is
    left out with a warning: watching the run is not worth stopping its training.
    """
    require_extras(cfg.metrics)
    makers = {"tensorboard": lambda: TensorBoardSink(run_dir, first_step),
              "wandb": lambda: WandbSink(run_dir, cfg.name, cfg.metrics.wandb_project,
                                         cfg.metrics.wandb_mode,
                                         config, first_step - 1)}
    sinks: list[Sink] = []
    for key, make in makers.items():
        if getattr(cfg.metrics, key):
            try:
                sinks.append(make())
            except Exception as err:  # noqa: BLE001 - any failure of a third-party logger
                log.warning("metrics.%s: could not open it (%s: %s); training goes on without it",
                            key,
                            type(err).__name__, err)
    return sinks


# the run's plan, logged for status's step N/MAX: no curve in TensorBoard or W&B
NOT_SENT = ("max_steps",)


def log_to(sinks: list[Sink], step: int, values: Mapping[str, Any]) -> list[Sink]:
    """Send ``values`` (less :data:`NOT_SENT`; metrics.jsonl keeps them) to every sink; one that
    fails is dropped with a warning (the others go on)."""
    values = {key: value for key, value in values.items() if key not in NOT_SENT}
    kept = []
    for sink in sinks:
        try:
            sink.log(step, values)
            kept.append(sink)
        except Exception as err:  # noqa: BLE001
            log.warning("%s failed at step %d (%s: %s); no more metrics go there in this attempt",
                        type(sink).__name__, step, type(err).__name__, err)
    return kept


def metric_value(key: str, value: Any) -> Any:
    """A value metrics.jsonl can hold: a one-element tensor (0-d: a loss) or a NumPy scalar becomes
    its number.

    Duck-typed (``numel``/``size`` and ``item``), so this module stays importable without torch.
    """
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    size = value.numel() if callable(getattr(value, "numel",
                                             None)) else getattr(value, "size", None)
    if size == 1 and callable(getattr(value, "item", None)):
        return (value.detach() if callable(getattr(value, "detach", None)) else value).item()
    raise UsageError(explain(f"run.log_metrics(..., {key}=...) got {a_type(value)}"
                             + (f" of shape {tuple(value.shape)}" if hasattr(value, "shape")
                                else ""),
                             expected="a number, a string or a one-element tensor",
                             hint=f"log one number per key, e.g. {key}=loss.item() or "
                                  f"{key}=t.mean().item()"),
                     key=key)
