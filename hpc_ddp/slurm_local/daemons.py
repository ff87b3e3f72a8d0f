"""Start and stop the throw-away cluster's daemons (root only).

Order: munged (reused if one answers), MariaDB + slurmdbd (accounting, so
``sacct`` works), slurmctld, one slurmd per node. Every daemon we start leaves a
pid file under ``ROOT/run``; stop signals exactly those PIDs, never a process
found by name. A zombie counts as stopped (PID 1 in containers reaps slowly).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

from hpc_ddp.core.errors import ClusterError, explain
from hpc_ddp.slurm_local import isolation
from hpc_ddp.slurm_local.commands import read_pid, run_command, wait_for, which
from hpc_ddp.slurm_local.isolation import alive
from hpc_ddp.slurm_local.conf import (ClusterSpec, render_slurm_conf, render_slurmdbd_conf,
                                      with_preempt_signal)
from hpc_ddp.slurm_local.hosts import add_hosts, remove_hosts
from hpc_ddp.slurm_local.machines import PIECES, RESOLV_CONF, node_script

APT_PACKAGES = "slurmctld slurmd slurm-client munge slurmdbd mariadb-server bindfs iproute2"
_BINARIES = ["slurmctld", "slurmd", "scontrol", "sinfo", "squeue", "scancel", "srun", "sbatch",
             "munge",
             "unmunge", "munged"]
_ACCOUNTING_BINARIES = ["slurmdbd", "sacctmgr", "sacct", "mariadbd", "mariadb-install-db"]


def missing_pieces(spec: ClusterSpec) -> list[str]:
    """What stands between this machine and a running cluster (empty when nothing)."""
    missing = [b for b in _BINARIES + (_ACCOUNTING_BINARIES if spec.accounting else [])
               if not which(b)]
    if os.geteuid() != 0:
        missing.append("root privileges (the daemons run as root)")
    return missing


def _pid_files(spec: ClusterSpec) -> list[Path]:
    """Our daemons, newest first in start order reversed: slurmd, slurmctld, slurmdbd, mysqld,
    munged."""
    run = spec.path("run")
    order = [*sorted(run.glob("slurmd-*.pid")), run / "slurmctld.pid", run / "slurmdbd.pid",
             run / "mysqld.pid", run / "munged.pid"]
    return [p for p in order if p.exists()]


def is_up(spec: ClusterSpec) -> bool:
    """Our slurmctld is alive and answers ``scontrol ping``."""
    pid = read_pid(spec.path("run", "slurmctld.pid"))
    if pid is None or not alive(pid) or not spec.conf_path.exists():
        return False
    return "UP" in run_command(spec, ["scontrol", "ping"], check=False, timeout=10).stdout


def _prepare(spec: ClusterSpec) -> None:
    """A fresh state tree: job ids start at 1 against an empty accounting database."""
    if spec.root.exists():
        shutil.rmtree(spec.root)
    for kind in ("etc", "run", "log", "spool/ctld",
                 *(f"spool/slurmd-{n}" for n in spec.node_names)):
        spec.path(kind).mkdir(parents=True, exist_ok=True)
    # every user's runs, as /tmp: each owns its own (a folder of yours is left as is)
    if not spec.shared.exists():
        spec.shared.mkdir(parents=True)
        spec.shared.chmod(0o1777)
    spec.conf_path.write_text(render_slurm_conf(spec))
    spec.dbd_conf_path.write_text(render_slurmdbd_conf(spec))
    spec.dbd_conf_path.chmod(0o600)  # slurmdbd refuses a readable one
    spec.path("etc", "resolv.conf").write_text(RESOLV_CONF)


def _start_munge(spec: ClusterSpec) -> None:
    def answers() -> bool:
        return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0

    if answers():
        return  # a system munged (systemd, or a previous session): reuse, never stop it
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        run_command(spec, ["mungekey", "--create", "--force"] if which("mungekey") else
                    ["dd", "if=/dev/urandom", f"of={key}", "bs=1", "count=1024"])
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    run_command(spec, ["runuser", "-u", "munge", "--", which("munged") or "munged"])
    wait_for("munged", answers, spec, timeout=10)
    pid = read_pid(Path("/run/munge/munged.pid"))
    if pid:
        spec.path("run", "munged.pid").write_text(f"{pid}\n")


def _start_accounting(spec: ClusterSpec) -> None:
    data, sock = spec.path("mysql"), spec.path("run", "mysqld.sock")
    run_command(spec, ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                       "--auth-root-authentication-method=normal", "--skip-test-db"], timeout=120)
    with open(spec.path("log", "mysqld.log"), "ab") as log:
        subprocess.Popen([which("mariadbd") or "mariadbd", "--no-defaults", f"--datadir={data}",
                          "--user=root",
                          f"--socket={sock}", f"--port={spec.mysql_port}",
                          "--bind-address=127.0.0.1",
                          "--skip-name-resolve", f"--pid-file={spec.path('run', 'mysqld.pid')}",
                          "--innodb-buffer-pool-size=128M", "--innodb-lock-wait-timeout=900",
                          "--skip-log-bin"],
                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    wait_for("MariaDB", lambda: sock.exists() and spec.path("run", "mysqld.pid").exists(), spec,
             log="mysqld.log")
    run_command(spec, [which("slurmdbd") or "slurmdbd"])
    wait_for("slurmdbd", lambda: run_command(spec, ["sacctmgr", "-n", "list", "cluster"],
                                             check=False).returncode == 0,
             spec, log="slurmdbd.log")
    run_command(spec, ["sacctmgr", "-i", "add", "cluster", spec.cluster_name])


def _start_slurm(spec: ClusterSpec) -> None:
    run_command(spec, [which("slurmctld") or "slurmctld", "-f", str(spec.conf_path)])
    wait_for("slurmctld",
             lambda: "UP" in run_command(spec, ["scontrol", "ping"], check=False).stdout, spec,
             log="slurmctld.log")
    for name in spec.node_names:
        start_node(spec, name)

    def all_idle() -> bool:
        lines = run_command(spec, ["sinfo", "-h", "-N", "-o", "%N %T"],
                            check=False).stdout.splitlines()
        # a node per partition
        states = dict(line.split() for line in lines if len(line.split()) == 2)
        return len(states) == spec.nodes and all(s == "idle" for s in states.values())

    wait_for("the slurmd nodes", all_idle, spec, log=f"slurmd-{spec.node_names[0]}.log")


def node_alive(spec: ClusterSpec, name: str) -> bool:
    """The node's slurmd runs (a killed node's does not)."""
    pid = read_pid(spec.path("run", f"slurmd-{name}.pid"))
    return pid is not None and alive(pid)


def node_script_path(spec: ClusterSpec, name: str) -> Path:
    return spec.path("etc", f"node-{name}.sh")


def start_node(spec: ClusterSpec, name: str) -> None:
    """One slurmd as a machine of its own (the pieces ``spec.isolated`` names; its script lies in
    ROOT/etc)."""
    m = isolation.machine_of(spec, name)
    script = node_script(name=name, isolated=spec.isolated, netns=m.netns,
                         cgroup_dirs=isolation.cgroup_dirs(m),
                         state_root=spec.root, shared=spec.shared, cache_s=spec.cache_s,
                         slurmd=[which("slurmd") or "slurmd", "-f", str(spec.conf_path), "-N",
                                 name],
                         bindfs_pid=isolation.bindfs_pid_file(spec, name),
                         resolv_conf=spec.path("etc", "resolv.conf"),
                         bindfs_log=spec.path("log", f"bindfs-{name}.log"))
    path = node_script_path(spec, name)
    path.write_text(script)
    run_command(spec, ["bash", str(path)])


def isolation_pieces(spec: ClusterSpec) -> tuple[tuple[str, ...], dict[str, str]]:
    """The pieces of a machine each node gets here, and why each other one cannot be had."""
    if not spec.machines:
        return (), {piece: "not asked for (--one-machine)" for piece in PIECES}
    missing = isolation.probe()
    return tuple(p for p in PIECES if p not in missing), missing


def set_preempt_signal(spec: ClusterSpec, mode: str) -> None:
    """Switch a running cluster between telling a preempted job with its --signal ("user") and
    Slurm's default SIGTERM ("term"): slurm.conf is rewritten and ``scontrol reconfigure`` applies
    it (measured on 22.05: no restart needed)."""
    spec.conf_path.write_text(with_preempt_signal(spec.conf_path.read_text(), mode))
    run_command(spec, ["scontrol", "reconfigure"])
    want = "preempt_send_user_signal" if mode == "user" else "(null)"

    def applied() -> bool:
        shown = run_command(spec, ["scontrol", "show", "config"], check=False).stdout
        return any(line.split("=", 1)[-1].strip() == want for line in shown.splitlines()
                   if line.startswith("SlurmctldParameters"))
    wait_for(f"slurmctld to take preempt_signal={mode}", applied, spec, log="slurmctld.log")


def start(spec: ClusterSpec) -> bool:
    """Start the cluster unless ours is already up; True when this call started it. Each node is a
    machine of its own as far as this machine allows (:func:`running_spec` says how far)."""
    if is_up(spec):
        return False
    missing = missing_pieces(spec)
    if missing:
        raise ClusterError(explain("cannot start the local Slurm cluster", found=", ".join(missing),
                                   expected="Slurm, munge and MariaDB installed, running as root",
                                   hint="apt-get install -y --no-install-recommends "
                                        f"{APT_PACKAGES}"))
    stop(spec)  # leftovers of a crashed earlier start, by their pid files
    isolated, missing_isolation = isolation_pieces(spec)
    spec = replace(spec, isolated=isolated)
    _prepare(spec)
    isolation.write_record(spec, missing_isolation)
    try:
        isolation.set_up(spec)
        _start_munge(spec)
        add_hosts(spec)
        if spec.accounting:
            _start_accounting(spec)
        _start_slurm(spec)
    except BaseException:
        stop(spec)
        raise
    return True


def _queue(spec: ClusterSpec) -> list[str]:
    """Jobs Slurm still knows as pending, running, suspended or completing."""
    return run_command(spec, ["squeue", "-h", "-o", "%A"], check=False, timeout=10).stdout.split()


def _cancel_jobs(spec: ClusterSpec) -> None:
    """Let Slurm end the jobs it runs, so no slurmstepd outlives its slurmd."""
    if not is_up(spec) or not (jobs := _queue(spec)):
        return
    run_command(spec, ["scancel", *jobs], check=False)
    deadline = time.monotonic() + spec.kill_wait_s + 10
    while _queue(spec) and time.monotonic() < deadline:
        time.sleep(0.2)


def stop(spec: ClusterSpec, timeout: float = 15) -> list[int]:
    """Stop every daemon whose pid file we wrote; return the PIDs signalled."""
    if not spec.path("run").exists():
        return []
    running = running_spec(spec)
    # a frozen node's slurmd and tasks would wait out every timeout below
    if "cgroups" in running.isolated:
        for m in isolation.machines(running):
            if isolation.freezer_state(m) not in ("THAWED", "n/a"):
                isolation.kill_node(running, m)
    _cancel_jobs(spec)
    stopped = []
    for pid_file in _pid_files(spec):
        pid = read_pid(pid_file)
        if pid and alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
            stopped.append(pid)
        pid_file.unlink(missing_ok=True)
    isolation.tear_down(running_spec(spec))
    remove_hosts(spec)
    return stopped


def running_spec(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` as the running (or last) cluster at its root was started: what it isolated, its
    nodes."""
    record = isolation.read_record(spec)
    if not record:
        return spec
    return replace(spec, isolated=tuple(record.get("isolated", ())),
                   nodes=len(record.get("nodes", {})) or spec.nodes,
                   shared=Path(record.get("shared", spec.shared)),
                   cache_s=int(record.get("cache_s", spec.cache_s)))
