"""The throw-away cluster: its rendered config, and that stop ends exactly what start began."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpc_ddp.slurm_local import ClusterSpec, is_up, render_slurm_conf, render_slurmdbd_conf, start, stop
from hpc_ddp.slurm_local.conf import hosts_lines
from hpc_ddp.slurm_local.daemons import HOSTS_FILE, alive


def test_slurm_conf_has_the_settings_that_make_tests_fast_and_preemption_work() -> None:
    text = render_slurm_conf(ClusterSpec(root=Path("/x"), nodes=3))
    for line in ["AuthInfo=cred_expire=5", "SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1",
                 "SlurmctldParameters=preempt_send_user_signal", "PreemptType=preempt/partition_prio",
                 "SlurmdSpoolDir=/x/spool/slurmd-%n", "JobRequeue=1", "KillWait=5"]:
        assert line in text.splitlines()
    node = next(line for line in text.splitlines() if line.startswith("NodeName="))
    assert "NodeName=n[1-3]" in node and "NodeAddr=127.0.2.1,127.0.2.2,127.0.2.3" in node
    assert "Port=17001-17003" in node
    assert "PartitionName=high" in text and "GraceTime=10 PreemptMode=REQUEUE" in text


def test_without_accounting_there_is_no_slurmdbd() -> None:
    assert "slurmdbd" not in render_slurm_conf(ClusterSpec(accounting=False))
    assert "StoragePort=3307" in render_slurmdbd_conf(ClusterSpec())


def test_hosts_lines_are_tagged_per_cluster() -> None:
    assert hosts_lines(ClusterSpec(root=Path("/a"), nodes=1)) == ["127.0.2.1 n1 # hpc_ddp slurm-local /a"]


@pytest.mark.slurm
def test_second_cluster_starts_and_stops_only_its_own_daemons(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    spec = ClusterSpec(root=tmp_path / "c2", nodes=1, node_prefix="m", addr_prefix="127.0.3.",
                       slurmd_base_port=17101, slurmctld_port=16917, accounting=False, cluster_name="second")
    assert start(spec) is True
    try:
        assert is_up(spec) and start(spec) is False  # a second start reuses it
        pids = [int(p.read_text()) for p in (spec.root / "run").glob("*.pid")]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)  # slurmctld + one slurmd; munged is shared
        assert "127.0.3.1 m1" in HOSTS_FILE.read_text()
    finally:
        stopped = stop(spec)
    assert sorted(stopped) == sorted(pids) and not any(alive(pid) for pid in pids)
    assert "127.0.3.1 m1" not in HOSTS_FILE.read_text()
    assert is_up(slurm_cluster)  # the session's cluster was not touched
    assert "127.0.2.1 n1" in HOSTS_FILE.read_text()
    assert subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
