"""This node's side of its training network, asked of the kernel of its network namespace: the
address it reaches MASTER_ADDR from, the interface that holds it, and whether that link is down
(the node is the one cut off). Used by the net beat (:mod:`hpc_ddp.rank.watch.net_beat`). No torch.
"""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR, SIOCGIFFLAGS = 0x8915, 0x8913  # Linux: an interface's IPv4 address, its flags
IFF_UP, IFF_RUNNING = 0x1, 0x40  # up (ip link set ... up), and its carrier there


def own_address(toward: str) -> str:
    """The address this node reaches ``toward`` (MASTER_ADDR) from: its training network's (no
    packet is sent: a UDP socket's connect only picks the route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((toward, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The interface that holds ``address`` (None: not found), asked of this network namespace's
    kernel (``/sys/class/net`` may be another namespace's: a container's, the local cluster's
    nodes')."""
    try:
        names = [name for _index, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                raw = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def link_down(interface: str | None) -> bool:
    """Whether ``interface`` is down or has lost its carrier (this node is the one cut off): its
    flags, from this namespace's kernel."""
    if interface is None:
        return False
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            raw = fcntl.ioctl(probe.fileno(), SIOCGIFFLAGS,
                              struct.pack("256s", interface.encode()[:15]))
    except OSError:
        return False
    flags = struct.unpack("H", raw[16:18])[0]
    return not flags & IFF_UP or not flags & IFF_RUNNING
