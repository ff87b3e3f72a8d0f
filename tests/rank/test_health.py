"""Sick nodes kept out (hpc_ddp.rank.attempt.health, issue 60): the verdict as a table, the probes on this
machine, and a rehearsal whose check finds nothing sick and changes no number. A node that is sick for real (its
CPU capped on the local cluster of machines) and left out: tests/cluster/test_health_slurm.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hpc_ddp.rank.attempt.health import disk, judge, matmul_gflops, with_links


def test_a_node_far_below_the_other_nodes_median_is_sick_and_one_a_little_below_is_not() -> None:
    healthy = {"run_dir_write": 200.0, "local_write": 900.0, "matmul": 20.0}
    figures = {0: healthy, 1: {**healthy, "run_dir_write": 190.0}, 2: {**healthy, "run_dir_write": 40.0},
               3: {**healthy, "matmul": 1.0, "local_write": 100.0}}
    sick = judge(figures, below=0.3)
    assert sorted(sick) == [2, 3]
    assert sick[2] == (0.2, "writing the run dir at 40 MB/s against the other nodes' median of 200")
    assert sick[3][0] == 0.05 and "a matmul at 1 GFLOP/s against the other nodes' median of 20" in sick[3][1]
    assert "writing node-local storage at 100 MB/s" in sick[3][1]
    assert judge({0: healthy}, 0.3) == {}  # one node: nothing to compare with
    assert judge({0: healthy, 1: {"matmul": 5.0}}, 0.3) == {1: (0.25, "a matmul at 5 GFLOP/s against the other "
                                                                   "nodes' median of 20")}


def test_a_nodes_link_is_the_better_of_its_two_so_a_bad_nic_names_its_node_not_its_neighbours() -> None:
    figures: dict[int, dict[str, float]] = {n: {} for n in range(4)}
    with_links(figures, {0: 1000.0, 1: 1000.0, 2: 50.0, 3: 50.0})  # node 2's NIC: in to 2 and in to 3 are slow
    assert {n: f["link"] for n, f in figures.items()} == {0: 1000.0, 1: 1000.0, 2: 50.0, 3: 1000.0}
    assert sorted(judge(figures, 0.3)) == [2]
    pair: dict[int, dict[str, float]] = {0: {}, 1: {}}
    with_links(pair, {0: 1000.0, 1: 20.0})  # two nodes: one pair of links, and a slow one names neither
    assert judge(pair, 0.3) == {}


def test_the_disk_probe_writes_a_private_file_never_through_a_link_and_removes_it(tmp_path: Path) -> None:
    write, read = disk(tmp_path / "probe", 2 << 20)
    assert write > 0 and read > 0 and list(tmp_path.iterdir()) == []
    (tmp_path / "elsewhere").write_text("keep")
    os.symlink(tmp_path / "elsewhere", tmp_path / "planted")
    with pytest.raises(FileExistsError):
        disk(tmp_path / "planted", 1 << 20)
    assert (tmp_path / "elsewhere").read_text() == "keep"


def test_a_node_that_cannot_write_the_run_dir_measures_nothing_there_and_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hpc_ddp.rank.attempt.health import measure

    local = tmp_path / "local"
    local.mkdir()
    with caplog.at_level("WARNING", logger="hpc_ddp.health"):  # no liveness/ folder: the probe cannot be made
        figures = measure("quick", tmp_path / "gone", local, 1, torch.device("cpu"))
    assert figures["run_dir_write"] == figures["run_dir_read"] == 0.0 and figures["local_write"] > 0
    assert "node 1's health check could not write" in caplog.text
    assert sorted(judge({0: {**figures, "run_dir_write": 200.0}, 1: figures}, 0.3)) == [1]


def test_a_probe_a_killed_attempt_left_does_not_make_its_node_sick_for_good(tmp_path: Path) -> None:
    from hpc_ddp.rank.attempt.health import measure
    from hpc_ddp.rundir import layout

    local = tmp_path / "local"
    local.mkdir()
    (tmp_path / "liveness").mkdir()
    layout.health_probe(tmp_path, 1).write_bytes(b"half of 8 MB")  # the attempt before died mid-write
    (local / "probe-node-1").write_bytes(b"half")
    figures = measure("quick", tmp_path, local, 1, torch.device("cpu"))
    assert figures["run_dir_write"] > 0 and figures["local_write"] > 0
    assert not layout.health_probe(tmp_path, 1).exists() and list(local.iterdir()) == []


def test_the_matmul_probe_leaves_the_random_streams_as_they_were() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert matmul_gflops(torch.device("cpu"), seconds=0.05) > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_nodes_the_attempt_before_stopped_to_leave_out_are_kept_when_they_are_here_again() -> None:
    """A newcomer's rehearsal with every node sick (slurm.health.below=0.99) and one spare stopped after one step,
    was requeued onto the same nodes, and did that 44 times. Rank 0's verdict now keeps nodes that the attempt
    before stopped to leave out: nothing could take their place. Another sick node is still left out."""
    from hpc_ddp.rank.attempt.health import _verdict

    healthy = {"matmul": 100.0}
    gathered = [(0, healthy, None), (1, {"matmul": 5.0}, None), (2, healthy, None)]
    hosts = ["n1", "n2", "n3"]
    figures, sick, again = _verdict(gathered, 0.3, hosts, [])
    assert figures == {0: healthy, 1: {"matmul": 5.0}, 2: healthy} and list(sick) == [1] and again == ""
    before = [{"reason": "slow", "replace": ["n2"], "health": {"sick": {"n2": "..."}}}]
    assert _verdict(gathered, 0.3, hosts, before)[2].startswith("the attempt before stopped to leave it out")
    other = [{"reason": "slow", "replace": ["n3"], "health": {"sick": {"n3": "..."}}}]
    assert _verdict(gathered, 0.3, hosts, other)[2] == ""  # another node this time: left out too
    straggler = [{"reason": "slow", "replace": ["n2"], "slow_nodes": {"n2": {}}}]  # a slow node's stop, not a check's
    assert _verdict(gathered, 0.3, hosts, straggler)[2] == ""


def test_a_sick_nodes_line_makes_it_a_hard_suspect_with_why() -> None:
    from hpc_ddp.shell.heal import replaced

    line = {"reason": "slow", "replace": ["n3"],
            "health": {"checks": "quick", "sick": {"n3": "a matmul at 1 GFLOP/s against the other nodes' median of 20"}}}
    assert replaced(line) == {"n3": "failed its health check (a matmul at 1 GFLOP/s against the other nodes' median "
                                    "of 20)"}


@pytest.mark.slow
def test_a_rehearsals_check_names_nobody_on_one_machine_and_changes_no_number(tmp_path: Path) -> None:
    """2 x 2, checks full: every node's figures in the ledger line, nobody sick (every rehearsed node is this
    machine), and the run's parameters the same as without the check (no random stream is touched)."""
    from hpc_ddp.rundir.ledger import read_attempts
    from tests.helpers import submit

    base = ["examples/mlp.yaml", "--local", "train.max_steps=20", "snapshot.every_steps=null"]
    checked = submit(*base, f"run_dir={tmp_path / 'checked'}", "slurm.health.checks=full")
    plain = submit(*base, f"run_dir={tmp_path / 'plain'}")
    assert checked.returncode == 0 and plain.returncode == 0, (checked.stderr[-3000:], plain.stderr[-3000:])
    [line] = read_attempts(tmp_path / "checked")
    health = line["health"]
    assert health["checks"] == "full" and health["sick"] == {} and sorted(health["nodes"]) == ["node0", "node1"]
    assert set(health["nodes"]["node0"]) == {"run_dir_write", "run_dir_read", "local_write", "local_read", "matmul",
                                             "link"}
    assert all(v > 0 for f in health["nodes"].values() for v in f.values())
    assert "health" not in read_attempts(tmp_path / "plain")[0]
    sha = [json.loads((tmp_path / n / "DONE.json").read_text())["params_sha256"] for n in ("checked", "plain")]
    assert sha[0] == sha[1]
    assert not list((tmp_path / "checked" / "liveness").glob("health-*"))  # the probes are gone
