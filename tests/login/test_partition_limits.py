"""Preflight against the partition: a request it can never run (more nodes than it has or MaxNodes allows,
a time above MaxTime) is refused with the fix; and status says why a queued job waits. The last test asks
the real local cluster (3 nodes): `slurm.nodes=4` passed preflight and pended forever."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.login.partition import limit_problems, minutes
from hpc_ddp.login.preflight import check_partition_limits

ROOT = Path(__file__).resolve().parents[2]
# `scontrol show partition -o` of the local cluster, with a second partition that has limits
SCONTROL = (
    "PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 "
    "Nodes=n[1-3] State=UP TotalCPUs=12 TotalNodes=3\n"
    "PartitionName=short AllowGroups=ALL Default=NO MaxNodes=2 MaxTime=01:00:00 MinNodes=0 Nodes=n[1-3] "
    "State=UP TotalNodes=3\n")


def scontrol(cmd, sinfo: str = "3 idle\n", **_kwargs):  # noqa: ANN001
    """The Slurm commands preflight asks: the partitions, and how many of a partition's nodes are up."""
    if cmd[0] == "sinfo":
        assert cmd[:3] == ["sinfo", "-h", "-p"] and cmd[4:] == ["-o", "%D %t"]
        return subprocess.CompletedProcess(cmd, 0, sinfo, "")
    assert cmd == ["scontrol", "show", "partition", "-o"]
    return subprocess.CompletedProcess(cmd, 0, SCONTROL, "")


def config(*overrides: str):
    return load_config([ROOT / "examples" / "mlp.yaml"], list(overrides))


@pytest.mark.parametrize("text, expected", [
    ("UNLIMITED", None), ("INFINITE", None), ("30", 30), ("1:00:00", 60), ("2-00:00:00", 2880), ("7-12", 10800),
    ("10:30", 10.5), ("1-02:03", 1563), ("junk", None)])
def test_slurm_times_in_minutes(text: str, expected: float | None) -> None:
    assert minutes(text) == expected


def test_more_nodes_than_the_partition_has_is_refused_with_the_fix() -> None:
    [finding] = check_partition_limits(config("slurm.nodes=4"), scontrol)
    assert finding.level == "error" and finding.key == "slurm.nodes"
    assert "asks for 4 node(s) (slurm.nodes=4) but partition 'debug' can never give more than 3 (it has 3 " \
           "node(s)): it would pend forever (PartitionNodeLimit)" in finding.message
    assert finding.hint.startswith("set slurm.nodes=3")
    [spares] = check_partition_limits(config("slurm.nodes=2", "slurm.spare_nodes=2"), scontrol)
    assert "(slurm.nodes=2 + slurm.spare_nodes=2)" in spares.message and \
        spares.hint.startswith("set slurm.nodes=1 (with slurm.spare_nodes=2)")
    assert check_partition_limits(config("slurm.nodes=3"), scontrol) == []


def test_max_nodes_max_time_and_a_range_beyond_the_partition() -> None:
    nodes, time_limit = check_partition_limits(config("slurm.partition=short", "slurm.nodes=3",
                                                      "slurm.timeout_min=120"), scontrol)
    assert nodes.level == "error" and "its MaxNodes is 2" in nodes.message
    assert time_limit.level == "error" and time_limit.key == "slurm.timeout_min"
    assert "slurm.timeout_min=120 is above partition 'short''s MaxTime 01:00:00 (60 min)" in time_limit.message
    assert time_limit.hint.startswith("set slurm.timeout_min=60")
    [wide] = limit_problems({"PartitionName": "debug", "TotalNodes": "3", "MaxNodes": "UNLIMITED"}, "1-4", 0, 60)
    assert wide[0] == "warning" and "slurm.nodes=1-4 reaches 4 node(s) but partition 'debug' gives at most 3" in wide[2]
    # of two partitions, one that can run it is enough
    assert check_partition_limits(config("slurm.partition=short,debug", "slurm.nodes=3"), scontrol) == []


def test_a_partition_that_is_down_or_short_of_nodes_that_are_up_is_a_warning() -> None:
    [down] = limit_problems({"PartitionName": "p", "TotalNodes": "3", "State": "DOWN"}, 1, 0, 60)
    assert down[0] == "warning" and "is DOWN" in down[2]
    drained = lambda cmd, **kw: scontrol(cmd, sinfo="1 idle\n1 drain*\n1 down*\n", **kw)  # noqa: E731
    [few] = check_partition_limits(config("slurm.nodes=2"), drained)
    assert few.level == "warning" and "only 1 of partition 'debug''s nodes can take a job now" in few.message
    assert check_partition_limits(config("slurm.nodes=1"), drained) == []
    mixed = lambda cmd, **kw: scontrol(cmd, sinfo="1 mix\n1 alloc\n1 idle~\n", **kw)  # noqa: E731
    assert check_partition_limits(config("slurm.nodes=3"), mixed) == []  # busy or powered down: it will start

