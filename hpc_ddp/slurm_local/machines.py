"""What makes each local slurmd a machine of its own, as names and a start script (pure).

A real node differs from its neighbours in five ways the failure path cares about, and
each is played here by one kernel feature:

* **network**: a network namespace joined to the cluster's bridge by a veth pair, its own address in
  a private range (``10.77.0.i``; the login side is ``10.77.0.254``). A peer that loses
  it sees silence, not a reset; ``partition`` takes its link down.
* **hostname**: a UTS namespace named after the node (``hostname`` = ``SLURMD_NODENAME``).
* **filesystem**: a mount namespace where ``/tmp`` and ``/dev/shm`` are the node's own
  tmpfs and the shared root (``ClusterSpec.shared``, where runs live) is the node's own
  FUSE view (bindfs) of one backing directory, with NFS-like cache times: a file another
  node made stays absent for ``cache_s`` after this node looked it up; a name keeps the file it
  named for as long; ``flock`` locks hold between nodes.
* **cgroups**: a freezer cgroup (``freeze`` stops slurmd and every task; SIGCONT does not
  thaw them) and a cpu cgroup (``slow`` caps the node's share).

One kernel, one page cache below FUSE and one clock stay shared (docs/slurm-local.md).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

RESOLV_CONF = ("# hpc_ddp slurm-local: the nodes' names are in /etc/hosts, and no DNS server is "
               "reachable from\n"
               "# the private network: a lookup that misses fails at once instead of waiting for a "
               "timeout\n"
               "nameserver 127.0.0.1\n")
PIECES = ("network", "hostname", "filesystem", "cgroups")

def bridge(key: str) -> str:
    """The bridge of the cluster whose names carry ``key`` (at most 15 characters, as Linux
    allows)."""
    return f"hd{key}br"


@dataclass(frozen=True)
class Machine:
    """One node's names: its network namespace, the host's end of its veth, its cgroups."""

    name: str
    addr: str
    netns: str
    veth: str
    cgroup: str  # relative to each controller's root: hpc_ddp-slurm-KEY/<name>


def machine(name: str, addr: str, key: str) -> Machine:
    """Node ``name``'s names in the cluster whose names carry ``key`` (two local clusters never
    share one)."""
    return Machine(name=name, addr=addr, netns=f"hpcddp-{key}-{name}", veth=f"hd{key}{name}"[:15],
                   cgroup=f"hpc_ddp-slurm-{key}/{name}")


def bindfs_options(cache_s: int) -> str:
    """FUSE cache times as an NFS client's (``lookupcache=all``): names, present and absent, for
    ``cache_s`` seconds (0: every lookup goes to the backing directory, a coherent view). Attributes
    are fetched again at every open, as NFS's close-to-open does: with FUSE's attribute cache a
    reader's cached size would cut short a file another node appended to and closed, which NFS never
    does (measured: the batch shell missed a ledger line appended 4 s before). A bare ``stat`` is
    therefore fresher here than on NFS, where it may be ``acregmax`` old: tests/nfs_client.py plays
    that.

    ``flock`` locks reach the backing directory, so they hold between nodes as on NFSv4, Lustre and
    GPFS mounted with locking: inductor's C++ builds lock their output in a shared compile cache
    (measured: without it a rank of another node loaded a ``.so`` still being linked, "file too
    short"). Lock forwarding needs bindfs's multithreaded mode (its caveat is about permissions
    bindfs rewrites; these views rewrite none). POSIX (``fcntl``) locks forwarded are all owned by
    the one bindfs process, so they do not exclude each other through one view: nothing of hpc_ddp
    or inductor takes them."""
    return (f"entry_timeout={cache_s},negative_timeout={cache_s},attr_timeout=0,"
            "multithreaded,enable-lock-forwarding")


def kept_paths(state_root: Path, shared: Path) -> list[Path]:
    """Host folders a node must still see once its /tmp is its own: the cluster's state (pid files,
    logs, the slurmd spool) and the shared root, where they live under /tmp."""
    return [p for p in (state_root, shared) if Path("/tmp") in p.parents]


def node_script(*, name: str, isolated: tuple[str, ...], netns: str, cgroup_dirs: dict[str, Path],
                state_root: Path, shared: Path, cache_s: int, slurmd: list[str], bindfs_pid: Path,
                resolv_conf: Path, bindfs_log: Path = Path("/dev/null")) -> str:
    """The bash script that starts one slurmd as a machine: outside, it joins the node's cpu cgroup
    and network namespace; inside its own mount and UTS namespaces, it names the node, makes /tmp
    and /dev/shm its own, gives it a resolver that answers at once (``RESOLV_CONF``: the nodes'
    names come from /etc/hosts; the host's DNS server is out of the private network's reach, and a
    lookup would wait seconds for it), mounts its view of the shared root, joins the freezer cgroup
    (bindfs stays out of it: a frozen node's kernel NFS client would not be frozen either) and
    becomes slurmd."""
    q = shlex.quote
    outside = ["set -euo pipefail", 'if [ "${1:-}" != inside ]; then']
    if "cgroups" in isolated and "cpu" in cgroup_dirs:
        outside.append(f"  echo $$ > {q(str(cgroup_dirs['cpu'] / 'cgroup.procs'))}")
    enter = []
    if "network" in isolated:
        enter = ["nsenter", f"--net=/run/netns/{netns}"]
    namespaces = [flag for piece, flag in (("filesystem", "--mount"), ("hostname", "--uts"))
                  if piece in isolated]
    if namespaces:
        enter += ["unshare", *namespaces, "--propagation", "private"]
    outside.append(f"  exec {' '.join(q(p) for p in enter)} bash \"$0\" inside" if enter
                   else '  exec bash "$0" inside')
    outside.append("fi")
    inside = []
    if "hostname" in isolated:
        inside.append(f"hostname {q(name)}")
    if "filesystem" in isolated:
        kept = kept_paths(state_root, shared)
        for fd, path in enumerate(kept, start=3):
            inside.append(f"mkdir -p {q(str(path))}; exec {fd}<{q(str(path))}")
        inside.append("mount -t tmpfs -o mode=1777 tmpfs /tmp")
        for fd, path in enumerate(kept, start=3):
            inside.append(f"mkdir -p {q(str(path))}; mount --no-canonicalize --bind "
                          f"/proc/self/fd/{fd} {q(str(path))}; exec {fd}<&-")
        inside += ["mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
                   *([f"mount --bind {q(str(resolv_conf))} /etc/resolv.conf"]
                     if "network" in isolated else []),
                   f"mkdir -p {q(str(shared))}",
                   f"bindfs -f -o {bindfs_options(cache_s)} {q(str(shared))} {q(str(shared))} "
                   f"</dev/null >>{q(str(bindfs_log))} 2>&1 &",
                   f"echo $! > {q(str(bindfs_pid))}",
                   f"for _ in $(seq 100); do findmnt -rn -t fuse -M {q(str(shared))} >/dev/null && "
                   "break; "
                   "sleep 0.05; done",
                   f"findmnt -rn -t fuse -M {q(str(shared))} >/dev/null || {{ echo "
                   f"{q(f'bindfs did not mount {shared} (see {bindfs_log})')} >&2; exit 1; }}"]
    if "cgroups" in isolated and "freezer" in cgroup_dirs:
        inside.append(f"echo $$ > {q(str(cgroup_dirs['freezer'] / 'cgroup.procs'))}")
    inside.append(f"exec {' '.join(q(p) for p in slurmd)}")
    return "\n".join(["#!/bin/bash", f"# {name} as a machine of its own "
                                     "(hpc_ddp.slurm_local.machines)",
                      *outside, *inside]) + "\n"
