"""Tasks for fault injection in tests (imported by worker processes as tests.tasks)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.mlp import MLPTask
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


class Faulty(MLPTask):
    """examples.mlp with a fault from HPC_DDP_TEST_FAULT="KIND:RANK:STEP" (KIND raise, kill, sleep or stop).

    The fault hits the given rank in the loss of its STEP-th training step of the first
    attempt (SLURM_RESTART_COUNT=0, the job's first step) only, so a requeued or healed attempt runs clean. "slow:-1:S"
    makes every step of every rank take S seconds longer (the numbers do not change).
    """

    def __init__(self) -> None:
        self.steps = 0
        kind, rank, step = (os.environ.get("HPC_DDP_TEST_FAULT") or "none:-1:-1").split(":")
        self.kind, self.rank, self.step = kind, int(rank), float(step)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if self.kind == "slow":
            time.sleep(float(self.step))
        if model.training:  # not the trainer's eval-mode warm-up pass
            self.steps += 1
            first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0" and not os.environ.get("HPC_DDP_IN_JOB_RESTART")
            if (dist.get_rank(), self.steps) == (self.rank, self.step) and first:
                if self.kind == "raise":
                    raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
                if self.kind in ("kill", "stop") and os.environ.get("HPC_DDP_TEST_FAULT_STAMP"):
                    Path(os.environ["HPC_DDP_TEST_FAULT_STAMP"]).write_text(repr(time.time()))  # for B10
                if self.kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.kind == "sleep":
                    time.sleep(3600)  # a rank that stops making progress outside any collective
                if self.kind == "stop":  # a frozen node as seen from outside: every thread stops, no socket closes
                    os.kill(os.getpid(), signal.SIGSTOP)
        return super().loss(model, batch)


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
