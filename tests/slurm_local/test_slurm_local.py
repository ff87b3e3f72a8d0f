"""The throw-away cluster: its rendered config, and that stop ends exactly what start began."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.core.errors import ClusterError
from hpc_ddp.slurm_local import ClusterSpec, render_slurm_conf, render_slurmdbd_conf
from hpc_ddp.slurm_local.faults import parse_action
from hpc_ddp.slurm_local.machines import PIECES, machine, node_script
from hpc_ddp.slurm_local.conf import hosts_lines


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


def test_a_cluster_of_machines_gives_each_node_its_own_address_and_the_nodes_reach_slurmctld_on_the_bridge(
        ) -> None:
    spec = ClusterSpec(root=Path("/x"), nodes=2, isolated=PIECES)
    text = render_slurm_conf(spec)
    assert "SlurmctldHost=localhost(10.77.0.254)" in text.splitlines()
    assert "NodeAddr=10.77.0.1,10.77.0.2" in text
    assert ClusterSpec(root=Path("/x")).key != ClusterSpec(root=Path("/y")).key  # two clusters, two sets of names
    m = machine("n2", "10.77.0.2", spec.key)
    assert len(m.veth) <= 15 and m.netns == f"hpcddp-{spec.key}-n2"


def test_a_nodes_start_script_isolates_what_it_was_asked_to() -> None:
    def script(isolated: tuple[str, ...]) -> str:
        return node_script(name="n1", isolated=isolated, netns="ns1", cgroup_dirs={
            "cpu": Path("/cg/cpu/n1"), "freezer": Path("/cg/freezer/n1")}, state_root=Path("/tmp/st"),
            shared=Path("/var/tmp/sh"), cache_s=30, slurmd=["slurmd", "-N", "n1"], bindfs_pid=Path("/tmp/st/b.pid"),
            resolv_conf=Path("/tmp/st/resolv.conf"))

    full = script(PIECES)
    for part in ["nsenter --net=/run/netns/ns1 unshare --mount --uts", "hostname n1", "mount -t tmpfs -o mode=1777 "
                 "tmpfs /tmp", "mount -t tmpfs -o mode=1777 tmpfs /dev/shm", "entry_timeout=30,negative_timeout=30,"
                 "attr_timeout=0,multithreaded,enable-lock-forwarding /var/tmp/sh /var/tmp/sh", "echo $$ > /cg/freezer/n1/cgroup.procs",
                 "mount --no-canonicalize --bind /proc/self/fd/3 /tmp/st", "exec slurmd -N n1"]:
        assert part in full, part
    # bindfs starts before the node joins its freezer cgroup: a frozen node's file server is not frozen with it
    assert full.index("bindfs -f") < full.index("/cg/freezer/n1")
    bare = script(())
    assert "unshare" not in bare and "bindfs" not in bare and "exec slurmd -N n1" in bare


def test_fault_actions_are_checked_before_anything_is_done() -> None:
    assert parse_action("slow=0.25") == ("slow", 0.25) and parse_action("freeze") == ("freeze", None)
    for bad in ("slow=0", "slow=2", "slow", "melt", "kill=1"):
        with pytest.raises(ClusterError):
            parse_action(bad)


def test_hosts_lines_are_tagged_per_cluster() -> None:
    assert hosts_lines(ClusterSpec(root=Path("/a"), nodes=1)) == ["127.0.2.1 n1 # hpc_ddp slurm-local /a"]

