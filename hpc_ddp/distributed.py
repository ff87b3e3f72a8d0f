"""The process group: backend choice, device binding, init and teardown, tiny collectives.

The decisions (``choose_backend``, ``device_index``) are pure functions so that
the NCCL path is unit-tested on machines without a GPU; ``init_process_group``
applies them. A world of one uses an in-memory store: no port, no network.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.config import DistConfig
from hpc_ddp.errors import HpcDdpError, explain
from hpc_ddp.shutdown import exit_fast  # noqa: F401  (part of the library API)
from hpc_ddp.slurm_env import DistEnv, torch_env


class DistributedError(HpcDdpError):
    """The process group cannot be set up as configured on this node."""


PEER_POLL_S = 0.5  # how often a rank waiting for rank 0's store looks for an error rank 0 recorded


def _port_taken(err: BaseException) -> bool:
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def rendezvous_store(env: DistEnv, timeout: timedelta,
                     peer_error: Callable[[], str | None] = lambda: None) -> dist.Store:
    """The job's key-value store on MASTER_ADDR:MASTER_PORT, served by rank 0 (what ``env://`` does).

    Done here for two answers ``env://`` cannot give: a port already taken on the first node
    is an error that names the port, the node and the fix (``env://`` raises a bare
    DistNetworkError on rank 0, and the other ranks wait out the whole timeout, or talk to
    whatever holds the port); and while the other ranks wait to connect, ``peer_error()`` tells
    them whether rank 0 failed (it records its error in the run dir), so every rank stops
    within seconds with rank 0's message.
    """
    host, port = env.master_addr, env.master_port
    if env.rank == 0:
        try:
            return dist.TCPStore(host, port, env.world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as err:
            if not _port_taken(err):
                raise
            raise DistributedError(explain(
                f"the rendezvous port {port} on {host} (node 0, rank 0's host) is already in use by another "
                "program", expected="a free TCP port for rank 0 to serve the job's rendezvous on",
                hint="set dist.master_port=PORT to a port that is free on the job's first node (or unset "
                "MASTER_PORT if you exported it); by default the port is derived from the job id "
                "(docs/derivation.md)"), key="dist.master_port") from None
    box: dict[str, Any] = {}

    def connect() -> None:  # blocks in recv while a foreign program holds the port: hence a thread
        try:
            box["store"] = dist.TCPStore(host, port, env.world_size, is_master=False, timeout=timeout)
        except BaseException as err:  # handed to the caller below
            box["error"] = err

    thread = threading.Thread(target=connect, name="rendezvous", daemon=True)
    thread.start()
    while thread.is_alive() or "error" in box:
        thread.join(PEER_POLL_S)
        message = peer_error()
        if message:
            raise DistributedError(f"the job cannot start, so rank {env.rank} stops too: {message}",
                                   key="dist.master_port" if "rendezvous port" in message else None)
        if "error" in box:
            raise DistributedError(explain(
                f"rank {env.rank} could not reach rank 0's rendezvous at {host}:{port} within "
                f"{timeout.total_seconds():g}s: {str(box['error']).splitlines()[0]}",
                hint="look at rank 0's log: it failed or never started; if another program holds the port "
                f"on {host}, set dist.master_port=PORT to a free one"), key="dist.master_port") from None
    return box["store"]


def choose_backend(requested: str, cuda_available: bool) -> str:
    """``auto`` -> NCCL on GPU nodes, gloo elsewhere; NCCL without CUDA is an error."""
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise DistributedError(explain("dist.backend=nccl but CUDA is not available on this node",
                                       expected="a GPU node with a CUDA build of torch",
                                       hint="use dist.backend=auto (gloo on CPU) or run on a GPU partition "
                                       "with slurm.gpus_per_node set"), key="dist.backend")
    return requested


def device_index(env: DistEnv, visible_gpus: int) -> int:
    """The GPU of this task: its local rank, or 0 when Slurm binds one GPU per task."""
    if visible_gpus == 1:
        return 0
    if visible_gpus >= env.local_world_size:
        return env.local_rank
    raise DistributedError(explain(
        f"{env.local_world_size} tasks on node {env.node_rank} but {visible_gpus} GPUs visible to each",
        expected="one GPU per task (tasks_per_node == gpus_per_node)",
        hint="set slurm.tasks_per_node equal to slurm.gpus_per_node, or check CUDA_VISIBLE_DEVICES"),
        key="slurm.tasks_per_node")


def device_for(backend: str, env: DistEnv) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", device_index(env, torch.cuda.device_count()))
    return torch.device("cpu")


def init_process_group(env: DistEnv, cfg: DistConfig, environ: MutableMapping[str, str] | None = None,
                       peer_error: Callable[[], str | None] = lambda: None) -> torch.device:
    """Join the job's process group (once); return this rank's device.

    Exports the rendezvous variables and ``dist.nccl_env`` first: NCCL reads its
    variables when it initialises, so they must be in the environment before.
    ``peer_error`` says whether rank 0 already failed (see :func:`rendezvous_store`).
    """
    backend = choose_backend(cfg.backend, torch.cuda.is_available())
    device = device_for(backend, env)
    if dist.is_available() and dist.is_initialized():
        return device
    target = os.environ if environ is None else environ
    target.update({**torch_env(env), **cfg.nccl_env})
    # A backstop: the hang watchdog (watchdog.py) ends a stuck job after timeout_s and names the stuck
    # ranks; the collectives' own timeout only says "timed out", so it is set to come later.
    timeout = timedelta(seconds=2 * cfg.timeout_s + 30)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_id = device if device.type == "cuda" else None
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif env.source == "torchrun":  # torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE)
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, store=rendezvous_store(env, timeout, peer_error), rank=env.rank,
                                world_size=env.world_size, timeout=timeout, device_id=device_id)
    return device


def default_store() -> Any:
    """The process group's key-value store (the watchdog's heartbeats go there); None if unavailable."""
    try:
        return dist.distributed_c10d._get_default_store()  # no public accessor in torch 2.x
    except (AttributeError, RuntimeError, ValueError):
        return None


def teardown() -> None:
    """Leave the process group; safe to call when none exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(env: DistEnv, cfg: DistConfig,
                  peer_error: Callable[[], str | None] = lambda: None) -> Iterator[torch.device]:
    """``with process_group(env, cfg) as device:`` -- teardown runs on every exit path.

    On a normal exit all ranks meet at a barrier first, so that no rank tears its
    connections down while a peer still uses them (gloo then aborts the peer with
    "terminate called without an active exception"). After an error there is no
    barrier: the other ranks may never arrive.
    """
    device = init_process_group(env, cfg, peer_error=peer_error)
    try:
        yield device
        if env.world_size > 1:
            dist.barrier()
    finally:
        teardown()


def all_mean(value: float, device: torch.device) -> float:
    """The mean of one float over all ranks (one small all_reduce)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def from_main(text: str | None) -> str | None:
    """Rank 0's ``text`` on every rank (one broadcast): a refusal every rank repeats word for word."""
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is True on any rank (the stop-flag agreement)."""
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())
