"""Which network interface a rank's collectives use between nodes: never loopback.

gloo finds this node's address by resolving the hostname (unless ``GLOO_SOCKET_IFNAME`` names an
interface). On images whose ``/etc/hosts`` maps the hostname to 127.0.1.1 that address is loopback:
the ranks of other nodes are told to connect to 127.0.1.1, which is themselves, and a multi-node job
hangs at its first collective with no word why (mlc-ai/pith-train#91). NCCL does not resolve the
hostname: it picks its interfaces itself (InfiniBand's IP interfaces first), so its
``NCCL_SOCKET_IFNAME`` is left alone; pinning it to the interface that routes to ``MASTER_ADDR``
would tie NCCL's bootstrap and socket transport to the management network (issue 57).

:func:`plan` decides, before the first collective of a job that spans nodes: where the hostname
resolves to loopback while ``MASTER_ADDR`` does not, the interface whose address routes to
``MASTER_ADDR`` is named in ``GLOO_SOCKET_IFNAME`` (only where the user set none); where none
routes there, :class:`NetworkError` says how to name one. ``MASTER_ADDR``
on loopback means every rank runs on this one machine (the local test cluster started
``--one-machine``: its nodes are 127.0.2.x): then loopback is right and nothing changes. Pure: the
facts (:class:`Facts`) come from the seams of :mod:`hpc_ddp.rank.attempt.placement`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpc_ddp.core.errors import HpcDdpError, explain

GLOO_VAR, NCCL_VAR = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"


class NetworkError(HpcDdpError):
    """No interface of this node routes to MASTER_ADDR but loopback: the job would hang at its first
    collective. Deterministic (the node's network does not change on a retry)."""


@dataclass(frozen=True)
class Facts:
    """What the node's resolver and interfaces say, gathered by the rank (tests give them by
    hand)."""

    hostname: str
    # the hostname resolved, in the resolver's order (gloo takes the first)
    host_addrs: tuple[str, ...]
    master_addr: str
    master_addrs: tuple[str, ...]  # MASTER_ADDR resolved (empty: it does not resolve here)
    route_source: str | None  # this node's source address towards MASTER_ADDR (None: no route)
    interfaces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> its addresses


@dataclass(frozen=True)
class Plan:
    """What to export before the process group starts, and the log line that says why (both empty:
    nothing)."""

    exports: dict[str, str] = field(default_factory=dict)
    note: str = ""


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def interface_of(address: str, interfaces: Mapping[str, tuple[str, ...]]) -> str | None:
    """The interface that holds ``address`` (link-local IPv6 scope suffixes ignored)."""
    bare = address.split("%")[0]
    return next((name for name, addrs in interfaces.items()
                 if bare in {a.split("%")[0] for a in addrs}), None)


def plan(environ: Mapping[str, str], num_nodes: int, facts: Facts) -> Plan:
    """The interface for gloo and NCCL on this node (see the module's docstring); raises
    :class:`NetworkError`."""
    if num_nodes <= 1 or GLOO_VAR in environ:
        return Plan()  # one node talks over loopback anyway; a named interface is the user's choice
    if facts.host_addrs and not is_loopback(facts.host_addrs[0]):
        return Plan()  # gloo's address is one the other nodes can reach
    if not facts.master_addrs or any(is_loopback(a) for a in facts.master_addrs):
        return Plan()  # unresolvable: the rendezvous says so; loopback: every node is this machine
    gloo_sees = facts.host_addrs[0] if facts.host_addrs else "nothing (gloo falls back to loopback)"
    source = facts.route_source
    name = interface_of(source, facts.interfaces) if source and not is_loopback(source) else None
    if name is None:
        raise NetworkError(explain(
            f"gloo would use a loopback address on {facts.hostname} (the hostname resolves to "
            f"{gloo_sees}) in a "
            f"job of {num_nodes} nodes, and no interface of this node routes to "
            f"MASTER_ADDR={facts.master_addr} "
            f"({', '.join(facts.master_addrs)}) but loopback: the job would hang at its first "
            "collective",
            found=f"route source {source!r}, interfaces {dict(facts.interfaces)}",
            expected="an interface whose address reaches the first node",
            hint="name the interface the nodes reach each other on (`ip -o addr` on a compute "
                 "node), e.g. "
            f"slurm.setup=['export {GLOO_VAR}=eth0'] (or ib0 for IP over "
            "InfiniBand), "
            "or fix the image's /etc/hosts so the hostname resolves to that address"), key=GLOO_VAR)
    exports = {GLOO_VAR: name} if GLOO_VAR not in environ else {}
    note = (f"{facts.hostname} resolves to {gloo_sees}, a loopback address, so gloo would bind "
            "loopback in a job "
            f"of {num_nodes} nodes; {name} ({source}) routes to MASTER_ADDR={facts.master_addr}: "
            + ", ".join(f"{var}={value}" for var, value in exports.items()))
    return Plan(exports, note)
