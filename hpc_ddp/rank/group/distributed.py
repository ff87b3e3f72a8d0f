"""The process group: backend choice, device binding, init and teardown, tiny collectives.

The decisions (``choose_backend``, ``device_index``) are pure functions so that
the NCCL path is unit-tested on machines without a GPU; ``init_process_group``
applies them. A world of one uses an in-memory store: no port, no network.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.core import limits
from hpc_ddp.rank.group import control, nccl_report, rendezvous, tiers
# raised from here
from hpc_ddp.rank.group.rendezvous import DistributedError, RendezvousError  # noqa: F401
from hpc_ddp.core.config import DistConfig
from hpc_ddp.core.errors import explain
from hpc_ddp.core.shutdown import exit_fast  # noqa: F401  (part of the library API)
from hpc_ddp.core.slurm_env import DistEnv, torch_env


log = logging.getLogger("hpc_ddp.distributed")


def rendezvous_store(env: DistEnv, timeout: timedelta,
                     peer_error: Callable[[], str | None] = lambda: None,
                     moved: Callable[[], int | None] = lambda: None,
                     announce: Callable[[int], Any] = lambda port: None) -> dist.Store:
    """The job's key-value store on MASTER_ADDR and its port (or the attempt's ports), served by
    rank 0:
    :mod:`hpc_ddp.rank.group.rendezvous`."""
    if env.rank == 0:
        return rendezvous.serve(env, timeout, announce)
    return rendezvous.join(env, timeout, peer_error, moved)


def choose_backend(requested: str, cuda_available: bool) -> str:
    """``auto`` -> NCCL on GPU nodes, gloo elsewhere; NCCL without CUDA is an error."""
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise DistributedError(explain("dist.backend=nccl but CUDA is not available on this node",
                                       expected="a GPU node with a CUDA build of torch",
                                       hint="use dist.backend=auto (gloo on CPU) or run on a GPU "
                                            "partition "
                                       "with slurm.gpus_per_node set"), key="dist.backend")
    return requested


def device_index(env: DistEnv, visible_gpus: int) -> int:
    """The GPU of this task: its local rank, or 0 when Slurm binds one GPU per task."""
    if visible_gpus == 1:
        return 0
    if visible_gpus >= env.local_world_size:
        return env.local_rank
    raise DistributedError(explain(
        f"{env.local_world_size} tasks on node {env.node_rank} but {visible_gpus} GPUs visible to "
        "each",
        expected="one GPU per task (tasks_per_node == gpus_per_node)",
        hint="set slurm.tasks_per_node equal to slurm.gpus_per_node, or check "
             "CUDA_VISIBLE_DEVICES"),
        key="slurm.tasks_per_node")


def device_for(backend: str, env: DistEnv) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", device_index(env, torch.cuda.device_count()))
    return torch.device("cpu")


def failure_env(environ: Mapping[str, str], dumps: str | None,
                new_names: bool = True) -> dict[str, str]:
    """The NCCL variables that make a failure end fast and leave a record, where the user set none.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (tear down): when a collective fails or outlives the
    process group's timeout, NCCL's watchdog thread aborts the communicator and ends the process,
    so a hung NCCL collective ends its rank (and ``srun --kill-on-bad-exit`` the step) instead of
    blocking it forever, as with 0 (no handling). Set here, it holds whatever the torch version or
    the site defaults to. torch's default since 2.2 is 3, which ends the process too but skips the
    abort (``ncclCommAbort`` can itself hang with some NCCL versions); 1 aborts first, as torch's
    default did before. The flight recorder keeps the last collectives of every group (NCCL's and,
    since torch 2.10, gloo's) and NCCL's own watchdog dumps it on a timeout into ``dumps`` + rank:
    the run dir's errors/. Our hang watchdog dumps the same record when it fires first
    (:mod:`hpc_ddp.rundir.flight`).
    ``new_names``: torch names the recorder's variables ``TORCH_FR_*`` (and warns about the old
    ``TORCH_NCCL_*`` ones); a variable the user set under either name is left alone.
    """
    names = {"buffer": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
             "file": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}
    wanted = {("TORCH_NCCL_ASYNC_ERROR_HANDLING",): "1", ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
              names["buffer"]: str(TRACE_ENTRIES), **({names["file"]: dumps} if dumps else {})}
    return {(both[0] if new_names else both[-1]): value for both, value in wanted.items()
            if not any(name in environ for name in both)}


TRACE_ENTRIES = 2000  # collectives the flight recorder keeps per process (a few hundred bytes each)


def init_process_group(env: DistEnv, cfg: DistConfig,
                       environ: MutableMapping[str, str] | None = None,
                       peer_error: Callable[[], str | None] = lambda: None,
                       dumps: str | None = None,
                       own_control_group: bool | None = None,
                       store_moves: tuple[Callable[[], int | None],
                                          Callable[[int], Any]] | None = None,
                       ) -> torch.device:
    """Join the job's process group (once) and open its CPU control group; return this rank's
    device.

    Exports the rendezvous variables, ``dist.nccl_env`` and :func:`failure_env` first: NCCL reads
    its variables when it initialises, so they must be in the environment before. On NCCL across
    nodes rank 0 also learns which network NCCL chose (:mod:`hpc_ddp.rank.group.nccl_report`), after
    one all_reduce that every rank makes (the communicator may be made lazily, at the first
    collective). ``peer_error`` says whether rank 0 already failed (see :func:`rendezvous_store`);
    ``own_control_group=False`` leaves the control traffic on a gloo default group (measurements
    only; the default gives it a gloo group of its own on every backend:
    :mod:`hpc_ddp.rank.group.control`).
    """
    backend = choose_backend(cfg.backend, torch.cuda.is_available())
    device = device_for(backend, env)
    enough_open_files(env)
    # A backstop: the hang watchdog (watchdog.py) ends a stuck job after timeout_s, names the stuck
    # ranks and dumps the flight recorder; the collectives' own timeout only says "timed out", so it
    # comes later.
    timeout = timedelta(seconds=2 * cfg.timeout_s + 30)
    # the program made it (e.g. before hpc_ddp.session())
    if dist.is_available() and dist.is_initialized():
        control.open_group(dist.get_backend(), own_control_group, timeout)
        _open_tiers(env)
        return device
    target = _exported(env, cfg, environ, dumps)
    report = nccl_report.prepare(target, env) if nccl_report.wanted(backend, env) else None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _join(backend, env, device, timeout, peer_error, store_moves)
    # every rank: the first communicator exists after one collective
    if nccl_report.wanted(backend, env):
        dist.all_reduce(torch.zeros(1, device=device))
        nccl_report.collect(report)
    control.open_group(backend, own_control_group, timeout)
    _open_tiers(env)
    return device


def _exported(env: DistEnv, cfg: DistConfig, environ: MutableMapping[str, str] | None,
              dumps: str | None) -> MutableMapping[str, str]:
    """The rendezvous variables, ``dist.nccl_env`` and :func:`failure_env` put into ``environ``
    (``os.environ`` when None), which is returned."""
    target = os.environ if environ is None else environ
    target.update({**torch_env(env), **cfg.nccl_env})
    new_names = hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    target.update(failure_env(target, dumps, new_names=new_names))
    return target


def _join(backend: str, env: DistEnv, device: torch.device, timeout: timedelta,
          peer_error: Callable[[], str | None],
          store_moves: tuple[Callable[[], int | None], Callable[[int], Any]] | None) -> None:
    """torch's default process group, on the store this world uses: in memory for a world of one,
    torchrun's agent's under torchrun, else rank 0's (:func:`rendezvous_store`)."""
    device_id = device if device.type == "cuda" else None
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    # torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE)
    elif env.source == "torchrun":
        dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size,
                                timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend,
                                store=rendezvous_store(env, timeout, peer_error,
                                                       *(store_moves or ())),
                                rank=env.rank,
                                world_size=env.world_size, timeout=timeout, device_id=device_id)


