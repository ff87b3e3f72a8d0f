"""Which network NCCL chose between nodes, read from NCCL's own INIT/NET log lines.

A multi-node job whose NCCL falls back from InfiniBand to TCP sockets trains up to 10x slower and
says nothing (pytorch#111424). NCCL says which network it took only in its INFO lines (``NCCL INFO
Using network IB``, ``NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.1<0>``, ``NCCL INFO
NET/Socket : Using [0]eth0:10.0.0.1<0>``), which nobody reads unless they set ``NCCL_DEBUG``. So
rank 0, where the user did not set ``NCCL_DEBUG``, asks NCCL for its INIT and NET lines in a file of
its own on node-local storage (:func:`capture_env`); after the first communicator exists the rank
reads it (:func:`parse`), records the result in the attempt's ledger line and warns
(:func:`warning`) when it is sockets on a node that has InfiniBand devices. Pure text functions; no
torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# "NCCL INFO Using network IB" (2.5+), "Using network Socket", "Using network AWS Libfabric", "Using
# network IBext"; horovod-era NCCL (2.3) said "Using internal Network IB"
_CHOSEN = re.compile(r"(?:NCCL )?INFO Using (?:internal )?[Nn]etwork (?P<net>\S.*?)\s*$")
# "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.0.0.1<0>", "NET/Socket : Using
# [0]eth0:10.0.0.1<0>"
_USING = re.compile(r"NCCL INFO NET/(?P<net>[A-Za-z][\w ]*?)\s*: Using (?P<devices>.*?)\s*(?:; OOB "
                    r"(?P<oob>\S+))?\s*$")
_OFI = re.compile(r"NCCL INFO NET/OFI Selected [Pp]rovider is (?P<provider>\S+)")
_BOOTSTRAP = re.compile(r"NCCL INFO Bootstrap ?: Using (?P<iface>.*?)\s*$")
_NO_IB = re.compile(r"NCCL INFO NET/IB : No device found")
_VERSION = re.compile(r"NCCL version (?P<version>\S+)")

SOCKET_NAMES = ("Socket",)
CAPTURE_VARS = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")


def parse(text: str) -> dict[str, Any] | None:
    """What NCCL's INFO lines say it chose: ``{"network": "IB", "kind": "ib", "devices": "...",
    "oob": ..., "bootstrap": ..., "no_ib_device": bool, "version": ...}``; None when the text says
    nothing about it."""
    found: dict[str, Any] = {}
    used: dict[str, tuple[str, str | None]] = {}
    for line in text.splitlines():
        if (match := _CHOSEN.search(line)) is not None:
            # the first communicator's choice (others repeat it)
            found.setdefault("network", match["net"])
        elif (match := _USING.search(line)) is not None:
            used.setdefault(match["net"].strip(), (match["devices"], match["oob"]))
        elif (match := _OFI.search(line)) is not None:
            found.setdefault("provider", match["provider"])
        elif (match := _BOOTSTRAP.search(line)) is not None:
            found.setdefault("bootstrap", match["iface"])
        elif _NO_IB.search(line):
            found["no_ib_device"] = True
        elif "version" not in found and (match := _VERSION.search(line)) is not None:
            found["version"] = match["version"]
    # NCCL before 2.5 printed no "Using network": IB wins where it came up
    if "network" not in found and used:
        found["network"] = "IB" if "IB" in used else next(iter(used))
    if "network" not in found:
        return None
    devices = used.get(_used_key(found["network"], used))
    if devices is not None:
        found["devices"] = devices[0]
        if devices[1]:
            found["oob"] = devices[1]
    found["kind"] = kind(found["network"])
    return found


def _used_key(network: str, used: Mapping[str, Any]) -> str:
    """The NET/<name> line that belongs to the chosen network ("IBext" and "IB" both print
    NET/IB)."""
    if network in used:
        return network
    return next((name for name in used if network.startswith(name) or name.startswith(network)),
                network)


def kind(network: str) -> str:
    """'ib' (InfiniBand or RoCE through verbs), 'socket' (TCP), else the plugin's own name in lower
    case."""
    if network in SOCKET_NAMES:
        return "socket"
    if network.startswith("IB"):
        return "ib"
    return network.lower()


def summary(found: Mapping[str, Any]) -> str:
    """'IB (mlx5_0:1/IB [1]mlx5_1:1/IB)': for a log line and status."""
    detail = found.get("devices") or found.get("provider") or found.get("bootstrap")
    return f"{found['network']}" + (f" ({detail})" if detail else "")


def capture_env(environ: Mapping[str, str], path: str) -> dict[str, str]:
    """The variables that make NCCL write its INIT and NET lines to ``path`` (NCCL puts the host for
    %h and the pid for %p); none where the user set ``NCCL_DEBUG`` (their choice of where NCCL talks
    stands) or ``NCCL_DEBUG_FILE``. With NCCL_DEBUG unset NCCL prints nothing, WARN lines included,
    so nothing the user would have seen is moved into the file."""
    if any(name in environ for name in ("NCCL_DEBUG", "NCCL_DEBUG_FILE")):
        return {}
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": path}


def warning(found: Mapping[str, Any], ib_devices: Sequence[str]) -> str | None:
    """Sockets between nodes while this node has InfiniBand (or RoCE, or EFA) devices: say so, with
    the fix."""
    if found.get("kind") != "socket" or not ib_devices:
        return None
    return (f"NCCL uses TCP sockets between nodes ({summary(found)}) although this node has "
            "InfiniBand devices "
            f"({', '.join(ib_devices)} in /sys/class/infiniband): collectives may be many times "
            "slower.\nHINT: "
            "look at NCCL_IB_DISABLE (unset it), NCCL_NET (unset it or set IB), NCCL_IB_HCA (name "
            "a device of "
            "the list); inside a container the verbs library (rdma-core / libibverbs) and "
            "/dev/infiniband must "
            "be there; run with dist.nccl_env={NCCL_DEBUG: INFO, NCCL_DEBUG_SUBSYS: INIT,NET} to "
            "see why NCCL "
            "passed over them")
