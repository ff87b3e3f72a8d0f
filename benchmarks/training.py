"""B2: the trainer against a raw DDP loop, both in the same two gloo processes, interleaved.

The raw loop is written the way PyTorch's DDP tutorial writes it: DDP wrapper,
DistributedSampler, DataLoader, zero_grad / forward / backward / step. The
trainer variants use the same model, data, per-rank batch and optimizer:

- ``bare``: no stop flag and no snapshots, so no collective of its own;
- ``stop``: the stop-flag agreement at every step boundary, as in production;
- ``shared``: ``stop`` with the agreement on the training group itself (hpc_ddp before it gave the
  control traffic a gloo group of its own on gloo too): what the separate group costs, if anything;
- ``sync`` / ``async``: the stop flag plus a snapshot every ``every`` steps;
- ``raw2``: the raw loop again; raw2 / raw is the noise floor every ratio is read against;
- ``own``: the raw loop itself with the public API added (``run.resume`` before it,
  ``run.boundary(step)`` after every step, the stop-flag agreement included): what a
  user's own loop pays for hpc_ddp;
- ``own_mirror``: ``own`` with per-rank state tracked (``hpc_ddp.per_rank``: a counter and the
  step's 256 KB batch, as nanoGPT prefetches one), so every boundary copies it into a message and
  the mirror's thread sends it to the buddy rank (rank/salvage/mirror.py): what the per-rank mirror costs;
- ``own_mirror_counter``: ``own_mirror`` with the counter alone tracked (a message of a few hundred
  bytes): the mirror's cost per message (threads, send, receive) without its cost per byte;
- ``own_fill<size>`` / ``own_mirror_fill<size>`` (size ``8m``, ``64m``...): the own loop writing a per-rank
  buffer of that size at every step (a prefetched batch: every byte new), untracked, and tracked with
  ``per_rank`` so the mirror sends it whole at each boundary: the mirror's cost for a state that changes;
- ``own_derive_fill<size>``: ``own_mirror_fill<size>`` tracked with ``per_rank(..., mirror="derive")``: never sent
  (what the policy costs a step: nothing, it should read 1.0 x);
- ``own_every10_fill<size>``: ``own_mirror_fill<size>`` tracked with ``per_rank(..., mirror=10)``: copied and sent
  at about every tenth boundary, the others copy nothing (issue 59's cadence);
- ``own_mirror_same<size>``: a per-rank buffer of that size that never changes, tracked: the mirror compares
  it and sends "unchanged" (a header). At ``256k`` it is read against ``own``; at larger sizes the loop also
  rewrites an untracked buffer of the size, as ``own_fill<size>`` does, and is read against that (the same
  work but for the mirror, one variant fewer a size).

Steps/s is measured over the steady state only: from step ``warmup`` to the
last step, taken from the per-step callback. Rank 0 writes a JSON file.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from benchmarks import tasks
from hpc_ddp.rank.group import control

BATCH, LR = 64, 0.01


def size_of(name: str) -> int:
    """Bytes of a size suffix: ``256k``, ``8m``, ``64m``."""
    return int(name[:-1]) << (10 if name[-1] == "k" else 20)


def raw_loop(steps: int, warmup: int, run: Any = None, per_rank: str = "") -> float:
    """Steps/s of the tutorial's loop; with ``run``, the same loop with the public API's two calls added (and
    per-rank state tracked, with ``per_rank``: "batch" for a counter and the step's batch, "counter" for the
    counter alone, which leaves the mirror's cost per message without its cost per byte; "fill:<size>" for a
    buffer of that size rewritten at every step, tracked, "fill:<size>:untracked" the same untracked, and
    "same:<size>" for one that never changes, "same:<size>:fill" beside an untracked one rewritten)."""
    model = DistributedDataParallel(tasks.model())
    sampler = DistributedSampler(tasks.dataset(), seed=0)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    start, done = 0.0, 0
    seen: dict[str, Any] = {"steps": 0, "x": torch.zeros(BATCH, 1)}
    what, _, rest = per_rank.partition(":")
    size, _, extra = rest.partition(":")
    filled = None  # rewritten at every step, as a prefetched batch: every byte new (a memset)
    if what in ("fill", "same"):
        seen = {"big": torch.ones(size_of(size), dtype=torch.uint8)}
        filled = seen["big"] if what == "fill" else torch.ones_like(seen["big"]) if extra == "fill" else None
    if run is not None:
        from hpc_ddp import per_rank as mine

        if per_rank == "counter":
            del seen["x"]
        tracked = bool(what) and extra != "untracked"
        # derive: tracked, never mirrored; every10: sent about every 10 steps
        policy: str | int = {"derive": "derive", "every10": 10}.get(extra, "every_step")
        done = run.resume(model=model, optimizer=optimizer, **({"seen": mine(seen, mirror=policy)} if tracked else {}))
    for x, y in loader:
        if "steps" in seen:
            seen["steps"] += 1
        if "x" in seen:
            seen["x"] = x
        if filled is not None:
            filled.fill_(done % 251)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        done += 1
        if run is not None and run.boundary(done):
            break
        if done == warmup:
            start = time.perf_counter()
        if done == steps:
            break
    return (steps - warmup) / (time.perf_counter() - start)


def _run_for(variant: str, cfg: Any, on_step: Any = None) -> Any:
    """A Run as the session builds one, with the pieces the variant has."""
    from hpc_ddp.rank.state.checkpointer import Checkpointer
    from hpc_ddp.core.stopping import StopFlag
    from hpc_ddp.rank.loop.run import Run
    from hpc_ddp.core.slurm_env import from_environ, simulated_environ

    rank = dist.get_rank()
    env = ENV or from_environ({**simulated_environ(1, 2, job_id=1)[rank], "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": os.environ["MASTER_PORT"]})
    checkpointer = Checkpointer(Path(cfg.run_dir), cfg.snapshot, env, "b2") if variant in ("sync", "async") else None
    return Run(cfg, env, torch.device("cpu"), checkpointer=checkpointer,
               stop=StopFlag() if variant != "bare" else None, on_step=on_step)


def trainer_loop(steps: int, warmup: int, variant: str, every: int) -> float:
    """Steps/s of hpc_ddp's Trainer in one of the variants, or of the raw loop with the API (``own``)."""
    from hpc_ddp.core.config import load_config
    from hpc_ddp.rank.loop.trainer import Trainer

    with tempfile.TemporaryDirectory(dir=os.environ.get("HPC_DDP_BENCH_DIR")) as tmp:
        run_dirs: list[Any] = [tmp]
        dist.broadcast_object_list(run_dirs, src=0)  # one run dir for both ranks (rank 0's)
        snapshots = [f"snapshot.every_steps={every}", f"snapshot.async_write={variant == 'async'}"] if variant in (
            "sync", "async") else ["snapshot.every_steps=null"]
        cfg = load_config([], ["name=b2", f"run_dir={run_dirs[0]}", "train.task=benchmarks.tasks:BenchTask",
                               f"train.max_steps={steps}", f"train.batch_size={BATCH}", f"train.lr={LR}",
                               f"train.log_every={steps}", "snapshot.every_minutes=null", *snapshots])
        if variant.startswith("own"):
            run = _run_for("stop", cfg)
            rate = raw_loop(steps, warmup, run, per_rank=own_state(variant))
            run.finish()  # drains the last agreement in flight
            _count(variant, run.mirror)
            return rate
        times: dict[int, float] = {}
        run = _run_for(variant, cfg, on_step=lambda step: times.__setitem__(step, time.perf_counter()))
        Trainer(tasks.BenchTask(), cfg, run).train()
        dist.barrier()
    return (steps - warmup) / (times[steps] - times[warmup])