def _open_tiers(env: DistEnv) -> None:
    """The stop agreement's two levels (:mod:`hpc_ddp.rank.group.tiers`), beside the control group;
    none where the control traffic shares a gloo training group (B2's and a test's measurement of
    that, as before)."""
    if control.group() is not None:
        tiers.open_tiers(env)
    else:
        tiers.close_tiers()


def enough_open_files(env: DistEnv) -> None:
    """Raise this rank's soft limit on open files to what the world size needs (a cluster's default
    soft limit is often 1,024, its hard one far higher); rank 0 warns when even the hard limit is
    short."""
    want = limits.needed(env.world_size)
    soft, hard = limits.raise_soft_limit(want)
    problem = limits.problem(env.world_size, soft, hard)
    if problem and env.is_main:
        log.warning("%s", problem)


def default_store(token: str | None = None) -> Any:
    """The process group's key-value store (the watchdog's heartbeats go there); None if
    unavailable. ``token``: hpc_ddp's keys go under ``hpc_ddp/TOKEN/`` (the attempt's token,
    :func:`hpc_ddp.rundir.node_local.token`), so a client of the store that does not know it (anyone
    on the network can connect) cannot set one."""
    try:
        store = dist.distributed_c10d._get_default_store()  # no public accessor in torch 2.x
    except (AttributeError, RuntimeError, ValueError):
        return None
    return dist.PrefixStore(f"hpc_ddp/{token}", store) if token else store


