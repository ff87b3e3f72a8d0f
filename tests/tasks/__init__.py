"""Tasks for fault injection in tests (imported by worker processes as tests.tasks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from examples.simple import SimpleTask


class FailOnRank2AtStep5(SimpleTask):
    """Raises inside the loss on rank 2 at its 5th step; the other ranks are then stuck in a collective."""

    def __init__(self) -> None:
        self.calls = 0

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 2 and self.calls == 5:
            raise RuntimeError("injected failure on rank 2 at step 5")
        return super().loss(model, batch)


class NoLoss:
    """Missing three of the four Task methods."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        return torch.nn.Linear(1, 1)
