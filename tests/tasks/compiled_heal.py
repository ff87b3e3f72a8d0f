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

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

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


class FaultyCompiledHeal(CompiledHeal):
    """CompiledHeal with tests.tasks.Faulty's faults from HPC_DDP_TEST_FAULT: "kill:RANK:STEP" SIGKILLs that
    rank in its STEP-th training step of the job's first attempt (stamping the time in
    HPC_DDP_TEST_FAULT_STAMP first, for the benchmark), "slow:-1:S" makes every step S seconds longer."""

    def __init__(self) -> None:
        self.steps = 0
        kind, rank, step = (os.environ.get("HPC_DDP_TEST_FAULT") or "none:-1:-1").split(":")
        self.kind, self.rank, self.step = kind, int(rank), float(step)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        import torch.distributed as dist

        if self.kind == "slow":
            time.sleep(self.step)
        if model.training:  # not the trainer's eval-mode warm-up pass
            self.steps += 1
            first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0" and not os.environ.get("HPC_DDP_IN_JOB_RESTART")
            if self.kind == "kill" and first and (dist.get_rank(), self.steps) == (self.rank, self.step):
                if os.environ.get("HPC_DDP_TEST_FAULT_STAMP"):
                    Path(os.environ["HPC_DDP_TEST_FAULT_STAMP"]).write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)
