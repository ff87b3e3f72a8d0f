"""The health check's memory test (issue 60, ``slurm.health`` on GPUs): a share of the device's
memory written with the classic patterns and read back, so that a GPU whose memory returns wrong
bytes, or is far slower than its peers', is named before training trusts it with a run.

It is no replacement for the vendor's (``dcgmi diag -r 3``, minutes, run by the site between jobs):
it takes a fraction of a second, touches one block of memory that the allocator hands out, and
catches what a prologue missed: a part that went bad since, or a node whose device is throttled.
Apart from :mod:`hpc_ddp.rank.attempt.health`, which calls it on CUDA devices only (on a CPU rank
the host's memory is not the accelerator's, and its speed on a shared machine says nothing)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger("hpc_ddp.health")
SIZES = {"quick": 256 << 20, "full": 1 << 30}
# every bit 0 and 1, and each next to its opposite
PATTERNS = (0x55, 0xAA, 0x00, 0xFF)


def memory_test(device: torch.device, size: int,
                write: Callable[[torch.Tensor, int], object] = torch.Tensor.fill_,
                clock: Callable[[], float] = time.perf_counter) -> tuple[float, int]:
    """MB/s of writing ``size`` bytes of ``device`` memory with each pattern and reading them back,
    and how many bytes read back wrong. ``write``: the seam a test corrupts."""
    block = torch.empty(size, dtype=torch.uint8, device=device)
    wrong, start = 0, clock()
    for pattern in PATTERNS:
        write(block, pattern)
        wrong += int(torch.count_nonzero(block != pattern))  # waits for the device, on purpose
    seconds = max(clock() - start, 1e-9)
    del block
    return 2 * len(PATTERNS) * size / 1e6 / seconds, wrong


def memory_figure(device: torch.device, checks: str, node: int) -> float:
    """The node's memory figure for the verdict: MB/s, or 0 when a byte read back wrong (said in
    the log with what to do: the verdict then names the node as the slowest there can be)."""
    rate, wrong = memory_test(device, SIZES[checks])
    if wrong:
        log.error("node %d's memory test read %d byte(s) of %s back wrong: its GPU memory is "
                  "failing (HINT: `nvidia-smi -q -d ECC,PAGE_RETIREMENT` on that node, and tell "
                  "the site)", node, wrong, device)
        return 0.0
    return rate
