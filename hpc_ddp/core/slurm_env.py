"""Derive every process's place in a distributed job from its environment.

Pure functions of a ``Mapping[str, str]``: no ``os.environ``, no ``scontrol``,
no torch. The worker passes ``os.environ``; tests and the local simulation pass
dicts. Three sources, tried in this order:

* ``torchrun``: RANK / LOCAL_RANK / WORLD_SIZE are present (also torchrun
  started by srun, one agent per node). They win over Slurm's variables.
* ``slurm``: a task of an ``srun`` step (SLURM_STEP_ID is present; the batch
  shell has SLURM_PROCID=0 too, but no step id). Step variables (SLURM_STEP_*)
  win over job variables where both exist.
* ``single``: neither; one process, rank 0 of 1.

MASTER_ADDR is the first host of the node list; MASTER_PORT is
:func:`master_port` of the job id, in [20000, 31999], below Linux's ephemeral range (32768-60999) so
that no outgoing connection holds it. An explicit MASTER_ADDR / MASTER_PORT in the environment wins.
Inside a run, the worker sets MASTER_PORT first: one of the attempt's unguessable ports
(:mod:`hpc_ddp.core.store_ports`), unless you chose one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpc_ddp.core import foreign_env, store_ports
from hpc_ddp.core.errors import SlurmEnvError, explain
from hpc_ddp.core.hostlist import compress_hostlist, expand_hostlist
from hpc_ddp.core.slurm_vars import SRUN_HINT, check_below, int_var, lookup, required_int, var_name

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 12000
SINGLE_PROCESS_PORT = 29500  # torch's own default, for a process outside any job

# Variables in order of preference: the step's view first, then the job's.
WORLD_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
NUM_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
# set by the batch shell's supervisor on each step it restarts in the job
IN_JOB_VAR = "HPC_DDP_IN_JOB_RESTART"
# set by the batch shell that submitted this job (requeue refused: a chain)
CHAINED_VAR = "HPC_DDP_CHAINED_FROM"
# and JSON for that step's ledger line: what failed, what was left out and why
HEALED_VAR = "HPC_DDP_HEALED"
STEP_ID_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")

@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job; everything torch.distributed needs."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: int | None = None
    array_task_id: int | None = None
    restart_count: int = 0
    # the in-job restart (a step the batch shell started after a failed one), 0 for the first
    in_job: int = 0
    # the job that submitted this one where Slurm refuses requeue (a chain)
    chained_from: int | None = None
    nodelist: tuple[str, ...] = ()
    source: str = "single"  # "slurm" | "torchrun" | "single"
    # the attempt's rendezvous ports, first = master_port (core/store_ports.py)
    store_ports: tuple[int, ...] = ()
    # the key that proves a store is the attempt's own; None: believe it as it is
    store_key: str | None = None

    @property
    def is_main(self) -> bool:
        """Global rank 0: writes metrics and the ledger, requeues the job."""
        return self.rank == 0

    @property
    def is_node_main(self) -> bool:
        """Local rank 0: writes its node's snapshot file."""
        return self.local_rank == 0


def master_port(job_id: int, array_task_id: int | None = None) -> int:
    """The rendezvous port of a job: same on every node, different for nearby jobs.

    For an array element pass the array's job id (SLURM_ARRAY_JOB_ID) and its
    task id, so elements of one array get consecutive ports. Jobs whose key
    (job id + array task id) differs by less than 12000 never share a port.
    """
    return MASTER_PORT_BASE + (job_id + (array_task_id or 0)) % MASTER_PORT_SPAN


