"""Open files against the world size (hpc_ddp.core.limits): each rank raises its soft limit, preflight warns
when the hard one is short. The constants come from B12 (benchmarks/scale.py), measured with real gloo ranks."""

from __future__ import annotations

from hpc_ddp.core import limits
from hpc_ddp.core.config import load_config
from hpc_ddp.login.preflight import check_open_files


def test_what_a_world_size_needs_covers_what_b12_measured() -> None:
    assert limits.needed(2) < limits.needed(512) < limits.needed(4096)
    for world, measured in ((2, 36), (8, 59), (32, 131)):  # benchmarks/scale.py, 2026-11-25
        assert measured < limits.needed(world) < 2 * measured + 128
    assert limits.needed(4096) > 1024  # the default soft limit of many clusters


def test_the_hard_limit_decides_and_the_message_says_the_numbers_and_the_fix() -> None:
    assert limits.problem(8, soft=1024, hard=1024) is None
    assert limits.problem(4096, soft=1024, hard=-1) is None  # unlimited
    assert limits.problem(4096, soft=1024, hard=1 << 20) is None  # the rank raises its soft limit itself
    said = limits.problem(4096, soft=1024, hard=2048)
    assert said and "4096 ranks need about" in said and "hard limit here is 2048 (soft 1024)" in said
    assert "Too many open files" in said and "HINT: " in said and "ulimit -Hn" in said


def test_a_rank_raises_its_soft_limit_up_to_the_hard_one_and_never_lowers_it() -> None:
    calls: list[tuple[int, int]] = []
    assert limits.raise_soft_limit(5000, lambda: (1024, 4096), lambda s, h: calls.append((s, h))) == (4096, 4096)
    assert limits.raise_soft_limit(5000, lambda: (1024, -1), lambda s, h: calls.append((s, h))) == (5000, -1)
    assert limits.raise_soft_limit(500, lambda: (1024, 4096), lambda s, h: calls.append((s, h))) == (1024, 4096)
    assert calls == [(4096, 4096), (5000, -1)]


def test_preflight_warns_for_512_nodes_of_8_under_a_hard_limit_of_4096() -> None:
    cfg = load_config([], ["name=big", "train.task=a.b:C", "train.max_steps=10", "slurm.nodes=512", "slurm.tasks_per_node=8", "slurm.gpus_per_node=8"])
    [finding] = check_open_files(cfg, rlimit=(1024, 4096))
    assert finding.level == "warning" and finding.key == "slurm.nodes" and "4096 ranks need about" in finding.message
    assert "ulimit -Hn" in finding.hint
    assert check_open_files(cfg, rlimit=(1024, 1 << 20)) == []
