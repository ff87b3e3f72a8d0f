"""Hangs that the watchdog must name whatever the timing (imported by worker processes as tests.tasks.hangs)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tests.tasks import Faulty
from tests.tasks.faults import first_attempt


class SlowStart(Faulty):
    """:class:`tests.tasks.Faulty` whose model takes HPC_DDP_TEST_SLOW_START_S seconds to build on every rank of
    the first attempt: a start-up every rank is slow in (torch._dynamo's first import under DDP takes seconds on
    a busy machine), not a hang. Every rank waits there at (step 0, start)."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        if first_attempt():
            time.sleep(float(os.environ.get("HPC_DDP_TEST_SLOW_START_S") or 0))
        return super().build_model(cfg)


def stuck_in_step(run: Any) -> None:
    """An own loop (it beats at its boundaries only) whose rank 1 stops in the middle of step 13 of the first
    attempt: every rank's last beat is step 12's boundary, and only the flight recorder tells them apart."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = run.resume(model=model, optimizer=optimizer)
    while step < 30:
        if step == 12 and run.rank == 1 and first_attempt():
            time.sleep(3600)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if run.boundary(step):
            return
