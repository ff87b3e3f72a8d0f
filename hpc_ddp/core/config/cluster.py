"""The cluster's sections of the run config's schema: ``slurm`` (with its ``container``) and
``dist``, what a run asks of the cluster and how its processes find each other; and the field
helpers every section declares its keys with (a default and its documentation, from which
docs/config.md is generated).

Apart from :mod:`hpc_ddp.core.config.schema` (the run's own sections and the whole
:class:`RunConfig`) so each module holds one side of the schema: these are the keys a cluster
profile sets; the training loop's and the snapshots' are the run's. No omegaconf here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from hpc_ddp.core.config.rules import LIVENESS_S


def doc(default: Any, text: str) -> Any:
    """A key with its default and its documentation (``metadata["doc"]``)."""
    return field(default=default, metadata={"doc": text})


def doc_factory(factory: Any, text: str) -> Any:
    """A key whose default ``factory`` makes (a list, a mapping, a section), documented."""
    return field(default_factory=factory, metadata={"doc": text})


@dataclass
class ContainerConfig:
    """The container every rank runs in; runtime null: none (docs: Your cluster, containers)."""

    runtime: Optional[str] = doc(None, "pyxis (srun --container-image, enroot), apptainer or "
                                 "singularity (every rank runs as RUNTIME exec [--nv] --bind ... "
                                 "IMAGE COMMAND); it wraps every step of the job: the first, the "
                                 "healing ones, the probes. null: no container; "
                                 "slurm.container=null drops one an earlier file set.")
    image: str = doc("", "The image: for pyxis what --container-image takes "
                     "(nvcr.io#nvidia/pytorch:24.05-py3, a .sqsh file); for apptainer and "
                     "singularity a .sif file (or docker://...).")
    mounts: List[str] = doc_factory(list, "Host paths to mount besides the run dir and the submit "
                                    "directory (always mounted at their own paths), each "
                                    "SRC[:DST[:OPTS]], e.g. /scratch/data:/data:ro.")
    args: List[str] = doc_factory(list, "More arguments for the runtime: pyxis: srun options "
                                  "(['--container-env=HOME']); apptainer: exec options before the "
                                  "image (['--writable-tmpfs']; not --cleanenv or --containall, "
                                  "which hide Slurm's variables from the ranks).")
    python: str = doc("python3", "The Python inside the image that runs every rank (torch, hpc_ddp "
                      "and, for submit's own jobs, submitit must import there).")


@dataclass
class StragglerConfig:
    """A slow node named (docs: Failures and stops, a slow node)."""

    action: str = doc("warn", "warn: a node whose ranks stay busier per step (on a CPU, or "
                      "waiting for one) than slurm.straggler.ratio x the other nodes' median is "
                      "named in the log, the ledger, status and metrics; replace: named, then "
                      "every rank stops at the next boundary with a snapshot and the batch shell "
                      "goes on without the node, on a spare (slurm.spare_nodes) or fewer nodes (a "
                      "slurm.nodes range), losing no step (without either it only warns); off: "
                      "nothing is measured. A train.script has no boundary to measure at.")
    ratio: float = doc(1.4, "How much busier per step than the other nodes' median a slow node's "
                       "ranks are (a number > 1). Each window above it counts toward naming, each "
                       "below it against (docs/faults.md, a slow node).")
    windows: int = doc(3, "A node busy ratio^2 x the others' is named after this many windows; one "
                       "barely above the ratio later; a named node is said to be well again after "
                       "this many windows with nothing above it.")
    window_steps: int = doc(10, "Steps per window: each rank's figure rides on the boundary's "
                            "agreement once a window.")


@dataclass
class HealthConfig:
    """Sick nodes kept out (docs: Failures and stops, the health check)."""

    checks: str = doc("off", "Before the first step of every attempt, each node's first rank "
                      "measures: quick: writing and reading the run dir and node-local storage "
                      "(8 MB each), a matmul and, on a GPU, a memory test (256 MB); full: 64 MB "
                      "each (1 GB of device memory), and each node's link to the next node (16 MB "
                      "each way); off: nothing. A node far below the other nodes' median is named "
                      "(log, ledger, status).")
    action: str = doc("replace", "replace: a node named sick is left out as a slow node is "
                      "(slurm.straggler.action=replace: every rank stops at the first boundary, "
                      "the job goes on on a spare or fewer nodes); warn: named and kept.")
    below: float = doc(0.3, "A node whose figure is under this fraction of the other nodes' "
                       "median is sick (0 < below < 1).")


@dataclass
class SlurmConfig:
    """What to ask Slurm for, and how often a run may be requeued."""

    nodes: Union[int, str] = doc(1, "Number of nodes, or a range MIN-MAX (e.g. 2-4): Slurm starts "
                                 "the job on any count in it that is free, and each requeue may "
                                 "get another (needs train.global_batch_size; see docs/resume.md).")
    tasks_per_node: int = doc(1, "Processes per node; one per GPU on GPU nodes.")
    gpus_per_node: int = doc(0, "GPUs to request per node (0 on CPU partitions).")
    cpus_per_task: int = doc(1, "CPU cores per task (data loader workers need their own).")
    mem_gb: Optional[float] = doc(None, "Memory per node in GB; null keeps the partition's "
                                        "default.")
    timeout_min: int = doc(60, "Time limit of one attempt in minutes.")
    partition: Optional[str] = doc(None, "Partition (-p); null uses the cluster's default.")
    account: Optional[str] = doc(None, "Account to charge (-A).")
    qos: Optional[str] = doc(None, "Quality of service (--qos).")
    constraint: Optional[str] = doc(None, "Node features (-C), e.g. 'a100'.")
    exclusive: bool = doc(False, "Ask for whole nodes (--exclusive).")
    signal: str = doc("USR2", "Warning signal Slurm sends before the time limit; never USR1 (NCCL "
                              "uses it).")
    signal_delay_s: int = doc(120,
                              "Seconds before the time limit that the warning signal arrives.")
    max_timeouts: int = doc(20, "Requeues allowed after running into the time limit.")
    max_preemptions: int = doc(20, "Requeues allowed after preemption.")
    max_failures: int = doc(0, "Requeues allowed after a crash or a hang (0: a crash ends the run, "
                            "keeping its newest snapshot; a bug that crashes every time would burn "
                            "the allocation).")
    spare_nodes: int = doc(0, "Nodes the job holds beside slurm.nodes and trains on only when one "
                           "fails: a failed node is replaced inside the allocation and the resume "
                           "is bit-exact (needs a fixed slurm.nodes; see docs/faults.md, healing).")
    max_restarts_in_job: int = doc(3, "New steps the batch shell may start inside the job after "
                                   "failed ones (a crash, a hang, a lost node), on healthy nodes "
                                   "from the last snapshot, before the failure takes the requeue "
                                   "path (slurm.max_failures); 0: never.")
    setup: List[str] = doc_factory(list, "Shell lines run before the job starts (module load, "
                                         "source venv).")
    sbatch_extra: Dict[str, str] = doc_factory(dict, "Extra sbatch options without '--', e.g. "
                                               "{mail-type: END}; an empty value is a flag: "
                                               "{no-requeue: ''} turns requeue off, and each stop "
                                               "then chains the run's next job (docs/faults.md).")
    srun_args: List[str] = doc_factory(list, "Extra arguments for every training step's srun, e.g. "
                                       "['--cpu-bind=cores'] (after hpc_ddp's own, so they win).")
    container: ContainerConfig = doc_factory(ContainerConfig, "The container every rank runs in.")
    straggler: StragglerConfig = doc_factory(StragglerConfig, "A slow node named.")
    health: HealthConfig = doc_factory(HealthConfig, "Sick nodes kept out.")


@dataclass
class DistConfig:
    """How the processes of a job find each other."""

    backend: str = doc("auto", "auto (NCCL when CUDA is available, else gloo), nccl or gloo.")
    timeout_s: int = doc(600, "Seconds a rank may go without progress (one step, a snapshot write, "
                         "the start-up) before the watchdog declares the job hung, names the stuck "
                         "ranks and dumps the collectives each rank was in to RUN_DIR/errors/. "
                         "When every rank is at the same place (a collective itself is stuck), "
                         "rank 0 waits up to 2 x this before it declares the hang. The "
                         "collectives' own timeout is 2 x this + 30 s.")
    liveness_s: Optional[float] = doc(LIVENESS_S, "Seconds without a liveness beat after which a "
                                      "rank or node counts as lost (frozen, powered off): every "
                                      "rank beats from a side thread on its node (/dev/shm) and "
                                      "each node's watcher process for the node to "
                                      "RUN_DIR/liveness/ (a long step or eval is not silence); "
                                      "each watches one peer; whoever sees the silence names the "
                                      "lost rank and its host in RUN_DIR/errors/ and the step ends "
                                      "(exit 6), which the batch shell heals. A rank stopped by "
                                      "SIGSTOP is found by its node's watcher in /proc within "
                                      "seconds, whatever this is. null or 0: off. It must be at "
                                      "most "
                                      "half of dist.timeout_s, or the hang watchdog speaks first; "
                                      "the default steps aside (off) when dist.timeout_s is below "
                                      "60.")
    master_port: Optional[int] = doc(None, "Rendezvous port; null derives it from the job id.")
    nccl_env: Dict[str, str] = doc_factory(dict, "Variables exported before init, e.g. "
                                "{NCCL_DEBUG: INFO}. They win over hpc_ddp's own NCCL defaults "
                                "(TORCH_NCCL_ASYNC_ERROR_HANDLING=1, the flight recorder: "
                                "docs/faults.md).")
