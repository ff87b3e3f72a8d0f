"""B16's soak (benchmarks/detection.py): an own loop that stays alive and healthy while it does, in turn, every
slow-but-not-dead thing issue 60 names, for ``HPC_DDP_SOAK_S`` seconds; nobody may be declared lost.

Every :data:`EVERY` steps the next case, the other ranks waiting in a barrier (gloo, ``dist.timeout_s``):

- ``gil``: one rank (a different one each cycle) holds the GIL for 60 s in one C call (libc's sleep through
  ``ctypes.PyDLL``, which keeps it, as a large ``torch.save`` or a compile can): its liveness thread cannot beat;
- ``eval``: rank 0 alone "evaluates" for 45 s (no collective, no boundary), as nanoGPT's rank-0 evaluation;
- ``save``: rank 1 writes a 2 GiB tensor with ``torch.save`` to its node's /tmp and fsyncs it (then removes it);
- ``loader``: the last rank's data loader stalls for 40 s;
- ``cpu``: every core of the last rank's node busy for 45 s (one spinning process a core) while training goes on;
- ``compile``: rank 0 compiles a small model with ``torch.compile`` (inductor: a C++ build), the first call.

Rank 0 logs ``soak case NAME done`` after each (its count is the soak's), and decides when the time is up (a
broadcast, so every rank ends at the same step). ``HPC_DDP_SOAK_SCALE`` shortens every case's seconds (a smoke run).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

SOAK_S_VAR = "HPC_DDP_SOAK_S"
SCALE_VAR = "HPC_DDP_SOAK_SCALE"  # every case's seconds times this (a smoke run: 0.05)
EVERY = 10
CASES = ("gil", "eval", "save", "loader", "cpu", "compile")
log = logging.getLogger("hpc_ddp.soak")


def false_alarms(run: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = run.resume(model=model, optimizer=optimizer)
    deadline = time.time() + float(os.environ.get(SOAK_S_VAR, "1200"))
    spinning: list[subprocess.Popen[bytes]] = []
    spin_until = 0.0
    while True:
        model(torch.randn(16, 64)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if spinning and time.time() > spin_until:
            for p in spinning:
                p.kill()
                p.wait()
            spinning = []
        if step % EVERY == 0:
            case = CASES[(step // EVERY - 1) % len(CASES)]
            cycle = (step // EVERY - 1) // len(CASES)
            if case == "cpu" and run.rank == run.world_size - 1:
                spinning = _spin(os.cpu_count() or 1)
                spin_until = time.time() + 45 * _scale()
            else:
                _do(case, run, cycle)
            dist.barrier()
            if run.is_main:
                log.warning("soak case %s done (cycle %d, step %d)", case, cycle, step)
            over = torch.tensor([1 if run.is_main and time.time() > deadline else 0])
            dist.broadcast(over, 0)
            if over.item():
                for p in spinning:
                    p.kill()
                run.boundary(step)  # the last step's snapshot
                return
        if run.boundary(step):
            return


def _do(case: str, run: Any, cycle: int) -> None:
    if case == "gil" and run.rank == cycle % run.world_size:
        ctypes.PyDLL(None).sleep(max(1, round(60 * _scale())))
    elif case == "eval" and run.is_main:
        time.sleep(45 * _scale())
    elif case == "save" and run.rank == 1 % run.world_size:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "big.pt")
            torch.save(torch.ones(int(2**29 * _scale())), path)  # 2 GiB of float32
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    elif case == "loader" and run.rank == run.world_size - 1:
        time.sleep(40 * _scale())
    elif case == "compile" and run.is_main:
        compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()))
        compiled(torch.randn(4, 32))


def _scale() -> float:
    return float(os.environ.get(SCALE_VAR, "1"))


def _spin(cores: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
