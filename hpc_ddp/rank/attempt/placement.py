"""Where this rank landed, checked at its start, before its first collective: CPUs, GPUs and
network.

:func:`check` reads the rank's CPU affinity and visible GPUs and refuses a rank bound below what the
run asked for (:mod:`hpc_ddp.core.binding`); it posts the rank's view in its node's folder on
node-local storage, where the node's first rank gathers the node's views into one log line (per
node, not per rank: nothing of it goes to the shared run dir). In a job that spans nodes it then
makes sure gloo and NCCL will not bind loopback (:mod:`hpc_ddp.core.netplan`) and returns the
variables to export before the process group starts. Every side effect sits behind :class:`Seams`,
so tests set the resolver, the routes and the interface list.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.core import binding, netplan
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rundir import beats, node_local
from hpc_ddp.rundir.ledger import attempt_tag

log = logging.getLogger("hpc_ddp.placement")
# how long a node's first rank waits for its peers' views before it logs what it has
SUMMARY_WAIT_S = 10.0
POLL_S = 0.05
SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
# Fault injection (tests): "0" narrows this task to CPU 0 before the check, as a binding srun would;
# the test cluster's slurmd (TaskPlugin=task/none) binds no task, so a real job shows the refusal
# only this way.
FAULT_CPUS_VAR = "HPC_DDP_FAULT_CPUS"


def resolve(host: str) -> tuple[str, ...]:
    """``host``'s addresses in the resolver's order (gloo binds the first it can), or () when it
    does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ()
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


def route_source(address: str) -> str | None:
    """This node's source address for packets to ``address``: a UDP connect sends nothing, it only
    routes."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def interfaces() -> dict[str, tuple[str, ...]]:
    """Every interface's addresses: IPv4 from the kernel (SIOCGIFADDR), IPv6 from
    /proc/net/if_inet6."""
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in found:
            try:
                packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
                found[name].append(socket.inet_ntoa(packed[20:24]))
            except OSError:
                pass  # no IPv4 address (or a bridge without one)
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) == 6 and fields[5] in found:
                found[fields[5]].append(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0])))
    except OSError:
        pass
    return {name: tuple(addrs) for name, addrs in found.items()}


def visible_gpus() -> int:
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES applied), as the device choice will count
    them."""
    import torch

    return int(torch.cuda.device_count())


@dataclass(frozen=True)
class Seams:
    """The side effects of :func:`check`, replaced in tests."""

    affinity: Callable[[], set[int]] = lambda: set(os.sched_getaffinity(0))
    machine_cpus: Callable[[], int] = lambda: os.cpu_count() or 1
    visible_gpus: Callable[[], int] = visible_gpus
    hostname: Callable[[], str] = socket.gethostname
    resolve: Callable[[str], tuple[str, ...]] = resolve
    route_source: Callable[[str], str | None] = route_source
    interfaces: Callable[[], Mapping[str, tuple[str, ...]]] = interfaces


def check(cfg: RunConfig, env: DistEnv, environ: Mapping[str, str],
          seams: Seams = Seams()) -> dict[str, str]:
    """Refuse a rank bound below the run's ask (BindingError) or one whose collectives would bind
    loopback across nodes with no way out (NetworkError); return the network variables to export
    (empty: none)."""
    local = environ.get("HPC_DDP_LOCAL") == "1"
    if environ.get(FAULT_CPUS_VAR):
        os.sched_setaffinity(0, {int(cpu) for cpu in environ[FAULT_CPUS_VAR].split(",")})
    view = read_view(cfg, env, environ, seams)
    # The rehearsal plays every node on this one machine: its simulated nodes share the machine's
    # cores and GPUs, so a view below the ask says nothing about the cluster. It is logged, never
    # refused.
    if not local:
        said = binding.check_cpus(view, cfg.slurm.cpus_per_task, environ)
        if said and env.is_node_main:
            log.warning("%s", said)
        binding.check_gpus(view, cfg.slurm.gpus_per_node, cfg.slurm.tasks_per_node,
                           env.local_world_size)
    post_view(cfg, env, view, " (rehearsal: not checked, the simulated nodes share this machine)"
              if local else "")
    if env.num_nodes <= 1:
        return {}
    # dist.nccl_env is exported before the process group starts and wins: a variable named there is
    # the user's
    plan = netplan.plan({**environ, **cfg.dist.nccl_env}, env.num_nodes, facts(env, seams))
    if plan.note and env.is_node_main:
        # once per node: the choice changes where this node's collectives go
        log.warning("%s", plan.note)
    return plan.exports


