"""The shape of a throw-away Slurm cluster on one machine, and its config files (pure).

N ``slurmd`` processes on one host (Debian's slurmd is built with
``--enable-multiple-slurmd``), each with its own name, loopback address
(127.0.2.i) and port; partitions ``debug`` (default, preemptable) and ``high``
(preempts ``debug``). The settings marked "fast" cut the scheduler's and
requeue's waits from minutes to about a second; see docs/slurm-local.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.core.hostlist import compress_hostlist

HOSTS_TAG = "# hpc_ddp slurm-local"


@dataclass(frozen=True)
class ClusterSpec:
    """Where the cluster keeps its state and what it looks like."""

    root: Path = Path("/tmp/hpc_ddp-slurm")
    nodes: int = 3
    cpus_per_node: int = 4
    memory_mb: int = 4096
    node_prefix: str = "n"
    addr_prefix: str = "127.0.2."
    slurmd_base_port: int = 17001
    slurmctld_port: int = 16817
    dbd_port: int = 16819
    mysql_port: int = 3307
    accounting: bool = True
    cluster_name: str = "hpcddp"
    grace_time_s: int = 10
    kill_wait_s: int = 5
    # twice dist.liveness_s's default: a frozen node's survivors declare it after 30 s and write
    # their snapshot before slurmctld's "not responding" kills the step (at 30 s a CI run lost that
    # race: no declaration, no lost_ranks); real clusters default to 300
    slurmd_timeout_s: int = 60
    # "user": a preempted job gets its --signal; "term": SIGTERM (Slurm's default)
    preempt_signal: str = "user"
    # Each node a machine of its own (slurm_local.machines): the pieces asked for, and the ones
    # start could have
    machines: bool = True
    isolated: tuple[str, ...] = ()
    # the nodes' private range; the login side (slurmctld, srun) is .254
    net_prefix: str = "10.77.0."
    # where runs live: each node sees it through its own cache
    shared: Path = Path("/var/tmp/hpc_ddp-shared")
    # how long a node caches names of the shared root, present or absent; 0: coherent
    cache_s: int = 30

    @property
    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{i}" for i in range(1, self.nodes + 1)]

    @property
    def node_addrs(self) -> list[str]:
        """Each node's own address where it has a network of its own, else a loopback address."""
        prefix = self.net_prefix if "network" in self.isolated else self.addr_prefix
        return [f"{prefix}{i}" for i in range(1, self.nodes + 1)]

    @property
    def key(self) -> str:
        """Six hex digits of the state directory: the cluster's namespaces, links and cgroups carry
        them."""
        return hashlib.sha1(str(self.root).encode()).hexdigest()[:6]

    @property
    def gateway(self) -> str:
        """The login side's address on the nodes' bridge: slurmctld and srun as the nodes reach
        them."""
        return f"{self.net_prefix}254"

    @property
    def conf_path(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def dbd_conf_path(self) -> Path:
        """slurmdbd looks for its config beside slurm.conf (the SLURM_CONF directory)."""
        return self.root / "etc" / "slurmdbd.conf"

    def path(self, kind: str, name: str = "") -> Path:
        """``run``/``log``/``spool`` paths: ``spec.path("log", "slurmctld.log")``."""
        return self.root / kind / name if name else self.root / kind


def render_slurm_conf(spec: ClusterSpec) -> str:
    """slurm.conf for the cluster; every non-default line says why it is there."""
    names = compress_hostlist(spec.node_names)
    first_port, last_port = spec.slurmd_base_port, spec.slurmd_base_port + spec.nodes - 1
    ports = str(first_port) if spec.nodes == 1 else f"{first_port}-{last_port}"
    accounting = [
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=localhost",
        f"AccountingStoragePort={spec.dbd_port}",
        "JobAcctGatherType=jobacct_gather/linux",
    ] if spec.accounting else ["JobAcctGatherType=jobacct_gather/none"]
    lines = [
        f"ClusterName={spec.cluster_name}",
        *(["# nodes in their own network namespaces reach slurmctld at the bridge's address",
            f"SlurmctldHost=localhost({spec.gateway})"] if "network" in spec.isolated else
          ["SlurmctldHost=localhost"]),
        f"SlurmctldPort={spec.slurmctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "# fast: requeued jobs wait cred_expire+1 s before they may start (default 120)",
        "AuthInfo=cred_expire=5",
        f"StateSaveLocation={spec.path('spool', 'ctld')}",
        f"SlurmdSpoolDir={spec.path('spool')}/slurmd-%n",
        f"SlurmctldPidFile={spec.path('run', 'slurmctld.pid')}",
        f"SlurmdPidFile={spec.path('run')}/slurmd-%n.pid",
        f"SlurmctldLogFile={spec.path('log', 'slurmctld.log')}",
        f"SlurmdLogFile={spec.path('log')}/slurmd-%n.log",
        "# the declared CPUs are more than the machine has: accept them",
        "SlurmdParameters=config_overrides",
        "# no cgroups needed",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "JobRequeue=1",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "# fast: start batch jobs within ~1 s, and rescan the queue every second (requeue)",
        "SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1",
        f"KillWait={spec.kill_wait_s}",
        "# fast: a node that stops answering (frozen, cut off, powered off) is marked down after "
        "30 s (default 300):",
        "# until then srun waits for its part of a step, and so does the heal of a job that ran on "
        "it",
        f"SlurmdTimeout={spec.slurmd_timeout_s}",
        "MinJobAge=300",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        *preempt_lines(spec.preempt_signal),
        *accounting,
        f"NodeName={names} NodeHostname={names} NodeAddr={','.join(spec.node_addrs)} Port={ports} "
        f"CPUs={spec.cpus_per_node} Sockets=1 CoresPerSocket={spec.cpus_per_node} ThreadsPerCore=1 "
        f"RealMemory={spec.memory_mb} State=UNKNOWN",
        f"PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
        f"GraceTime={spec.grace_time_s} PreemptMode=REQUEUE",
        "PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF",
    ]
    return "\n".join(lines) + "\n"


PREEMPT_SIGNALS = ("user", "term")
USER_SIGNAL_LINES = ["# preempted jobs get their --signal (our warning signal) instead of SIGTERM "
                     "(22.05 spelling)",
                     "SlurmctldParameters=preempt_send_user_signal"]
TERM_SIGNAL_LINE = ("# preempted jobs get SIGTERM, then SIGKILL after GraceTime (Slurm's default, "
                    "most clusters')")


def preempt_lines(mode: str) -> list[str]:
    """How a preempted job is told (``preempt_signal``): its own --signal, or SIGTERM as most
    clusters do."""
    if mode not in PREEMPT_SIGNALS:
        raise ValueError(f"preempt_signal must be one of {', '.join(PREEMPT_SIGNALS)}, not "
                         f"{mode!r}")
    return USER_SIGNAL_LINES if mode == "user" else [TERM_SIGNAL_LINE]


def with_preempt_signal(conf: str, mode: str) -> str:
    """slurm.conf's text with its preemption signal lines for ``mode`` (the rest as it was)."""
    lines = [line for line in conf.splitlines()
             if line not in (*USER_SIGNAL_LINES, TERM_SIGNAL_LINE)]
    at = next(i for i, line in enumerate(lines) if line.startswith("PreemptMode=")) + 1
    return "\n".join([*lines[:at], *preempt_lines(mode), *lines[at:]]) + "\n"


def render_slurmdbd_conf(spec: ClusterSpec) -> str:
    """slurmdbd.conf: a private MariaDB on 127.0.0.1:mysql_port (must be mode 0600)."""
    return "\n".join([
        "AuthType=auth/munge",
        "DbdHost=localhost",
        f"DbdPort={spec.dbd_port}",
        "SlurmUser=root",
        f"PidFile={spec.path('run', 'slurmdbd.pid')}",
        f"LogFile={spec.path('log', 'slurmdbd.log')}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={spec.mysql_port}",
        "StorageUser=root",
        "StorageLoc=hpcddp_acct",
    ]) + "\n"


def hosts_lines(spec: ClusterSpec) -> list[str]:
    """/etc/hosts lines so node names resolve (MASTER_ADDR is a node name)."""
    return [f"{addr} {name} {hosts_tag(spec)}"
            for addr, name in zip(spec.node_addrs, spec.node_names)]


def hosts_tag(spec: ClusterSpec) -> str:
    """Marks this cluster's /etc/hosts lines, so two clusters never remove each other's."""
    return f"{HOSTS_TAG} {spec.root}"
