"""The reference workload of perf-facts.md: 3 x Linear(1024, 1024), MSE, SGD, batch 64 per rank."""

from __future__ import annotations

import os
from typing import Any

import torch

WIDTH, SAMPLES = 1024, 64 * 2 * 400


def dataset(seed: int = 0) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, WIDTH, generator=generator)
    return torch.utils.data.TensorDataset(x, x.roll(1, dims=1))


def model() -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)))


class BenchTask:
    """The same model, data and optimizer as the raw loop, as an hpc_ddp Task."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        return model()

    def build_dataset(self, cfg: Any) -> torch.utils.data.Dataset:
        return dataset()

    def build_optimizer(self, model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=cfg.train.lr)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


class BigTask(BenchTask):
    """One square Linear whose state with Adam is about HPC_DDP_BENCH_MB megabytes (B4's stop latency)."""

    def __init__(self) -> None:
        megabytes = float(os.environ.get("HPC_DDP_BENCH_MB", "100"))
        self.width = int((megabytes / 3 * 2**20 / 4) ** 0.5)  # parameters, exp_avg, exp_avg_sq

    def build_model(self, cfg: Any) -> torch.nn.Module:
        return torch.nn.Linear(self.width, self.width, bias=False)

    def build_dataset(self, cfg: Any) -> torch.utils.data.Dataset:
        x = torch.randn(256, self.width, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.TensorDataset(x, x)

    def build_optimizer(self, model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=1e-4)


class BigBatchNormTask(BigTask):
    """BigTask's Linear followed by a BatchNorm, whose buffers DDP broadcasts from rank 0 (B13-SPLIT's BatchNorm
    row: the survivors' snapshot of such a model used to be written whole by one survivor)."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(self.width, self.width, bias=False),
                                   torch.nn.BatchNorm1d(self.width))
