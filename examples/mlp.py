"""An MLP regression on synthetic data: fast, deterministic, used by tests and benchmarks."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from hpc_ddp.core.config import RunConfig


class SyntheticRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """y = sin(x @ w) + noise, every sample a pure function of its index (cheap in DataLoader workers)."""

    def __init__(self, samples: int, features: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(samples, features, generator=generator)
        weights = torch.randn(features, 1, generator=generator) / features**0.5  # sin of a unit-variance input
        noise = 0.05 * torch.randn(samples, 1, generator=generator)
        self.targets = torch.sin(self.inputs @ weights) + noise

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


class MLPTask:
    features, hidden, samples = 32, 64, 4096

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(self.features, self.hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(self.hidden, self.hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(self.hidden, 1))

    def build_dataset(self, cfg: RunConfig) -> Dataset[Any]:
        return SyntheticRegression(self.samples, self.features, seed=7)

    def build_optimizer(self, model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> Any:
        total = cfg.train.max_steps or 1000
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.1, 1 - step / total))

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets)
