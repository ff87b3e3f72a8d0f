"""B9: what a resume reads from the filesystem, and what a commit sends to each rank, at 1-8 nodes x 1 and 2 tasks.

Every rank is a real gloo process with the same replicated state (model + Adam) and a real
:class:`~hpc_ddp.rank.checkpointer.Checkpointer`; node n is ranks ``n*T .. n*T+T-1``. One
snapshot is written (replicas 2), then restored twice, interleaved: ``snapshot.load=spread``
and ``every_rank``. Figures: the bytes read from snapshot files over the state's size (the
loader counts the tensor bytes it copies out of the files, not the page cache), the busiest
node's, each restore's wall time, and the pickled bytes a non-zero rank sends and receives
in one save: the RNG gather within its node and the commit (counted around torch's object
collectives; before issue 26 the commit alone was an all-gather of W entries to every rank). One disk and 2 cores stand in
for the nodes, so the times are noisy; the bytes are the figure.

Run as a worker: ``python -m benchmarks.spread RANK WORLD TASKS PORT RUN_DIR MEGABYTES``.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.split import ROOT, _free_port


def _count_object_traffic(counter: dict[str, int]) -> None:
    """Wrap torch's object collectives to add up the pickled bytes this rank sends and receives."""
    import torch.distributed as dist

    size = lambda value: len(pickle.dumps(value))  # noqa: E731
    gather, broadcast, all_gather = dist.gather_object, dist.broadcast_object_list, dist.all_gather_object

    def gather_object(obj: Any, object_gather_list: Any = None, dst: int = 0, group: Any = None) -> None:
        gather(obj, object_gather_list, dst=dst, group=group)
        if dist.get_rank() != dst:
            counter["sent"] += size(obj)

    def broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None, device: Any = None) -> None:
        if dist.get_rank() == src:
            broadcast(object_list, src=src, group=group, device=device)
            return
        broadcast(object_list, src=src, group=group, device=device)
        counter["received"] += size(object_list)

    def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
        all_gather(object_list, obj, group=group)
        counter["sent"] += size(obj)
        counter["received"] += sum(size(o) for o in object_list) - size(obj)

    dist.gather_object, dist.broadcast_object_list, dist.all_gather_object = (  # type: ignore[assignment]
        gather_object, broadcast_object_list, all_gather_object)


def worker(rank: int, world: int, tasks: int, port: int, run_dir: Path, megabytes: float) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from benchmarks.snapshots import state_of
    from hpc_ddp.rank.checkpointer import Checkpointer, capture_rng
    from hpc_ddp.core.config import SnapshotConfig
    from hpc_ddp.core.slurm_env import DistEnv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    env = DistEnv(rank=rank, local_rank=rank % tasks, world_size=world, local_world_size=tasks,
                  node_rank=rank // tasks, num_nodes=world // tasks, master_addr="127.0.0.1", master_port=port)
    torch.manual_seed(0)  # the same replicated state on every rank
    _, state = state_of(megabytes)
    counter = {"sent": 0, "received": 0}
    _count_object_traffic(counter)
    cfg = {load: SnapshotConfig(every_steps=None, every_minutes=None, keep_last=1, replicas=2, load=load)
           for load in ("spread", "every_rank")}
    Checkpointer(run_dir, cfg["spread"], env, "bench").save(1, state, capture_rng())  # the node groups, warm
    counter.update(sent=0, received=0)
    Checkpointer(run_dir, cfg["spread"], env, "bench").save(2, state, capture_rng())
    commit = dict(counter)
    out: dict[str, Any] = {"commit_sent": commit["sent"], "commit_received": commit["received"]}
    for round_ in range(2):
        for load in (("spread", "every_rank") if round_ % 2 == 0 else ("every_rank", "spread")):
            dist.barrier()
            start = time.perf_counter()
            restored = Checkpointer(run_dir, cfg[load], env, "bench").restore()
            dist.barrier()
            elapsed = time.perf_counter() - start
            assert restored is not None and torch.equal(restored.state["model"]["weight"], state["model"]["weight"])
            out.setdefault(f"{load}_s", []).append(elapsed)
            out[f"{load}_read"] = restored.read
    dist.destroy_process_group()
    return out


def one(nodes: int, tasks: int, megabytes: float, scratch: Path) -> dict[str, Any]:
    run_dir = scratch / f"b9-{nodes}x{tasks}"
    shutil.rmtree(run_dir, ignore_errors=True)
    port, world = _free_port(), nodes * tasks
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.spread", str(rank), str(world), str(tasks),
                               str(port), str(run_dir), str(megabytes)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for rank in range(world)]
    outputs = [proc.communicate(timeout=1800)[0] for proc in procs]
    shutil.rmtree(run_dir, ignore_errors=True)
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"B9 worker failed at {nodes} x {tasks}")
    results = [json.loads(text.strip().splitlines()[-1]) for text in outputs]
    main, others = results[0], results[1:]
    state = main["spread_read"]["state"]
    return {"spread_read_per_state": round(main["spread_read"]["bytes"] / state, 3),
            "spread_busiest_per_state": round(main["spread_read"]["busiest_node"] / state, 3),
            "every_rank_read_per_state": round(main["every_rank_read"]["bytes"] / state, 3),
            "spread_s": round(min(main["spread_s"]), 3), "every_rank_s": round(min(main["every_rank_s"]), 3),
            "save_object_bytes_per_nonzero_rank": max((o["commit_sent"] + o["commit_received"] for o in others),
                                                      default=0)}


def b9_spread(scratch: Path, megabytes: float = 200, counts: tuple[int, ...] = (1, 2, 4, 8),
              tasks: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    from benchmarks.snapshots import state_of
    from hpc_ddp.rank.spread import state_bytes

    size = state_bytes(state_of(megabytes)[1])
    rows = {f"{n}x{t}": one(n, t, megabytes, scratch) for t in tasks for n in counts}
    flat = True
    for t in tasks:  # per tasks per node: the RNG gather within a node adds a rank's RNG state at T > 1
        sent = [row["save_object_bytes_per_nonzero_rank"] for key, row in rows.items()
                if key.endswith(f"x{t}") and row["save_object_bytes_per_nonzero_rank"]]
        flat = flat and (not sent or max(sent) <= 1.5 * min(sent))
    met = all(row["spread_read_per_state"] <= 1.05 for row in rows.values()) and flat
    return {"state_mb": round(size / 2**20, 1), "rows": rows, "save_objects_flat": flat, "met": met,
            "target": "bytes read / state <= 1.05 at every N; a save's object bytes per non-zero rank flat in N"}


if __name__ == "__main__":
    rank_, world_, tasks_, port_, run_dir_, megabytes_ = sys.argv[1:7]
    result = worker(int(rank_), int(world_), int(tasks_), int(port_), Path(run_dir_), float(megabytes_))
    print(json.dumps(result))