def own_state(variant: str) -> str:
    """``raw_loop``'s ``per_rank`` for an ``own...`` variant."""
    if variant.startswith(("own_fill", "own_mirror_fill", "own_mirror_same", "own_derive_fill",
                           "own_every10_fill")):
        what, size = ("same", variant[15:]) if "same" in variant else ("fill", variant.rpartition("fill")[2])
        extra = (":untracked" if variant.startswith("own_fill") else ":derive" if "derive" in variant
                 else ":every10" if "every10" in variant else ":fill" if what == "same" and size != "256k"
                 else "")
        return f"{what}:{size}{extra}"
    return {"own": "", "own_mirror": "batch", "own_mirror_counter": "counter"}[variant]


MIRRORED: dict[str, dict[str, int]] = {}  # per variant, over its rounds: what the mirror sent (rank 0's)


def _count(variant: str, mirror: Any) -> None:
    """Add what this rank's mirror sent to ``MIRRORED``: whole, delta and "unchanged" messages, states skipped
    (a newer one replaced them while a send was on its way), and bytes on the wire."""
    if mirror is None:
        return
    from hpc_ddp.rank.salvage.mirror_wire import BYTES, DELTA, FLAT, UNCHANGED

    kinds = mirror.sent_kinds
    got = {"whole": kinds[BYTES] + kinds[FLAT], "delta": kinds[DELTA], "unchanged": kinds[UNCHANGED],
           "skipped": mirror.skipped, "wire_bytes": mirror.wire_bytes}
    total = MIRRORED.setdefault(variant, dict.fromkeys(got, 0))
    for key, value in got.items():
        total[key] += value


