"""The workload of a compiled heal (a sketch for benchmark B10-REAL and the compiled-heal cluster test).

What makes a real heal slow, in one small task: a compiled model (``train.compile=true``: the cold
compile is what a heal pays without a warm cache), DataLoader workers (``train.num_workers=2``: their
start is part of a new attempt), and a state of more than 100 MB (three 2048 x 2048 layers, 12.6 M
parameters, 50 MB, plus Adam's two moments: 151 MB to snapshot, spread and load). The data is made
in ``__getitem__`` from the index alone, so workers need no RNG and any attempt resumes bit for bit.

    python -m hpc_ddp.submit examples/mlp.yaml --local train.task=tests.tasks.compiled_heal:CompiledHeal \
        train.compile=true train.num_workers=2 train.max_steps=40 train.batch_size=8 --fail-at 20

Not run by the test suite (a cold compile of it takes about a minute on 2 cores): benchmark B10-REAL
(benchmarks/healing_real.py) runs :class:`FaultyCompiledHeal` on the local cluster.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from tests.tasks.faults import FaultyLoss

WIDTH = 2048
LAYERS = 3


class IndexedData(Dataset[Any]):
    """Input and target of sample i from i alone: the same on every rank, in every worker and attempt."""

    def __init__(self, samples: int = 4096) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(WIDTH, generator=generator), torch.randn(1, generator=generator)


class CompiledHeal:
    """A Task: a wide MLP (151 MB with Adam's moments), MSE, Adam; compile it with train.compile=true."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        layers: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))

    def build_dataset(self, cfg: Any) -> Dataset[Any]:
        return IndexedData()

    def build_optimizer(self, model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=cfg.train.lr)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(model(inputs), targets)


class FaultyCompiledHeal(FaultyLoss, CompiledHeal):
    """CompiledHeal with the faults of :mod:`tests.tasks.faults` (HPC_DDP_TEST_FAULT): "kill:RANK:STEP" SIGKILLs
    that rank in its STEP-th training step of the job's first attempt (stamping the time in
    HPC_DDP_TEST_FAULT_STAMP first, for the benchmark), "slow:-1:S" makes every step S seconds longer."""
