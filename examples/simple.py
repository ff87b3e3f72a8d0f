"""The DDP tutorial's toy model as a Task: Linear(10, 2), MSE, SGD, on fixed random data."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from hpc_ddp.core.config import RunConfig


class SimpleTask:
    """Everything a task needs, in four methods."""

    samples = 2048

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        return torch.nn.Linear(10, 2)

    def build_dataset(self, cfg: RunConfig) -> Dataset[Any]:
        generator = torch.Generator().manual_seed(1234)  # the same data on every rank and every attempt
        inputs = torch.randn(self.samples, 10, generator=generator)
        return TensorDataset(inputs, torch.randn(self.samples, 2, generator=generator))

    def build_optimizer(self, model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=cfg.train.lr)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets)
