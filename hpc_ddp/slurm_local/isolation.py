"""Make, undo and ask about the local nodes' machines: the bridge and namespaces, the cgroups, the
record of what ``start`` could isolate (root only; names from
:mod:`hpc_ddp.slurm_local.machines`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from hpc_ddp.core import processes
from hpc_ddp.core.errors import ClusterError, explain
from hpc_ddp.slurm_local.conf import ClusterSpec
from hpc_ddp.slurm_local.machines import PIECES, Machine, bridge, machine

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("freezer", "cpu")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def _ok(cmd: list[str]) -> tuple[bool, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, str(err)
    return proc.returncode == 0, (proc.stderr or proc.stdout).strip()[-200:]


def probe() -> dict[str, str]:
    """Why each piece of a node's isolation cannot be had here (an empty dict: all can)."""
    missing: dict[str, str] = {}
    if os.geteuid() != 0:
        return {piece: "needs root" for piece in PIECES}
    if not (_which("ip") and _which("nsenter")):
        missing["network"] = "ip (iproute2) or nsenter (util-linux) not installed"
    else:
        ok, why = _ok(["ip", "netns", "add", f"hpcddp-probe-{os.getpid()}"])
        _ok(["ip", "netns", "del", f"hpcddp-probe-{os.getpid()}"])
        if not ok:
            missing["network"] = f"`ip netns add` failed: {why}"
    ok, why = _ok(["unshare", "--uts", "true"])
    if not ok:
        missing["hostname"] = f"`unshare --uts` failed: {why}"
    if not _which("bindfs"):
        missing["filesystem"] = "bindfs not installed (apt-get install bindfs)"
    elif not Path("/dev/fuse").exists():
        missing["filesystem"] = "/dev/fuse is missing (FUSE not available)"
    else:
        ok, why = _ok(["unshare", "--mount", "true"])
        if not ok:
            missing["filesystem"] = f"`unshare --mount` failed: {why}"
    absent = [c for c in CONTROLLERS if not (CGROUP_ROOT / c / "cgroup.procs").exists()]
    if absent:
        missing["cgroups"] = (f"cgroup v1 controller(s) {', '.join(absent)} not mounted under "
                              f"{CGROUP_ROOT} (a "
                              "cgroup v2 machine: boot with systemd.unified_cgroup_hierarchy=0): "
                              "fault kill, freeze "
                              "and slow are not available")
    else:
        for controller in CONTROLLERS:
            trial = CGROUP_ROOT / controller / f"hpc_ddp-probe-{os.getpid()}"
            try:
                trial.mkdir()
                trial.rmdir()
            except OSError as err:
                missing["cgroups"] = (f"cannot make a cgroup under {CGROUP_ROOT / controller}: "
                                      f"{err.strerror}")
                break
    return missing


def machines(spec: ClusterSpec) -> list[Machine]:
    return [machine(name, addr, spec.key) for name, addr in zip(spec.node_names, spec.node_addrs)]


def machine_of(spec: ClusterSpec, name: str) -> Machine:
    """Node ``name`` of the cluster ``spec``."""
    return machine(name, spec.node_addrs[spec.node_names.index(name)], spec.key)


def cgroup_dirs(m: Machine) -> dict[str, Path]:
    return {c: CGROUP_ROOT / c / m.cgroup for c in CONTROLLERS}


def record_path(spec: ClusterSpec) -> Path:
    return spec.root / "etc" / "machines.json"


def write_record(spec: ClusterSpec, missing: dict[str, str]) -> None:
    record = {"isolated": list(spec.isolated), "missing": missing, "shared": str(spec.shared),
              "cache_s": spec.cache_s, "nodes": dict(zip(spec.node_names, spec.node_addrs))}
    record_path(spec).write_text(json.dumps(record, indent=1) + "\n")


def read_record(spec: ClusterSpec) -> dict:
    """What ``start`` isolated on this cluster (empty when it is not running or isolated
    nothing)."""
    try:
        return json.loads(record_path(spec).read_text())
    except (OSError, ValueError):
        return {}