def teardown() -> None:
    """Leave the process group after a clean end (every rank met at a barrier); safe when none
    exists."""
    tiers.close_tiers()
    control.close_group()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def abort() -> None:
    """After an error: drop every communicator at once, waiting for no peer.

    Never ``destroy_process_group()`` here: it waits for a wedged NCCL communicator (an OOM, a
    dead peer) and deadlocks, holding the job's GPUs until the walltime while ``srun
    --kill-on-bad-exit`` waits for a task to exit. The process then leaves with ``os._exit``
    (:func:`hpc_ddp.core.shutdown.exit_fast`).
    """
    tiers.close_tiers()
    control.close_group()
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        # no public name in torch 2.x; every group, NCCL's at once
        dist.distributed_c10d._abort_process_group()
    # an older torch without it, or a backend that cannot abort: os._exit follows
    except Exception as err:
        log.debug("aborting the process groups: %s", err)


@contextmanager
def process_group(env: DistEnv, cfg: DistConfig,
                  peer_error: Callable[[], str | None] = lambda: None,
                  dumps: str | None = None, own_control_group: bool | None = None,
                  store_moves: tuple[Callable[[], int | None], Callable[[int], Any]] | None = None,
                  ) -> Iterator[torch.device]:
    """``with process_group(env, cfg) as device:`` -- left by a clean teardown or, after an error,
    an abort.

    On a normal exit all ranks meet at a barrier first (on the control group), so that no rank tears
    its connections down while a peer still uses them (gloo then aborts the peer with "terminate
    called without an active exception"). After an error there is no barrier, since the other ranks
    may never arrive, and no destroy (see :func:`abort`).
    """
    device = init_process_group(env, cfg, peer_error=peer_error, dumps=dumps,
                                own_control_group=own_control_group,
                                store_moves=store_moves)
    try:
        yield device
        if env.world_size > 1:
            control.barrier()
    except BaseException:
        abort()
        raise
    teardown()


def all_mean(value: float, device: torch.device | None = None) -> float:
    """The mean of one float over all ranks (one small all_reduce on the CPU control group: reading
    a CUDA tensor back would wait for the GPU). ``device`` is accepted for older callers and
    unused."""
    return control.sum_of(value) / dist.get_world_size()


def from_main(text: str | None) -> str | None:
    """Rank 0's ``text`` on every rank (one broadcast): a refusal every rank repeats word for
    word."""
    return control.from_main(text)


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when it is True on any rank (the stop-flag agreement), on the CPU control
    group. ``device`` is accepted for older callers and unused."""
    return bool(control.max_of(torch.tensor([int(flag)], dtype=torch.int32)).item())
