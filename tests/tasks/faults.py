"""One fault injector for every test task and benchmark workload:
``HPC_DDP_TEST_FAULT="KIND:RANK:STEP"``.

The fault hits RANK in its STEP-th training step of the job's first attempt only
(SLURM_RESTART_COUNT=0 and not an in-job restart), so a requeued or healed attempt runs clean.
Kinds:

- ``kill``: SIGKILL (a lost rank); ``stop``: SIGSTOP (a frozen node as seen from outside: every
  thread stops, no socket closes); ``stopnode:NODE:STEP``: every rank of that node stops (needs the
  run object);
- ``freezenode:NODE:STEP``: the node's freezer cgroup freezes once every rank of it reached STEP
  (the local cluster's nodes: a hung kernel, which no SIGCONT thaws and which stops slurmd and the
  node's Slurm signals too; needs the run object);
- ``partitionnode:NODE:STEP``: once every rank of the node reached STEP, the node's link goes down
  from inside (``ip link set eth0 down`` in its network namespace: no FIN, no RST; it still sees its
  view of the run dir, so both sides of the cut hold the step and may write a survivors' snapshot:
  one commit per attempt fences);
- ``raise``: a RuntimeError in the loss; ``sleep``: an hour's sleep outside any collective (a hang);
- ``mute``: that rank's liveness beats stop from that step on while it trains, and its node's
  watcher process stops where the rank started it (a node's first rank): a false alarm; every step
  takes 20 ms so that the alarm comes while the run goes on;
- ``slow:-1:S``: every step of every rank takes S seconds longer (a GPU's compute, for B11; numbers
  unchanged).

``kill``, ``stop``, ``freezenode`` and ``partitionnode`` write the time to ``HPC_DDP_TEST_FAULT_STAMP`` when it
is set (for B10): just before the kill or stop, once the link is down.
An own loop passes its run object: a rank then waits until the state of the step before has left for
its buddy (the mirror's sender posts it about a millisecond after the boundary; a rank lost inside
that window takes that step's state with it, by design, and a CI run caught rank 3 holding rank 1's
step 21, not 22).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FAULT = "HPC_DDP_TEST_FAULT"
STAMP = "HPC_DDP_TEST_FAULT_STAMP"


def first_attempt(environ: Mapping[str, str] = os.environ) -> bool:
    """The job's first attempt: not requeued (SLURM_RESTART_COUNT 0) and not restarted inside the
    job."""
    return environ.get("SLURM_RESTART_COUNT",
                       "0") == "0" and not environ.get("HPC_DDP_IN_JOB_RESTART")


def planned(environ: Mapping[str, str] = os.environ) -> tuple[str, int, float]:
    """(kind, rank, step) from HPC_DDP_TEST_FAULT, ("none", -1, -1.0) when unset."""
    kind, rank, step = (environ.get(FAULT) or "none:-1:-1").split(":")
    return kind, int(rank), float(step)


def inject(rank: int, step: int, run: Any = None) -> None:
    """Called by a task or loop at the start of its ``step``-th training step (counted from 1) on
    ``rank``."""
    kind, at_rank, at_step = planned()
    if kind == "slow":
        time.sleep(at_step)
    if kind == "mute":
        time.sleep(0.02)
    if kind == "stopnode" and run is not None:
        kind, at_rank = "stop", (rank if run.env.node_rank == at_rank else -1)
    if kind == "freezenode" and run is not None:
        kind, at_rank = "freeze", (rank if run.env.node_rank == at_rank else -1)
    if kind == "partitionnode" and run is not None:
        kind, at_rank = "partition", (rank if run.env.node_rank == at_rank else -1)
    if (rank, step) != (at_rank, int(at_step)) or not first_attempt():
        return
    if kind == "raise":
        raise RuntimeError(f"injected failure on rank {at_rank} at step {int(at_step)}")
    if kind == "sleep":
        time.sleep(3600)
    if kind == "mute":
        # this rank's beats stop (its thread starved), its training goes on
        from hpc_ddp.rank.watch import liveness

        liveness.Liveness.beat = lambda self: None  # type: ignore[method-assign]
        stop_node_watcher()  # where this rank started its node's watcher: the node's beat stops too
    if kind == "partition":
        if run.mirror is not None:
            run.mirror.wait_sent(step - 1, 5.0)
        partition_node(run, step)
    if kind in ("kill", "stop", "freeze"):
        if run is not None and run.mirror is not None:
            run.mirror.wait_sent(step - 1, 5.0)
        if os.environ.get(STAMP):
            Path(os.environ[STAMP]).write_text(repr(time.time()))
        if kind == "freeze":
            freeze_node(run.env.local_rank, run.env.local_world_size)
        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


def stop_node_watcher() -> None:
    """SIGSTOP this process's child that watches its node (hpc_ddp.rank.watch.node_watch), if
    any."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"hpc_ddp.rank.watch.node_watch" in command:
            os.kill(int(stat.parent.name), signal.SIGSTOP)


def _arrive(name: str, local_rank: int, local_world_size: int) -> bool:
    """Every rank of the node says it is here (a file in the node's own /dev/shm): True for the
    last."""
    arrived = Path(f"/dev/shm/hpc_ddp-test-{name}-{os.environ.get('SLURM_JOB_ID', 'local')}")
    arrived.mkdir(exist_ok=True)
    (arrived / str(local_rank)).touch()
    return len(list(arrived.iterdir())) >= local_world_size


def partition_node(run: Any, step: int) -> None:
    """``partitionnode``: the last rank of the node to arrive takes the node's link down; every rank
    of it goes on into the step's collectives, which wait on both sides of the cut until the hang
    watchdog ends them."""
    env = run.env
    if _arrive("partition", env.local_rank, env.local_world_size):
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
        if os.environ.get(STAMP):
            Path(os.environ[STAMP]).write_text(repr(time.time()))


def freeze_node(local_rank: int, local_world_size: int) -> None:
    """Every rank of the node arrives (a file in the node's own /dev/shm); the last one freezes the
    node's freezer cgroup (its own, from /proc/self/cgroup), itself with it. The others wait to be
    frozen."""
    if not _arrive("freeze", local_rank, local_world_size):
        time.sleep(3600)  # frozen before this ends
    line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines()
                if ":freezer:" in line)
    state = Path("/sys/fs/cgroup/freezer") / line.split(":", 2)[2].lstrip("/") / "freezer.state"
    if state.parent == Path("/sys/fs/cgroup/freezer"):
        raise RuntimeError("freezenode: this process is in no node's freezer cgroup (not on the "
                           "local cluster "
                           "of machines)")
    state.write_text("FROZEN\n")
    time.sleep(3600)


class FaultyLoss:
    """A Task mixin: the fault is injected in ``loss`` of the training steps (not the Trainer's
    eval-mode warm-up pass), counted from 1 on each rank."""

    steps = 0

    def loss(self, model: Any, batch: Any) -> Any:
        if model.training:
            import torch.distributed as dist

            self.steps += 1
            inject(dist.get_rank(), self.steps)
        return super().loss(model, batch)  # type: ignore[misc]
