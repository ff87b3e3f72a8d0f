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
  (``resume="allow"``), and steps a stop or a crash lost in W&B are sent again from metrics.jsonl;
  see :mod:`hpc_ddp.rank.metrics.wandb_sink`, and where W&B cannot rewind.
  ``metrics.wandb_mode=offline`` writes one ``RUN_DIR/wandb/offline-run-*`` per attempt with no
  network (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later, in order, as the one run).

Both also get the attempt boundaries (an ``attempt`` scalar at each attempt's first step). The
extras are checked at submit (:func:`missing_extras`, no import) and when the sink opens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpc_ddp.core.extras import require_extras
from hpc_ddp.rank.metrics.wandb_sink import NOT_SENT, WandbSink, numbers
from hpc_ddp.rundir import layout
from hpc_ddp.core.errors import UsageError, a_type, explain

if TYPE_CHECKING:
    from hpc_ddp.core.config import RunConfig

log = logging.getLogger("hpc_ddp.tracking")


class Sink(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, stopped: bool) -> None: ...


class TensorBoardSink:
    """Scalars under ``train/``; ``purge_step`` hides an earlier attempt's steps from ``first_step``
    on."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(layout.tensorboard(run_dir)), purge_step=first_step)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in numbers(values).items():
            self.writer.add_scalar(key if "/" in key else f"train/{key}", value, step)
        # once per logged step: a watcher sees it now, and a crash loses none of it
        self.writer.flush()

    def close(self, stopped: bool) -> None:
        # flushes: a stopped attempt's last steps are on disk before the requeue
        self.writer.close()


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
