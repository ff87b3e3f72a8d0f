"""The health check's memory test (hpc_ddp.rank.attempt.health_memory, issue 60): run on this machine's memory
(the check itself runs it on CUDA devices only; a GPU runs it in tests/gpu), with a fault injected through its
write seam: a byte that reads back wrong makes the node's figure 0, which the verdict names, and the log says
what to do."""

from __future__ import annotations

import logging

import pytest
import torch

from hpc_ddp.rank.attempt import health_memory
from hpc_ddp.rank.attempt.health import judge
from hpc_ddp.rank.attempt.health_memory import PATTERNS, memory_test


def test_memory_that_holds_every_pattern_reads_back_whole_with_a_rate() -> None:
    torch.manual_seed(3)
    before = torch.get_rng_state()
    rate, wrong = memory_test(torch.device("cpu"), 1 << 20)
    assert rate > 0 and wrong == 0
    assert torch.equal(torch.get_rng_state(), before)  # exact resume holds: no random stream touched


def test_a_byte_that_reads_back_wrong_is_counted_for_each_pattern() -> None:
    def stuck_bit(block: torch.Tensor, pattern: int) -> None:
        block.fill_(pattern)
        block[12345] = pattern ^ 0x01  # one cell whose lowest bit never holds

    rate, wrong = memory_test(torch.device("cpu"), 1 << 20, write=stuck_bit)
    assert wrong == len(PATTERNS) and rate > 0


def test_a_node_whose_memory_reads_back_wrong_is_named_and_the_log_says_what_to_do(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(health_memory, "memory_test", lambda device, size: (9000.0, 3))
    with caplog.at_level(logging.ERROR, "hpc_ddp.health"):
        figure = health_memory.memory_figure(torch.device("cpu"), "quick", 2)
    assert figure == 0.0
    assert "node 2's memory test read 3 byte(s) of cpu back wrong" in caplog.text and "nvidia-smi" in caplog.text
    healthy = {"matmul": 20.0, "memory": 9000.0}
    sick = judge({0: healthy, 1: healthy, 2: {**healthy, "memory": figure}}, 0.3)
    assert list(sick) == [2] and "its GPU memory written and read back at 0 MB/s" in sick[2][1]
