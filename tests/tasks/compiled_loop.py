"""An own loop that compiles itself, for the compiled-heal cluster test (tests/cluster/test_compile_slurm.py).

The order that compiles: ``DistributedDataParallel(torch.compile(model))``. A tiny MLP, Adam, and each
step's batch made from (seed, step, rank) alone, so an attempt that resumes at any step draws what an
uninterrupted run drew. ``HPC_DDP_TEST_FAULT`` ("kill:RANK:STEP", as for tests.tasks.Faulty) kills a
rank in that step of the first attempt."""

from __future__ import annotations

from typing import Any

import torch

from tests.tasks.faults import inject


def _batch(seed: int, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(size, 16, generator=generator)
    return x, x.sum(1, keepdim=True).sin()


def train(run: Any) -> None:
    """Compile, then wrap; log every step's loss; the kill comes from HPC_DDP_TEST_FAULT."""
    from torch.nn.parallel import DistributedDataParallel

    cfg = run.config.train
    torch.manual_seed(cfg.seed)  # the same initial parameters on every rank
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    model = DistributedDataParallel(torch.compile(net))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    step = run.resume(model=model, optimizer=optimizer)
    while step < cfg.max_steps:
        inject(run.rank, step + 1, run)
        inputs, targets = _batch(cfg.seed, step, run.rank, cfg.batch_size)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        run.log_metrics(step, loss=loss.item())
        if run.boundary(step):
            return
