"""Own loops for the liveness tests, each doing something odd after step EVAL_AT while the other ranks wait in a
barrier: rank 0 alone "evaluates" for longer than dist.liveness_s, as nanoGPT's rank-0 evaluation does (slow is
not dead: nobody may be declared lost); a rank stops itself (SIGSTOP: a frozen rank); rank 0 holds the GIL in one
C call (nobody may be declared lost)."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

EVAL_S_VAR = "HPC_DDP_TEST_EVAL_S"  # how long rank 0's evaluation takes
EVAL_AT = 3  # after this step


def rank0_evaluates(run: Any) -> None:
    def evaluate() -> None:
        if run.is_main:
            time.sleep(float(os.environ[EVAL_S_VAR]))  # the evaluation: no collective, no boundary, no beat
    _steps(run, evaluate)  # the others wait for it in a barrier


STOP_RANK_VAR = "HPC_DDP_TEST_STOP_RANK"  # this rank stops itself (SIGSTOP) after step EVAL_AT
# rank 0 holds the GIL this long in one C call after step EVAL_AT
HOLD_S_VAR = "HPC_DDP_TEST_HOLD_S"


def _steps(run: Any, at_eval: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = run.resume(model=model, optimizer=optimizer)
    while step < run.config.train.max_steps:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == EVAL_AT:
            at_eval()
            dist.barrier()
        if run.boundary(step):
            return


def a_rank_stops(run: Any) -> None:
    """A frozen rank: SIGSTOP to itself (every thread of it, its liveness thread too)."""
    def stop() -> None:
        if run.rank == int(os.environ[STOP_RANK_VAR]):
            os.kill(os.getpid(), signal.SIGSTOP)
    _steps(run, stop)


def rank0_holds_the_gil(run: Any) -> None:
    """Rank 0 in one C call that never lets go of the GIL (libc's sleep through ctypes.PyDLL, which
    keeps it), as a large torch.save or a compile can: its liveness thread cannot beat meanwhile."""
    def hold() -> None:
        if run.is_main:
            ctypes.PyDLL(None).sleep(int(os.environ[HOLD_S_VAR]))
    _steps(run, hold)
