"""Tasks for fault injection in tests (imported by worker processes as tests.tasks)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from examples.mlp import MLPTask
from examples.simple import SimpleTask
from tests.tasks.faults import FaultyLoss


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


class LoaderDataset(MLPTask):
    """A newcomer's mistake (issue 57): build_dataset returns the tutorial's DataLoader, not its dataset."""

    def build_dataset(self, cfg: Any) -> Any:
        return torch.utils.data.DataLoader(super().build_dataset(cfg), batch_size=8)


class Faulty(FaultyLoss, MLPTask):
    """examples.mlp with a fault from HPC_DDP_TEST_FAULT="KIND:RANK:STEP" (:mod:`tests.tasks.faults`: kill, stop,
    raise, sleep or slow) in the loss of that rank's STEP-th training step of the job's first attempt."""


class NoSlurmClient(MLPTask):
    """examples.mlp in tasks that have no Slurm client, like a container started by srun (pyxis/enroot):
    every directory holding scontrol is taken off this process's PATH (the batch shell keeps it)."""

    def __init__(self) -> None:
        os.environ["PATH"] = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                                             if not os.path.exists(os.path.join(d, "scontrol")))


class WideMLP(MLPTask):
    """examples.mlp with a 640-wide hidden layer: its weight and Adam moments (1.6 MB each) are larger than
    slicing.MIN_SPLIT, so a split snapshot cuts them between nodes (the small MLP's tensors all stay whole)."""

    hidden = 640
