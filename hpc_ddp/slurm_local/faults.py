"""The faults a real node has, played on a local node: ``python -m hpc_ddp.slurm_local fault NODE
ACTION``.

* ``kill``: every process of the node gets SIGKILL, slurmd and its view of the shared root included
  (power lost: peers see silence, slurmctld finds the node not responding); ``normal`` boots it
  again.
* ``freeze``/``thaw``: the node's freezer cgroup, slurmd included (a kernel hang: SIGCONT does not
  wake it, and Slurm's own signals wait with it).
* ``partition``/``reconnect``: the node's link down/up. It lives on and still sees its view of the
  shared root (which is local here, as a node whose training network fails and whose storage network
  does not); nobody reaches it and it reaches nobody, and no FIN or RST is sent.
* ``slow=FRACTION``: the node's CPU share capped at FRACTION of this machine; ``normal`` lifts it.
* ``normal``: all of the above undone; a killed node booted again and returned to service.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

from hpc_ddp.core.errors import ClusterError, explain
from hpc_ddp.slurm_local import isolation
from hpc_ddp.slurm_local.conf import ClusterSpec
from hpc_ddp.slurm_local.machines import Machine

ACTIONS = ("kill", "freeze", "thaw", "partition", "reconnect", "slow=FRACTION", "normal")
NEEDS = {"kill": "cgroups", "freeze": "cgroups", "thaw": "cgroups", "slow": "cgroups",
         "partition": "network",
         "reconnect": "network"}


@dataclass(frozen=True)
class NodeState:
    """One node as ``slurm_local status`` shows it."""

    name: str
    addr: str
    slurm: str  # sinfo's state
    freezer: str  # THAWED, FREEZING, FROZEN or n/a
    link: str  # up, down or n/a
    cpu: str  # "all" or the cap as a fraction
    processes: int

    def line(self) -> str:
        return (f"{self.name:<5} {self.addr:<12} slurm={self.slurm:<10} freezer={self.freezer:<8} "
                f"link={self.link:<4} cpu={self.cpu:<6} processes={self.processes}")


def parse_action(text: str) -> tuple[str, float | None]:
    """``"slow=0.25"`` -> ("slow", 0.25); the other actions take no value."""
    name, _, value = text.partition("=")
    if name == "slow":
        try:
            fraction = float(value)
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            raise ClusterError(explain(f"fault action {text!r} needs a CPU fraction", found=value
                                       or "nothing",
                                       expected="slow=FRACTION with 0 < FRACTION <= 1, of this "
                                                "machine's CPUs",
                                       hint="slow=0.25 gives the node a quarter of the machine"))
        return name, fraction
    if value or name not in ACTIONS:
        raise ClusterError(explain(f"unknown fault action {text!r}", expected=" | ".join(ACTIONS),
                                   hint="python -m hpc_ddp.slurm_local fault n2 freeze"))
    return name, None


def _machine(spec: ClusterSpec, node: str) -> Machine:
    if node not in spec.node_names:
        raise ClusterError(explain(f"no node {node!r} in the local cluster",
                                   expected=", ".join(spec.node_names),
                                   hint="python -m hpc_ddp.slurm_local status lists them"))
    return isolation.machine_of(spec, node)


def _scontrol(spec: ClusterSpec, *args: str) -> str:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30,
                          env={"SLURM_CONF": str(spec.conf_path),
                               "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
    return proc.stdout + proc.stderr


def fault(spec: ClusterSpec, node: str, action: str) -> str:
    """Play ``action`` on ``node`` of the running cluster ``spec`` (as :func:`daemons.running_spec`
    gives it); return what was done, in a sentence."""
    name, fraction = parse_action(action)
    m = _machine(spec, node)
    needed = NEEDS.get(name)
    if needed and needed not in spec.isolated:
        raise ClusterError(explain(f"`fault {node} {action}` needs the node's {needed}, which this "
                                   "cluster does not isolate",
                                   hint="`python -m hpc_ddp.slurm_local status` says why; start "
                                        "the cluster as root on a machine with namespaces and "
                                        "cgroup v1"))
    if name == "kill":
        pids = isolation.kill_node(spec, m)
        return (f"{node}: killed {len(pids)} processes (slurmd, its jobs' tasks, its filesystem "
                "view)")
    if name == "freeze":
        state = isolation.freeze(m)
        return (f"{node}: freezer {state} ({len(isolation.cgroup_pids(m))} processes, slurmd "
                "included)")
    if name == "thaw":
        isolation.thaw(m)
        return f"{node}: thawed"
    if name == "partition":
        isolation.link(m, up=False)
        return f"{node}: link {m.veth} down ({m.addr} unreachable; no FIN or RST is sent)"
    if name == "reconnect":
        isolation.link(m, up=True)
        return f"{node}: link {m.veth} up"
    if name == "slow":
        isolation.cpu_quota(m, fraction)
        return f"{node}: CPU capped at {fraction:g} of this machine"
    return normal(spec, m)


def normal(spec: ClusterSpec, m: Machine) -> str:
    """Every fault undone; a node whose slurmd is gone booted again and resumed in Slurm."""
    from hpc_ddp.slurm_local.daemons import node_alive, start_node

    done = []
    if "cgroups" in spec.isolated:
        if isolation.freezer_state(m) != "THAWED":
            isolation.thaw(m)
            done.append("thawed")
        if isolation.cpu_fraction(m) is not None:
            isolation.cpu_quota(m, None)
            done.append("CPU cap lifted")
    if "network" in spec.isolated and isolation.link_up(m) is False:
        isolation.link(m, up=True)
        done.append("link up")
    if not node_alive(spec, m.name):
        start_node(spec, m.name)
        done.append("booted (slurmd started)")
    state = _scontrol(spec, "show", "node", m.name)
    if any(word in state for word in ("State=DOWN", "DRAIN", "NOT_RESPONDING")):
        _scontrol(spec, "update", f"nodename={m.name}", "state=resume")
        deadline = time.monotonic() + 20
        while "NOT_RESPONDING" in _scontrol(spec, "show", "node",
                                            m.name) and time.monotonic() < deadline:
            time.sleep(0.2)
        done.append("resumed in Slurm")
    return f"{m.name}: " + (", ".join(done) if done else "already normal")


def states(spec: ClusterSpec) -> list[NodeState]:
    """Each node's Slurm state and the faults on it."""
    sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                           timeout=30,
                           env={"SLURM_CONF": str(spec.conf_path),
                                "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
    slurm = dict(line.split() for line in sinfo.stdout.splitlines() if len(line.split()) == 2)
    out = []
    for node in spec.node_names:
        m = _machine(spec, node)
        cgroups = "cgroups" in spec.isolated
        fraction = isolation.cpu_fraction(m) if cgroups else None
        up = isolation.link_up(m) if "network" in spec.isolated else None
        out.append(NodeState(name=node, addr=m.addr, slurm=slurm.get(node, "unknown"),
                             freezer=isolation.freezer_state(m) if cgroups else "n/a",
                             link="n/a" if up is None else ("up" if up else "down"),
                             cpu="all" if fraction is None else f"{fraction:.2f}",
                             processes=len(isolation.cgroup_pids(m)) if cgroups else 0))
    return out
