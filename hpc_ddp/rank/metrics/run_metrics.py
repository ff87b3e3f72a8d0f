"""Rank 0's metrics for one attempt: the run dir's metrics.jsonl and the sinks (TensorBoard, W&B).

:meth:`hpc_ddp.Run.log_metrics` is the public call; this is what it does on rank 0, kept apart from
the stop protocol in :mod:`hpc_ddp.rank.loop.run`. The first call of an attempt opens the sinks at
the step the attempt resumed from, so a sink drops what an earlier attempt logged after that
snapshot (replayed steps are logged once, by the attempt that kept them), and marks the attempt's
number at the first step it logs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hpc_ddp.core.atomic import append_line
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.config.diff import flat_values
from hpc_ddp.rank.metrics.sinks import Sink, log_to, metric_value, open_sinks
from hpc_ddp.rundir import layout, metrics_file
from hpc_ddp.rundir.ledger import read_attempts

log = logging.getLogger("hpc_ddp.run")


class MetricsLog:
    """Rank 0's writer of one attempt's metrics: opened lazily by the first :meth:`log`, closed by
    :meth:`close`."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self._sinks: list[Sink] | None = None  # None until the attempt's first line

    def log(self, step: int, values: dict[str, Any], resumed_from: int | None) -> None:
        """Append one line for ``step`` and send it to the sinks (rank 0 only: the caller
        checks)."""
        values = {key: metric_value(key, value) for key, value in values.items()}
        # the attempt's first line
        attempt = len(read_attempts(self.run_dir)) if self._sinks is None else None
        # its first line says where it resumed (readers); a full disk leaves no half line to glue
        # the next to
        append_line(layout.metrics(self.run_dir),
                    metrics_file.line(step, values, resumed_from=resumed_from,
                                                                    attempt=attempt), sync=False)
        sent = values
        if self._sinks is None:
            first = resumed_from or 0
            self._sinks = open_sinks(self.config, self.run_dir, first + 1,
                                     flat_values(self.config))
            # at the attempt's first step it logs, not at its snapshot's step (the attempt before
            # it trained that one)
            sent = {**values, "hpc_ddp/attempt": attempt}
        self._sinks = log_to(self._sinks, step, sent)

    def close(self, stopped: bool) -> None:
        """Flush and close every sink; a sink that fails to close is a warning, never a failed
        attempt."""
        for sink in self._sinks or []:
            try:
                sink.close(stopped)
            # a sink that fails to close must not turn a clean stop into a failure
            except Exception as err:
                log.warning("closing %s failed: %s", type(sink).__name__, err)
        self._sinks = None
