"""Own-loop functions for the bad-input tests of ``train.loop`` (fault injection: each misbehaves one way)."""

from __future__ import annotations

import time
from typing import Any

import torch


def _tiny(run: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def ignores_stop(run: Any) -> None:
    """Goes on after run.boundary returned True (as if the loop had no `return` there)."""
    model, optimizer = _tiny(run)
    step = run.resume(model=model, optimizer=optimizer)
    while step < 10_000:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        run.boundary(step)
        time.sleep(0.05)


def no_argument() -> None:
    """train.loop must accept the run."""
