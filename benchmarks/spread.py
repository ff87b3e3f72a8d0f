"""B9: what a resume reads from the filesystem, and what a commit sends to each rank, at 1-8 nodes x 1 and 2 tasks.

Every rank is a real gloo process with the same replicated state (model + Adam) and a real
:class:`~hpc_ddp.rank.state.checkpointer.Checkpointer`; node n is ranks ``n*T .. n*T+T-1``. One
snapshot is written (replicas 2), then restored twice, interleaved: ``snapshot.load=spread``
and ``every_node`` (``every_rank`` before issue 45). Before each restore rank 0 drops the snapshot files' pages from the page
cache (``posix_fadvise(DONTNEED)``), and every rank reads the bytes it made the disk serve from
the kernel's own counter (``read_bytes`` in ``/proc/self/io``, which counts memory-mapped reads
too). Figures: those bytes over the state's size, summed over the ranks; the loader's own count
of tensor bytes copied out of files beside it; each restore's wall time; and the pickled bytes a
non-zero rank sends and receives in one save (the RNG gather within its node and the commit).
One disk and 2 cores stand in for the nodes, and the "nodes" share one page cache: a page one
rank faulted in is free for the next, so ``every_node``'s kernel count is about one state here,
where on a cluster each node's cache would read it again (the loader's count says how often).
The same worker also runs as a task of a job on the local Slurm cluster (:func:`b9_slurm`).

Run as a worker: ``python -m benchmarks.spread RANK WORLD TASKS PORT RUN_DIR MEGABYTES``, or
inside a Slurm step: ``srun python -m benchmarks.spread --slurm RUN_DIR MEGABYTES``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
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


def disk_read_bytes() -> int:
    """The bytes this process made the storage layer serve (read_bytes of /proc/self/io: page faults on
    memory-mapped files included, page-cache hits not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def drop_pages(run_dir: Path) -> None:
    """Evict the snapshot files' pages from the page cache, so the next read comes from the disk."""
    for folder, _, names in os.walk(run_dir / "snapshots"):  # a pruned step may vanish meanwhile: skipped
        for name in names:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(rank: int, world: int, tasks: int, port: int, run_dir: Path, megabytes: float,
           env: Any = None) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from benchmarks.snapshots import state_of
    from hpc_ddp.rank.state.checkpointer import Checkpointer
    from hpc_ddp.rank.state.rng import capture_rng
    from hpc_ddp.core.config import SnapshotConfig
    from hpc_ddp.core.slurm_env import DistEnv

    torch.set_num_threads(1)
    env = env or DistEnv(rank=rank, local_rank=rank % tasks, world_size=world, local_world_size=tasks,
                         node_rank=rank // tasks, num_nodes=world // tasks, master_addr="127.0.0.1", master_port=port)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(minutes=10))
    torch.manual_seed(0)  # the same replicated state on every rank
    _, state = state_of(megabytes)
    counter = {"sent": 0, "received": 0}
    _count_object_traffic(counter)
    cfg = {load: SnapshotConfig(every_steps=None, every_minutes=None, keep_last=1, replicas=REPLICAS, load=load)
           for load in ("spread", "every_node")}
    Checkpointer(run_dir, cfg["spread"], env, "bench").save(1, state, capture_rng())  # the node groups, warm
    counter.update(sent=0, received=0)
    Checkpointer(run_dir, cfg["spread"], env, "bench").save(2, state, capture_rng())
    commit = dict(counter)
    out: dict[str, Any] = {"commit_sent": commit["sent"], "commit_received": commit["received"]}
    from hpc_ddp.rank.group import control
    from hpc_ddp.rank.state import spread

    two_levels = spread.share
    for round_ in range(2):
        for load in (("spread", "every_node", "flat") if round_ % 2 == 0 else ("flat", "every_node", "spread")):
            # flat: spread as before issue 36, every slice broadcast to every rank over one group
            spread.share = two_levels if load != "flat" else (  # type: ignore[assignment]
                lambda buffer, reader, groups, *_: control.broadcast(buffer, reader))
            if env.rank == 0:
                drop_pages(run_dir)
            dist.barrier()
            start, disk = time.perf_counter(), disk_read_bytes()
            restored = Checkpointer(run_dir, cfg["spread" if load == "flat" else load], env, "bench").restore()
            disk = disk_read_bytes() - disk
            dist.barrier()
            elapsed = time.perf_counter() - start
            out.setdefault(f"{load}_disk", []).append(disk)
            assert restored is not None and torch.equal(restored.state["model"]["weight"], state["model"]["weight"])
            out.setdefault(f"{load}_s", []).append(elapsed)
            out[f"{load}_read"] = restored.read
            del restored  # one restored state at a time: 16 ranks of 200 MB on this machine's memory
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the freed copies back before the next restore
    dist.destroy_process_group()
    return {**out, "rank": env.rank, "node": env.node_rank}


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
    return summarise([json.loads(text.strip().splitlines()[-1]) for text in outputs])


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of B9 from every rank's figures (by rank)."""
    results = sorted(results, key=lambda r: r["rank"])
    main, others = results[0], results[1:]
    state = main["spread_read"]["state"]
    return {"spread_read_per_state": round(main["spread_read"]["bytes"] / state, 3),
            "spread_busiest_per_state": round(main["spread_read"]["busiest_node"] / state, 3),
            "every_node_read_per_state": round(main["every_node_read"]["bytes"] / state, 3),
            # the kernel's count, summed over ranks, each restore after the files' pages were dropped (the worse)
            "spread_disk_per_state": round(max(map(sum, zip(*(r["spread_disk"] for r in results)))) / state, 3),
            "every_node_disk_per_state": round(max(map(sum, zip(*(r["every_node_disk"] for r in results)))) / state,
                                               3),
            "spread_s": round(min(main["spread_s"]), 3), "every_node_s": round(min(main["every_node_s"]), 3),
            "flat_spread_s": round(min(main["flat_s"]), 3),
            "save_object_bytes_per_nonzero_rank": max((o["commit_sent"] + o["commit_received"] for o in others),
                                                      default=0)}


def b9_spread(scratch: Path, megabytes: float = 200, counts: tuple[int, ...] = (1, 2, 4, 8),
              tasks: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    from benchmarks.snapshots import state_of
    from hpc_ddp.rank.state.spread import state_bytes

    size = state_bytes(state_of(megabytes)[1])
    rows = {f"{n}x{t}": one(n, t, megabytes, scratch) for t in tasks for n in counts}
    flat = True
    for t in tasks:  # per tasks per node: the RNG gather within a node adds a rank's RNG state at T > 1
        sent = [row["save_object_bytes_per_nonzero_rank"] for key, row in rows.items()
                if key.endswith(f"x{t}") and row["save_object_bytes_per_nonzero_rank"]]
        flat = flat and (not sent or max(sent) <= 1.5 * min(sent))
    return {"state_mb": round(size / 2**20, 1), "rows": rows, "save_objects_flat": flat, "replicas": REPLICAS,
            "met": met(rows.values()) and flat, "target": TARGET}


REPLICAS = 2  # the snapshot's copies of each slice (snapshot.replicas)
TARGET = ("spread: the loader copies <= 1.05 states out of files, and the disk serves <= 1.05 (the kernel's count: "
          f"each reader hashes the slice it reads; the file's other copy of {REPLICAS} is not read), at every N; a "
          "save's object bytes per non-zero rank flat in N")


def met(rows: Any) -> bool:
    return all(row["spread_read_per_state"] <= 1.05 and row["spread_disk_per_state"] <= 1.05 for row in rows)


SLURM_MARK = "B9-RESULT "


def b9_slurm(scratch: Path, megabytes: float = 200, nodes: int = 3, tasks: int = 2,
             environ: dict[str, str] | None = None) -> dict[str, Any]:
    """B9 as a job on the local Slurm cluster (``python -m hpc_ddp.slurm_local start``): ``nodes`` x ``tasks``
    ranks that take their ranks and rendezvous from Slurm's variables (hpc_ddp.core.slurm_env), as a job's do."""
    run_dir = scratch / f"b9-slurm-{nodes}x{tasks}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    script = run_dir / "b9.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash", f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={tasks}", "#SBATCH --time=20",
        f"#SBATCH --output={run_dir}/job.out", f"cd {ROOT}",
        f"srun {sys.executable} -m benchmarks.spread --slurm {run_dir} {megabytes}", ""]))
    done = subprocess.run(["sbatch", "--wait", str(script)], env=environ, capture_output=True, text=True,
                          timeout=1800)
    out = (run_dir / "job.out").read_text(errors="replace") if (run_dir / "job.out").exists() else ""
    results = [json.loads(line[len(SLURM_MARK):]) for line in out.splitlines() if line.startswith(SLURM_MARK)]
    if done.returncode or len(results) != nodes * tasks:
        raise RuntimeError(f"B9 on Slurm failed (sbatch {done.returncode}): {done.stderr[-500:]} {out[-2000:]}")
    shutil.rmtree(run_dir / "snapshots", ignore_errors=True)
    row = summarise(results)
    return {"state_mb": megabytes, "rows": {f"{nodes}x{tasks}": row}, "replicas": REPLICAS, "met": met([row]),
            "target": TARGET, "where": "the local Slurm cluster: one job, srun, ranks from Slurm's variables"}


if __name__ == "__main__":
    if sys.argv[1] == "--slurm":
        from hpc_ddp.core.slurm_env import from_environ

        slurm_env = from_environ(os.environ)
        result = worker(slurm_env.rank, slurm_env.world_size, slurm_env.local_world_size, slurm_env.master_port,
                        Path(sys.argv[2]), float(sys.argv[3]), env=slurm_env)
        print(SLURM_MARK + json.dumps(result), flush=True)
    else:
        rank_, world_, tasks_, port_, run_dir_, megabytes_ = sys.argv[1:7]
        result = worker(int(rank_), int(world_), int(tasks_), int(port_), Path(run_dir_), float(megabytes_))
        print(json.dumps(result))