ALL = ("raw", "raw2", "own", "own_mirror", "bare", "stop", "shared", "sync", "async")
# this rank's place when it is not rank r of one node's two (B2-MIRROR-NODES: nodes x tasks, on loopback or
# as a Slurm job's task): the Run's env, whose node count picks the mirror's buddy (the next node's)
ENV: Any = None


def worker(rank: int, out: str, rounds: int, steps: int, every: int, variants: tuple[str, ...] = ALL,
           geometry: tuple[int, int] = (1, 2)) -> None:
    global ENV
    torch.set_num_threads(1)
    if geometry != (1, 2):  # ranks of a simulated nodes x tasks on this machine (loopback)
        from hpc_ddp.core.slurm_env import from_environ, simulated_environ

        ENV = from_environ({**simulated_environ(*geometry, job_id=1)[rank], "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": os.environ["MASTER_PORT"]})
    if ENV is not None:
        dist.init_process_group("gloo", init_method=f"tcp://{ENV.master_addr}:{ENV.master_port}", rank=ENV.rank,
                                world_size=ENV.world_size)
        rank = ENV.rank
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    control.open_group("gloo")  # as hpc_ddp's own init does: the control traffic on a gloo group of its own
    own_group = control.group()
    # a mirror=10 variant allocates its three buffers at its first three copied boundaries (steps 1, 11 and 21:
    # about a second each for 64 MB on these shared cores, once an attempt): the steady state starts after them
    warmup = max(5, steps // 10, *(31 for v in variants if "every10" in v))
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            if variant.startswith("raw"):
                rate = raw_loop(steps, warmup)
            elif variant == "shared":
                control._GROUP = None  # the measurement's one reach inside: the agreement on the default group
                rate = trainer_loop(steps, warmup, "stop", every)
                control._GROUP = own_group
            else:
                rate = trainer_loop(steps, warmup, variant, every)
            samples[variant].append(rate)
    if rank == 0:
        Path(out).write_text(json.dumps({"samples": samples, "steps": steps, "every": every, "mirrored": MIRRORED}))
    dist.barrier()
    dist.destroy_process_group()


def run(out: Path, rounds: int, steps: int, every: int, port: int, variants: tuple[str, ...] = ALL,
        geometry: tuple[int, int] = (1, 2)) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    mp.spawn(worker, args=(str(out), rounds, steps, every, variants, geometry), nprocs=geometry[0] * geometry[1],
             join=True)
    return json.loads(out.read_text())


if __name__ == "__main__":
    if sys.argv[1] == "--slurm":  # one task of a Slurm step: its place from Slurm's variables, as a job's ranks
        from hpc_ddp.core.slurm_env import from_environ

        os.environ["OMP_NUM_THREADS"] = "1"
        ENV = from_environ(os.environ)
        worker(ENV.rank, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
               tuple(sys.argv[6].split(",")))
    else:
        nodes, _, per_node = (sys.argv[7] if len(sys.argv) > 7 else "1x2").partition("x")
        print(json.dumps(run(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                             int(sys.argv[5]), tuple(sys.argv[6].split(",")) if len(sys.argv) > 6 else ALL,
                             (int(nodes), int(per_node)))))
