"""B12: the control plane against the world size, measured with real gloo ranks, fitted and extrapolated.

``python -m benchmarks.scale [--worlds 2,4,8,16,32] [--tasks-per-node 8]``. For each world size W,
W processes (tiny compute, one thread each) form a real gloo process group as hpc_ddp's workers do,
simulated as W / tasks_per_node nodes, and measure on every rank (rank 0's figures reported):

- ``init_s``: the training process group's init; ``control_init_s``: the control group's;
- ``fds``: open file descriptors per process once every control message below has run (sockets
  are most of them: gloo connects every pair of a group unless it connects lazily);
- ``agreement_ms``: the boundary's stop agreement (``control.start_max`` + wait), median of 50;
- ``commit_ms``: a snapshot of a tiny state (64 KiB, so the disk is not what is timed): the RNG
  gather within each node, one file per node, the commit's entries gathered to rank 0 and its
  verdict; median of 3;
- ``replication_ms``: the replication check's collective on a tiny state, median of 10.

Each figure is fitted as ``a + b * W`` and as ``a + b * log2(W)``; the fit with the smaller
residual is extrapolated to 4,096 and 32,768 ranks. ``--lazy`` chooses which gloo groups connect a
pair on its first message rather than every pair at once (``TORCH_GLOO_LAZY_INIT``): ``control``
(hpc_ddp's default: its control groups), ``none`` (every group eager: hpc_ddp before B12) or
``all`` (the training group too). The before/after of the change is ``none`` against ``control``.
On this machine W processes share 2 cores: times at large W include waiting for a core, so they
are upper bounds; the descriptor counts are exact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGETS = (4096, 32768)


def _timed(fn: Any, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def worker(rank: int, world: int, tasks_per_node: int, port: int, out: str, scratch: str, lazy: str) -> None:
    if lazy in ("none", "all"):  # "control": unset, so hpc_ddp's control groups connect lazily and no other
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1" if lazy == "all" else "0"
    import torch
    import torch.distributed as dist

    from hpc_ddp.core.config import SnapshotConfig
    from hpc_ddp.core.slurm_env import from_environ, simulated_environ
    from hpc_ddp.rank import control, replication
    from hpc_ddp.rank.checkpointer import Checkpointer
    from hpc_ddp.rank.rng import capture_rng

    torch.set_num_threads(1)
    nodes = max(1, world // tasks_per_node)
    env = from_environ({**simulated_environ(nodes, world // nodes, job_id=1)[rank], "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)})
    start = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    control.open_group("gloo")
    control_init_s = time.perf_counter() - start
    control.barrier()

    def agree() -> None:
        flags, work = control.start_max([0, 0, 0])
        work.wait()
    agreement_ms = _timed(agree, 50)
    state = {"model": {"w": torch.ones(16384)}, "step": 1}
    replication_ms = _timed(lambda: replication.check({"model": state["model"]}, 10), 10)
    ckpt = Checkpointer(Path(scratch), SnapshotConfig(every_steps=None, every_minutes=None, keep_last=1), env, "b12")
    steps = iter(range(1, 1000))
    commit_ms = _timed(lambda: ckpt.save(next(steps), state, capture_rng()), 3)
    control.barrier()
    fds = len(os.listdir("/proc/self/fd"))
    found = control.to_main({"fds": fds})
    if rank == 0:
        Path(out).write_text(json.dumps({"init_s": init_s, "control_init_s": control_init_s, "fds": fds,
                                         "fds_max": max(f["fds"] for f in found), "agreement_ms": agreement_ms,
                                         "commit_ms": commit_ms, "replication_ms": replication_ms}))
    control.barrier()
    dist.destroy_process_group()


def measure(world: int, tasks_per_node: int, lazy: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from hpc_ddp.rehearsal.local import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b12.json"
        mp.spawn(worker, args=(world, tasks_per_node, free_port(), str(out), tmp, lazy), nprocs=world, join=True)
        return {"world_size": world, **{k: round(v, 4) for k, v in json.loads(out.read_text()).items()}}


def fit(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Least squares of ``key`` against W and against log2(W); the better one, extrapolated."""
    xs = [r["world_size"] for r in rows]
    ys = [r[key] for r in rows]

    def line(us: list[float]) -> tuple[float, float, float]:
        mu, my = statistics.fmean(us), statistics.fmean(ys)
        var = sum((u - mu) ** 2 for u in us) or 1e-12
        slope = sum((u - mu) * (y - my) for u, y in zip(us, ys)) / var
        icpt = my - slope * mu
        return icpt, slope, sum((icpt + slope * u - y) ** 2 for u, y in zip(us, ys))
    lin, log = line([float(x) for x in xs]), line([math.log2(x) for x in xs])
    grows = "linear" if lin[2] <= log[2] else "log"
    icpt, slope, _ = lin if grows == "linear" else log
    at = {n: icpt + slope * (n if grows == "linear" else math.log2(n)) for n in TARGETS}
    return {"grows": grows, "intercept": round(icpt, 4), "slope": round(slope, 6),
            **{f"at_{n}": round(v, 3) for n, v in at.items()}}


def b12(worlds: list[int], tasks_per_node: int, lazy: str) -> dict[str, Any]:
    rows = [measure(w, tasks_per_node, lazy) for w in worlds]
    keys = ("init_s", "control_init_s", "fds", "agreement_ms", "commit_ms", "replication_ms")
    return {"lazy_init": lazy, "tasks_per_node": tasks_per_node, "rows": rows,
            "fits": {k: fit(rows, k) for k in keys}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4,8,16,32", help="world sizes, comma-separated")
    parser.add_argument("--tasks-per-node", type=int, default=8)
    parser.add_argument("--lazy", choices=("control", "none", "all"), default="control",
                        help="which gloo groups connect lazily (default: hpc_ddp's control groups)")
    args = parser.parse_args(argv)
    print(json.dumps(b12([int(w) for w in args.worlds.split(",")], args.tasks_per_node, args.lazy), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
