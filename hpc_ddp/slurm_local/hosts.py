"""The node names of the throw-away cluster in the host's /etc/hosts, added and taken out again.

Every node name must resolve (it is a rank's MASTER_ADDR), so a start adds one tagged line per
node and a stop removes exactly the lines with this cluster's tag. Apart from
:mod:`hpc_ddp.slurm_local.daemons` because it edits a file of the host, not a daemon: the file
is edited in place (it is often a bind mount, where a rename fails).
"""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.core.errors import ClusterError, explain
from hpc_ddp.slurm_local.conf import ClusterSpec, hosts_lines, hosts_tag

HOSTS_FILE = Path("/etc/hosts")


def add_hosts(spec: ClusterSpec) -> None:
    """Add node names to /etc/hosts in place (it is often a bind mount: no rename)."""
    try:
        kept = [line for line in HOSTS_FILE.read_text().splitlines()
                if not line.endswith(hosts_tag(spec))]
        HOSTS_FILE.write_text("\n".join(kept + hosts_lines(spec)) + "\n")
    except OSError as err:
        raise ClusterError(explain(f"cannot add the node names to {HOSTS_FILE}: {err.strerror}",
                                   hint="run as root; node names must resolve for "
                                        "MASTER_ADDR")) from None


def remove_hosts(spec: ClusterSpec) -> None:
    """Take this cluster's tagged lines out of /etc/hosts (none there: the file is left as is)."""
    try:
        lines = HOSTS_FILE.read_text().splitlines()
        if any(line.endswith(hosts_tag(spec)) for line in lines):
            kept = (line for line in lines if not line.endswith(hosts_tag(spec)))
            HOSTS_FILE.write_text("\n".join(kept) + "\n")
    except OSError:
        pass