def read_view(cfg: RunConfig, env: DistEnv, environ: Mapping[str, str],
              seams: Seams) -> binding.View:
    gpus = seams.visible_gpus() if cfg.slurm.gpus_per_node > 0 else None
    return binding.View(rank=env.rank, local_rank=env.local_rank,
                        host=environ.get("SLURMD_NODENAME") or seams.hostname(),
                        cpus=tuple(sorted(seams.affinity())),
                        machine_cpus=seams.machine_cpus(), visible_gpus=gpus,
                        cuda_visible=environ.get("CUDA_VISIBLE_DEVICES"))


def facts(env: DistEnv, seams: Seams) -> netplan.Facts:
    """What gloo will resolve, and (only where that is loopback) where MASTER_ADDR is, seen from
    this node: the usual case costs the one lookup of the hostname that gloo makes anyway."""
    host = seams.hostname()
    host_addrs = seams.resolve(host)
    if host_addrs and not netplan.is_loopback(host_addrs[0]):
        return netplan.Facts(hostname=host, host_addrs=host_addrs, master_addr=env.master_addr,
                             master_addrs=(),
                             route_source=None)
    masters = seams.resolve(env.master_addr)
    source = seams.route_source(masters[0]) if masters else None
    return netplan.Facts(hostname=host, host_addrs=host_addrs, master_addr=env.master_addr,
                         master_addrs=masters,
                         route_source=source, interfaces=seams.interfaces())


def node_folder(cfg: RunConfig, env: DistEnv) -> Path:
    return beats.node_dir(cfg.run_dir, attempt_tag(env.job_id, env.restart_count, env.in_job),
                          env.node_rank)


def post_view(cfg: RunConfig, env: DistEnv, view: binding.View, suffix: str = "") -> None:
    """Every rank leaves its view in the node's folder; the node's first rank logs them in one
    line."""
    line = view.line()
    if env.local_world_size < 2:
        _log_node(env, view.host, [line], suffix)
        return
    folder = node_folder(cfg, env)
    try:
        node_local.ensure(folder)  # private and this user's, or refused
        write_atomic(folder / f"binding-{env.local_rank}.txt", line)
    # no node-local storage: this rank's line alone, where it can still be seen
    except OSError as err:
        log.warning("%s (could not post it for the node's line: %s)", line, err)
    if env.is_node_main:
        threading.Thread(target=_gather, args=(folder, env, view.host, suffix), name="binding-line",
                         daemon=True).start()


def _gather(folder: Path, env: DistEnv, host: str, suffix: str) -> None:
    """The node's first rank: the node's views, once all are there or after
    :data:`SUMMARY_WAIT_S`."""
    deadline = time.monotonic() + SUMMARY_WAIT_S
    names = [folder / f"binding-{local}.txt" for local in range(env.local_world_size)]
    while time.monotonic() < deadline and not all(name.exists() for name in names):
        time.sleep(POLL_S)
    lines = []
    for name in names:
        raw = node_local.read(name, 1 << 16)  # this user's file, never through a link
        if raw is not None:
            lines.append(raw.decode(errors="replace"))
    _log_node(env, host, lines, suffix)


def _log_node(env: DistEnv, host: str, lines: list[str], suffix: str) -> None:
    if not log.isEnabledFor(logging.INFO):
        # a node's first rank that is not rank 0 logs warnings only, but this line too
        log.setLevel(logging.INFO)
    log.info("%s%s", binding.node_line(host, env.node_rank, env.num_nodes, lines,
                                       env.local_world_size), suffix)

