"""B7: what a snapshot costs the cluster at 1, 2, 4 and 8 nodes (x 1 task), split vs a whole copy per node.

Each node is a real gloo process with the same ~200 MB replicated state (model + Adam) and
a real :class:`~hpc_ddp.rank.state.checkpointer.Checkpointer`. For each node count it measures, with
``snapshot.replicas`` 1, 2 and "every node" (the layout before splitting, the reference):
the bytes one snapshot writes over the state's size, the busiest node's bytes, the save's
wall time and the restore's (verify + load + put together, page cache warm). One disk and
2 cores stand in for N nodes here, so the times are noisy and the bytes are the figure.

Run as a worker: ``python -m benchmarks.split RANK WORLD PORT RUN_DIR REPLICAS MEGABYTES``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, world: int, port: int, run_dir: Path, replicas: int, megabytes: float) -> dict[str, Any]:
    """One node: save one snapshot, restore it with a fresh checkpointer, time both (rank 0 reports)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from benchmarks.snapshots import state_of
    from hpc_ddp.rank.state.checkpointer import Checkpointer
    from hpc_ddp.rank.state.rng import capture_rng
    from hpc_ddp.core.config import SnapshotConfig
    from hpc_ddp.core.slurm_env import DistEnv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    env = DistEnv(rank=rank, local_rank=0, world_size=world, local_world_size=1, node_rank=rank, num_nodes=world,
                  master_addr="127.0.0.1", master_port=port)
    torch.manual_seed(0)  # the same replicated state on every node
    _, state = state_of(megabytes)
    cfg = SnapshotConfig(every_steps=None, every_minutes=None, keep_last=1, replicas=replicas)
    Checkpointer(run_dir, cfg, env, "bench").save(1, state, capture_rng())  # first write of a process: slower
    dist.barrier()
    start = time.perf_counter()
    Checkpointer(run_dir, cfg, env, "bench").save(2, state, capture_rng())
    saved = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    restored = Checkpointer(run_dir, cfg, env, "bench").restore()
    dist.barrier()
    loaded = time.perf_counter() - start
    assert restored is not None and torch.equal(restored.state["model"]["weight"], state["model"]["weight"])
    dist.destroy_process_group()
    return {"save_s": saved, "restore_s": loaded}


def one(nodes: int, replicas: int, megabytes: float, scratch: Path) -> dict[str, Any]:
    """One snapshot and one restore at ``nodes`` x 1 task: bytes, busiest node, save and restore times."""
    from hpc_ddp.rundir import snapshot
    from hpc_ddp.rundir.snapshot import steps as snapshot_steps

    run_dir = scratch / f"b7-{nodes}-{replicas}"
    shutil.rmtree(run_dir, ignore_errors=True)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.split", str(rank), str(nodes), str(port),
                               str(run_dir), str(replicas), str(megabytes)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True) for rank in range(nodes)]
    outputs = [proc.communicate(timeout=900)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"B7 worker failed at {nodes} nodes, replicas {replicas}")
    times = json.loads(outputs[0].strip().splitlines()[-1])
    manifest = snapshot_steps.read_manifest(snapshot.step_dir(run_dir, 2)) or {}
    sizes = [entry["size"] for entry in manifest["files"].values()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"bytes": sum(sizes), "busiest": max(sizes), **times}


def b7_split(scratch: Path, megabytes: float = 200, counts: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, Any]:
    """The figure: per node count, replicas 1, 2 and every node (the reference, as before the split)."""
    from benchmarks.snapshots import state_of
    from hpc_ddp.rundir import slicing

    _, state = state_of(megabytes)
    size = sum(t.nbytes for _, t in slicing.split(state)[1])
    rows = {}
    for nodes in counts:
        row: dict[str, Any] = {}
        for label, replicas in (("r1", 1), ("r2", 2), ("every", nodes)):
            if label == "every" and nodes <= 2 and f"r{nodes}" in row:
                row[label] = row[f"r{nodes}"]  # the same layout: every node already holds every slice
                continue
            got = one(nodes, replicas, megabytes, scratch)
            row[label] = {"bytes_per_state": round(got["bytes"] / size, 3),
                          "busiest_per_state": round(got["busiest"] / size, 3),
                          "save_s": round(got["save_s"], 3), "restore_s": round(got["restore_s"], 3)}
        row["r2_save_vs_every"] = round(row["r2"]["save_s"] / row["every"]["save_s"], 3)
        row["r2_restore_vs_every"] = round(row["r2"]["restore_s"] / row["every"]["restore_s"], 3)
        rows[str(nodes)] = row
    met = all(rows[n][r]["bytes_per_state"] <= k + 0.05 for n in rows for r, k in (("r1", 1), ("r2", 2)))
    return {"state_mb": round(size / 2**20, 1), "nodes": rows, "met": met,
            "target": "bytes per snapshot <= replicas + 0.05 state sizes at every node count; busiest node 1/N"}


if __name__ == "__main__":
    rank_, world_, port_, run_dir_, replicas_, megabytes_ = sys.argv[1:7]
    result = worker(int(rank_), int(world_), int(port_), Path(run_dir_), int(replicas_), float(megabytes_))
    if int(rank_) == 0:
        print(json.dumps(result))
