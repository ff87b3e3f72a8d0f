"""A second local cluster beside the session's: each starts and stops only its own daemons."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.slurm_local import ClusterSpec, is_up, running_spec, start, stop
from hpc_ddp.slurm_local.daemons import alive
from hpc_ddp.slurm_local.hosts import HOSTS_FILE


@pytest.mark.slurm
def test_second_cluster_starts_and_stops_only_its_own_daemons(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    spec = ClusterSpec(root=tmp_path / "c2", nodes=1, node_prefix="m", addr_prefix="127.0.3.", net_prefix="10.77.3.",
                       slurmd_base_port=17101, slurmctld_port=16917, accounting=False, cluster_name="second")
    assert start(spec) is True
    try:
        assert is_up(spec) and start(spec) is False  # a second start reuses it
        pids = [int(p.read_text()) for p in (spec.root / "run").glob("*.pid") if not p.name.startswith("bindfs")]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)  # slurmctld + one slurmd; munged is shared
        line = f"{running_spec(spec).node_addrs[0]} m1"
        assert line in HOSTS_FILE.read_text()
        assert subprocess.run(["srun", "-N1", "true"], env={**os.environ, "SLURM_CONF": str(spec.conf_path)},
                              capture_output=True, timeout=60).returncode == 0
    finally:
        stopped = stop(spec)
    assert set(pids) <= set(stopped) and not any(alive(pid) for pid in pids)
    assert line not in HOSTS_FILE.read_text()
    assert is_up(slurm_cluster)  # the session's cluster was not touched: its nodes still run jobs
    assert f"{slurm_cluster.node_addrs[0]} n1" in HOSTS_FILE.read_text()
    assert subprocess.run(["srun", "-N3", "true"], capture_output=True, timeout=60).returncode == 0
    assert subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
