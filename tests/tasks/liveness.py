"""An own loop for the liveness tests: rank 0 alone "evaluates" for longer than dist.liveness_s while the others
wait for it in a barrier, as nanoGPT's rank-0 evaluation does. Slow is not dead: nobody may be declared lost."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

EVAL_S_VAR = "HPC_DDP_TEST_EVAL_S"  # how long rank 0's evaluation takes
EVAL_AT = 3  # after this step


def rank0_evaluates(run: Any) -> None:
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
            if run.is_main:
                time.sleep(float(os.environ[EVAL_S_VAR]))  # the evaluation: no collective, no boundary, no beat
            dist.barrier()  # the others wait here meanwhile
        if run.boundary(step):
            return