def _ip(*args: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise ClusterError(explain(f"`ip {' '.join(args)}` failed",
                                   found=proc.stderr.strip()[-300:],
                                   hint="run as root; `python -m hpc_ddp.slurm_local start "
                                        "--one-machine` "
                                        "starts the cluster without network namespaces"))


def set_up(spec: ClusterSpec) -> None:
    """The bridge, a namespace and veth per node, and the nodes' cgroups, for the pieces
    ``spec.isolated`` names. Leftovers of an earlier cluster with the same names are removed
    first."""
    tear_down(spec)
    if "network" in spec.isolated:
        _ip("link", "add", bridge(spec.key), "type", "bridge")
        _ip("addr", "add", f"{spec.gateway}/24", "dev", bridge(spec.key))
        _ip("link", "set", bridge(spec.key), "up")
        for m in machines(spec):
            _ip("netns", "add", m.netns)
            _ip("link", "add", m.veth, "type", "veth", "peer", "name", "eth0", "netns", m.netns)
            _ip("link", "set", m.veth, "master", bridge(spec.key), "up")
            _ip("-n", m.netns, "addr", "add", f"{m.addr}/24", "dev", "eth0")
            _ip("-n", m.netns, "link", "set", "eth0", "up")
            _ip("-n", m.netns, "link", "set", "lo", "up")
            _ip("-n", m.netns, "route", "add", "default", "via", spec.gateway)
    if "cgroups" in spec.isolated:
        for m in machines(spec):
            for path in cgroup_dirs(m).values():
                path.mkdir(parents=True, exist_ok=True)


def bindfs_pid_file(spec: ClusterSpec, name: str) -> Path:
    return spec.path("run", f"bindfs-{name}.pid")


def kill_node(spec: ClusterSpec, m: Machine) -> list[int]:
    """SIGKILL every process of the node (its cgroup's, and its filesystem view): power off."""
    pids = set(cgroup_pids(m))
    bindfs = _bindfs_pid(spec, m.name)
    if bindfs is not None:
        pids.add(bindfs)
    bindfs_pid_file(spec, m.name).unlink(missing_ok=True)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    thaw(m)  # a frozen process dies only once thawed
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # gone before anyone asks whether the node's slurmd still runs
    return sorted(pids)


def alive(pid: int) -> bool:
    """True for a running process; a zombie or a missing PID is dead (PID 1 in containers reaps
    slowly)."""
    return processes.running(pid)


def _bindfs_pid(spec: ClusterSpec, name: str) -> int | None:
    """The node's bindfs, from its pid file, if that PID still is a bindfs (never another process
    that got it)."""
    try:
        pid = int(bindfs_pid_file(spec, name).read_text().split()[0])
        return pid if Path(f"/proc/{pid}/comm").read_text().strip() == "bindfs" else None
    except (OSError, ValueError, IndexError):
        return None


def cgroup_pids(m: Machine) -> list[int]:
    pids: set[int] = set()
    for path in cgroup_dirs(m).values():
        try:
            pids.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        except OSError:
            pass
    return sorted(pids)


def freezer_state(m: Machine) -> str:
    try:
        return (cgroup_dirs(m)["freezer"] / "freezer.state").read_text().strip()
    except OSError:
        return "n/a"


def freeze(m: Machine, timeout: float = 10) -> str:
    state = cgroup_dirs(m)["freezer"] / "freezer.state"
    state.write_text("FROZEN\n")
    deadline = time.monotonic() + timeout
    while freezer_state(m) != "FROZEN" and time.monotonic() < deadline:
        time.sleep(0.05)
    return freezer_state(m)


def thaw(m: Machine) -> None:
    state = cgroup_dirs(m)["freezer"] / "freezer.state"
    if state.exists():
        state.write_text("THAWED\n")


def cpu_quota(m: Machine, fraction: float | None) -> None:
    """Cap the node at ``fraction`` of this machine's CPUs (None: no cap)."""
    cpu = cgroup_dirs(m)["cpu"]
    period = int((cpu / "cpu.cfs_period_us").read_text())
    quota = -1 if fraction is None else max(1000, int(fraction * period * (os.cpu_count() or 1)))
    (cpu / "cpu.cfs_quota_us").write_text(f"{quota}\n")


def cpu_fraction(m: Machine) -> float | None:
    cpu = cgroup_dirs(m)["cpu"]
    try:
        quota = int((cpu / "cpu.cfs_quota_us").read_text())
        period = int((cpu / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 else quota / period / (os.cpu_count() or 1)


def link(m: Machine, up: bool) -> None:
    """The node's link down (the host's end of its veth) or up (both ends: a node may have cut
    itself off)."""
    _ip("link", "set", m.veth, "up" if up else "down")
    if up:
        _ip("-n", m.netns, "link", "set", "eth0", "up")


def link_up(m: Machine) -> bool | None:
    """Both ends of the node's link are up (None: the node has no link of its own)."""
    ends = [["ip", "-br", "link", "show", m.veth],
            ["ip", "-n", m.netns, "-br", "link", "show", "eth0"]]
    states = []
    for cmd in ends:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        if proc.returncode != 0 or "<" not in proc.stdout:
            return None
        states.append("UP" in proc.stdout.split("<", 1)[1].split(">", 1)[0].split(","))
    return all(states)


def tear_down(spec: ClusterSpec) -> None:
    """Undo :func:`set_up` (whatever of it exists): every node's processes killed, cgroups removed,
    the namespaces and the bridge deleted."""
    has_ip = bool(_which("ip"))
    for m in machines(spec):
        if any(p.exists() for p in cgroup_dirs(m).values()):
            kill_node(spec, m)
            deadline = time.monotonic() + 10
            while cgroup_pids(m) and time.monotonic() < deadline:
                time.sleep(0.05)
            for path in cgroup_dirs(m).values():
                try:
                    path.rmdir()
                except OSError:
                    pass
        elif (bindfs := _bindfs_pid(spec, m.name)) is not None:
            try:
                os.kill(bindfs, signal.SIGKILL)
            except OSError:
                pass
        bindfs_pid_file(spec, m.name).unlink(missing_ok=True)
        if not has_ip:
            continue
        if Path(f"/run/netns/{m.netns}").exists():
            _ip("netns", "del", m.netns, check=False)
        if Path(f"/sys/class/net/{m.veth}").exists():
            _ip("link", "del", m.veth, check=False)
    if has_ip and Path(f"/sys/class/net/{bridge(spec.key)}").exists():
        _ip("link", "del", bridge(spec.key), check=False)
    for controller in CONTROLLERS:
        try:
            (CGROUP_ROOT / controller / f"hpc_ddp-slurm-{spec.key}").rmdir()
        except OSError:
            pass
