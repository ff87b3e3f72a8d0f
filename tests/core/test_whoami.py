"""``python -m hpc_ddp.whoami``: the per-rank table, the one-line view, and its errors."""

from __future__ import annotations

import json

import pytest

from hpc_ddp.core.slurm_env import master_port
from hpc_ddp.core.whoami import main


def test_simulated_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--simulate", "2x2", "--job-id", "77"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "SLURM_JOB_NODELIST=node[0-1] SLURM_TASKS_PER_NODE=2(x2)" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and [r[2] for r in rows] == ["0", "0", "1", "1"]
    assert {(r[5], r[6]) for r in rows} == {("node0", str(master_port(77)))}


@pytest.mark.parametrize("shape", ["2", "0x2", "axb"])
def test_bad_simulate_shape(shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--simulate", shape]) == 2
    assert "NODESxTASKS" in capsys.readouterr().err


def test_json_for_this_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json"], environ={"MASTER_ADDR": "localhost", "MASTER_PORT": "2345"}) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["rank"], got["world_size"], got["master_port"], got["source"]) == (0, 1, 2345, "single")
    assert got["master_addr_resolved"] in ("127.0.0.1", "::1")


def test_derivation_error_exits_1_with_the_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([], environ={"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n1"}) == 1
    assert "HINT: run every task through srun" in capsys.readouterr().err


def test_unresolvable_master_addr_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([], environ={"MASTER_ADDR": "no-such-host.invalid"}) == 1
    assert "does not resolve" in capsys.readouterr().err