_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(text: str, var: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand SLURM_TASKS_PER_NODE (or ``var``, the variable it came from): ``'2(x3),1'`` -> ``[2,
    2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if not match or not 0 < len(match.group(1)) <= 6 or len(match.group(2) or "") > 6:
            raise SlurmEnvError(explain(
                f"cannot read tasks per node {text!r}: item {item!r}",
                expected="comma-separated counts, each 'N' or 'N(xR)', e.g. '2(x3),1'",
                hint=f"this value comes from {var}; do not set it by hand"), key=var)
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _nodelist(env: Mapping[str, str]) -> tuple[str, ...]:
    found = lookup(env, NODELIST_VARS)
    if found is None:
        return ()
    try:
        return tuple(expand_hostlist(found[1]))
    except SlurmEnvError as err:
        raise SlurmEnvError(f"{found[0]}: {err}", key=found[0]) from None


def _rendezvous(env: Mapping[str, str], nodelist: tuple[str, ...]) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT: explicit values win, else derived from the job."""
    addr = env.get("MASTER_ADDR", "").strip() or (nodelist[0] if nodelist else "")
    if not addr:
        raise SlurmEnvError(explain("cannot tell the rendezvous address",
                                    found=env.get("MASTER_ADDR"),
                                    expected=f"MASTER_ADDR or one of {', '.join(NODELIST_VARS)}",
                                    hint="export MASTER_ADDR=<host of rank 0>"), key="MASTER_ADDR")
    port = _explicit_port(env)
    if port is None:
        job_id = int_var(env, ("SLURM_ARRAY_JOB_ID",)) or int_var(env, JOB_ID_VARS)
        if job_id is None:
            raise SlurmEnvError(explain("cannot derive the rendezvous port",
                                        expected="SLURM_JOB_ID or MASTER_PORT",
                                        hint="export MASTER_PORT=<free port>"), key="MASTER_PORT")
        port = master_port(job_id, int_var(env, ("SLURM_ARRAY_TASK_ID",)))
    return addr, port


def rendezvous_endpoint(env: Mapping[str, str]) -> tuple[str, int]:
    """The job's rendezvous host and port, from the batch shell or any task of the job.

    The same rule as every task's MASTER_ADDR/MASTER_PORT (first node; port from the job
    id), so the torchrun template's c10d endpoint needs no ``scontrol``.
    """
    return _rendezvous(env, _nodelist(env))


def _explicit_port(env: Mapping[str, str]) -> int | None:
    """MASTER_PORT from the environment, checked to be a port; None when unset."""
    port = int_var(env, ("MASTER_PORT",), minimum=1, hint="export MASTER_PORT=<free port, e.g. "
                                                          "29500>")
    if port is not None and port > 65535:
        raise SlurmEnvError(explain("MASTER_PORT is not a port", found=env.get("MASTER_PORT"),
                                    expected="1..65535", hint="export MASTER_PORT=29500"),
                            key="MASTER_PORT")
    return port


def _store(env: Mapping[str, str], port: int) -> dict[str, Any]:
    ports, key = store_ports.from_environ(env, port)
    return {"store_ports": ports, "store_key": key} if key else {}


def _job_fields(env: Mapping[str, str]) -> dict[str, Any]:
    return {"job_id": int_var(env, JOB_ID_VARS),
            "array_task_id": int_var(env, ("SLURM_ARRAY_TASK_ID",)),
            "restart_count": int_var(env, ("SLURM_RESTART_COUNT",)) or 0,
            "in_job": int_var(env, (IN_JOB_VAR,)) or 0,
            "chained_from": int_var(env, (CHAINED_VAR,))}


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    world_size = required_int(env, WORLD_SIZE_VARS, minimum=1)
    rank = required_int(env, ("SLURM_PROCID",))
    check_below("SLURM_PROCID", rank, var_name(env, WORLD_SIZE_VARS), world_size)
    nodelist = _nodelist(env)
    if not nodelist:
        raise SlurmEnvError(explain("no node list in a Slurm task",
                                    expected=" or ".join(NODELIST_VARS),
                                    hint=SRUN_HINT), key=NODELIST_VARS[1])
    num_nodes = int_var(env, NUM_NODES_VARS, minimum=1) or len(nodelist)
    if num_nodes != len(nodelist):
        raise SlurmEnvError(explain(f"{var_name(env, NUM_NODES_VARS)}={num_nodes} but the node "
                                    "list "
                                    f"names {len(nodelist)} nodes", found=",".join(nodelist[:8]),
                                    expected="as many nodes as the count says", hint=SRUN_HINT),
                            key=var_name(env, NUM_NODES_VARS))
    tasks_var = lookup(env, TASKS_PER_NODE_VARS)
    if tasks_var is None:
        raise SlurmEnvError(explain("environment variable SLURM_TASKS_PER_NODE is missing",
                                    expected="e.g. '2(x2)'", hint=SRUN_HINT),
                            key="SLURM_TASKS_PER_NODE")
    tasks = parse_tasks_per_node(tasks_var[1], tasks_var[0])
    if len(tasks) != num_nodes or sum(tasks) != world_size:
        raise SlurmEnvError(explain(f"{tasks_var[0]} does not match {num_nodes} nodes and "
                                    f"{world_size} tasks",
                                    found=tasks_var[1],
                                    expected=f"{num_nodes} counts adding up to {world_size}",
                                    hint=SRUN_HINT), key=tasks_var[0])
    node_rank = required_int(env, ("SLURM_NODEID",))
    check_below("SLURM_NODEID", node_rank, "number of nodes", num_nodes)
    local_rank = required_int(env, ("SLURM_LOCALID",))
    check_below("SLURM_LOCALID", local_rank, f"tasks on node {node_rank}", tasks[node_rank])
    addr, port = _rendezvous(env, nodelist)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size,
                   local_world_size=tasks[node_rank], node_rank=node_rank, num_nodes=num_nodes,
                   master_addr=addr, master_port=port, nodelist=nodelist, source="slurm",
                   **_job_fields(env), **_store(env, port))


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    hint = ("torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE together; unset stray "
            "ones")
    rank, local_rank = (required_int(env, (v,), hint=hint) for v in ("RANK", "LOCAL_RANK"))
    world_size, local_world_size = (required_int(env, (v,), minimum=1, hint=hint)
                                    for v in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    check_below("RANK", rank, "WORLD_SIZE", world_size)
    check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    check_below("LOCAL_WORLD_SIZE", local_world_size - 1, "WORLD_SIZE", world_size)
    num_nodes = int_var(env, ("GROUP_WORLD_SIZE",), minimum=1,
                        hint=hint) or -(-world_size // local_world_size)
    node_rank = int_var(env, ("GROUP_RANK",), hint=hint)
    node_rank = rank // local_world_size if node_rank is None else node_rank
    check_below("GROUP_RANK", node_rank, "number of nodes", num_nodes)
    nodelist = _nodelist(env)
    addr, port = _rendezvous(env, nodelist)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size,
                   local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes,
                   master_addr=addr, master_port=port, nodelist=nodelist, source="torchrun",
                   **_job_fields(env))


def from_environ(env: Mapping[str, str]) -> DistEnv:
    """Derive this process's :class:`DistEnv`; raise :class:`SlurmEnvError` with a HINT. Inside a
    Slurm step, torchrun's names set by anything but torchrun do not count
    (:mod:`hpc_ddp.core.foreign_env`)."""
    env = foreign_env.slurm_view(env)
    if any(name in env for name in TORCHRUN_VARS):
        return _from_torchrun(env)
    if lookup(env, STEP_ID_VARS):
        return _from_slurm(env)
    job = lookup(env, JOB_ID_VARS)
    if job:
        raise SlurmEnvError(explain(f"inside Slurm job {job[1]} but not in a task launched by srun "
                                    "(SLURM_STEP_ID is not set: this is the batch script or salloc "
                                    "shell)",
                                    expected="one process per task, started by srun",
                                    hint=SRUN_HINT),
                            key="SLURM_STEP_ID")
    addr = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    port = _explicit_port(env) or SINGLE_PROCESS_PORT
    return DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                   master_addr=addr, master_port=port, source="single", **_job_fields(env))


def torch_env(dist_env: DistEnv) -> dict[str, str]:
    """The variables torch's ``env://`` rendezvous (and most libraries) read."""
    return {"MASTER_ADDR": dist_env.master_addr, "MASTER_PORT": str(dist_env.master_port),
            "RANK": str(dist_env.rank), "WORLD_SIZE": str(dist_env.world_size),
            "LOCAL_RANK": str(dist_env.local_rank),
            "LOCAL_WORLD_SIZE": str(dist_env.local_world_size)}


def simulated_environ(nodes: int, tasks_per_node: int, *, job_id: int, restart_count: int = 0,
                      node_prefix: str = "node", hosts: Sequence[str] | None = None,
                      ranks: Sequence[int] | None = None) -> list[dict[str, str]]:
    """The Slurm variables srun would give each task of a nodes x tasks_per_node step (``ranks``:
    only those global ranks', for a view of a big job that shows a few).

    Used by the local simulation and ``hpc_ddp.whoami --simulate``; names are
    compressed as Slurm does (``node[0-1]``, ``2(x2)``).
    """
    hosts = list(hosts) if hosts else [f"{node_prefix}{i}" for i in range(nodes)]
    common = {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0",
              "SLURM_NTASKS": str(nodes * tasks_per_node),
              "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": compress_hostlist(hosts),
              "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})" if nodes > 1
              else str(tasks_per_node),
              "SLURM_RESTART_COUNT": str(restart_count)}
    chosen = range(nodes * tasks_per_node) if ranks is None else ranks
    return [{**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % tasks_per_node),
             "SLURM_NODEID": str(r // tasks_per_node),
             "SLURMD_NODENAME": hosts[r // tasks_per_node]} for r in chosen]
