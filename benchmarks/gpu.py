"""B2-GPU: what the run API costs a GPU loop, and what snapshots of a CUDA state block (only where CUDA is present).

One process per visible GPU, NCCL, bf16 autocast, a small GPT (examples/own_loop_gpt.py's)
whose steps take a few milliseconds: the case where a host-device sync per step would show.
Variants, interleaved round by round:

- ``raw``: a plain DDP loop (DataLoader, autocast, forward, backward, AdamW step), and ``raw2``,
  the same again: raw2 / raw is the noise floor every other ratio is read against;
- ``own``: the same loop with ``run.resume`` before it and ``run.boundary(step)`` after every
  step (the stop agreement on the CPU control group), no snapshot due;
- ``trainer``: hpc_ddp's Trainer on the same model, data and optimizer, no snapshot due;
- ``sync`` / ``async``: ``own`` with a snapshot every ``every`` steps.

Each ratio is the median of the per-round ratios (each round runs every variant once, in turn),
with their quartiles beside it. Then a state of 2048 MB on the GPU: a sync snapshot against
dd (GB/s) and the time an async snapshot blocks the loop (benchmarks/snapshots.py's B3 figures with
the state on CUDA, written through the device-to-host pipeline, hpc_ddp/rank/state/pipeline.py), and
B8's replication check with both of its states on the GPU. ``--pipeline`` measures the snapshot of the
CUDA state alone (B2-GPU-PIPELINE: a few tens of seconds, no training loops), with one writer thread
against two on the machine's disk.

``--smoke`` runs the same code on the CPU with gloo and tiny sizes: it checks the benchmark
itself on a machine without a GPU, and its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import PIPELINE_TARGET, median, per_round  # noqa: E402
from examples.own_loop_gpt import GPT  # noqa: E402

VOCAB, LENGTH, BATCH, LR = 65, 64, 64, 3e-4


def tokens(count: int = 4096) -> torch.utils.data.TensorDataset:
    data = torch.randint(0, VOCAB, (count, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])


class GPTTask:
    """The same model, data and optimizer as the raw loop, as an hpc_ddp Task (the Trainer variant)."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        return GPT(VOCAB)

    def build_dataset(self, cfg: Any) -> torch.utils.data.Dataset:
        return tokens()

    def build_optimizer(self, model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def loop(device: torch.device, steps: int, warmup: int, run: Any = None) -> float:
    """Steps/s of the plain DDP loop; with ``run``, the same loop with the run API's two calls."""
    from torch.nn.parallel import DistributedDataParallel

    from hpc_ddp.rank.loop.sampler import ShardSampler

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(VOCAB).to(device), device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    import torch.distributed as dist

    data = tokens()
    sampler = ShardSampler(len(data), dist.get_rank(), dist.get_world_size(), seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True,
                                         pin_memory=device.type == "cuda")
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    step = run.resume(model=model, optimizer=optimizer, sampler=sampler) if run is not None else 0
    start = 0.0
    while step < steps:
        for x, y in (sampler.iterate(loader) if run is not None else loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with amp:
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == warmup:
                _sync(device)
                start = time.perf_counter()
            if (run is not None and run.boundary(step)) or step == steps:
                break
    _sync(device)
    return (steps - warmup) / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(run_dir: str, steps: int, variant: str, every: int) -> Any:
    from hpc_ddp.core.config import load_config

    snapshots = [f"snapshot.every_steps={every}", f"snapshot.async_write={variant == 'async'}"] if variant in (
        "sync", "async") else ["snapshot.every_steps=null"]
    return load_config([], ["name=b2gpu", f"run_dir={run_dir}", "train.task=benchmarks.gpu:GPTTask",
                            f"train.max_steps={steps}", f"train.batch_size={BATCH}", f"train.lr={LR}",
                            f"train.log_every={steps}", "train.amp=bf16", "snapshot.every_minutes=null", *snapshots])


def variant_rate(variant: str, env: Any, device: torch.device, steps: int, warmup: int, every: int) -> float:
    from hpc_ddp.rank.group import control
    from hpc_ddp.rank.state.checkpointer import Checkpointer
    from hpc_ddp.core.stopping import StopFlag
    from hpc_ddp.rank.loop.run import Run
    from hpc_ddp.rank.loop.trainer import Trainer

    if variant in ("raw", "raw2"):
        return loop(device, steps, warmup)
    with tempfile.TemporaryDirectory(dir=os.environ.get("HPC_DDP_BENCH_DIR")) as tmp:
        cfg = _config(control.from_main(tmp), steps, variant, every)  # rank 0's directory on every rank
        ckpt = Checkpointer(Path(cfg.run_dir), cfg.snapshot, env, "b2gpu") if variant in ("sync", "async") else None
        times: dict[int, float] = {}

        def on_step(step: int) -> None:
            if step in (warmup, steps):
                _sync(device)
                times[step] = time.perf_counter()
        run = Run(cfg, env, device, checkpointer=ckpt, stop=StopFlag(), on_step=on_step if variant == "trainer"
                  else None)
        if variant == "trainer":
            Trainer(GPTTask(), cfg, run).train()
            rate = (steps - warmup) / (times[steps] - times[warmup])
        else:
            rate = loop(device, steps, warmup, run)
            run.finish()
        control.barrier()
    return rate


def worker(rank: int, world: int, port: int, out: str, rounds: int, steps: int, every: int, smoke: bool) -> None:
    from hpc_ddp.core.config import DistConfig
    from hpc_ddp.rank.group.distributed import init_process_group, teardown
    from hpc_ddp.core.slurm_env import from_environ, simulated_environ

    env = from_environ({**simulated_environ(1, world, job_id=1)[rank], "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)})
    device = init_process_group(env, DistConfig(backend="gloo" if smoke else "nccl", timeout_s=300))
    variants = ["raw", "raw2", "own", "trainer", "sync", "async"]
    samples: dict[str, list[float]] = {v: [] for v in variants}
    warmup = max(5, steps // 10)
    for _ in range(rounds):
        for variant in variants:
            samples[variant].append(variant_rate(variant, env, device, steps, warmup, every))
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    teardown()


def figures(rounds: int, steps: int, every: int, state_mb: float, smoke: bool) -> dict[str, Any]:
    from benchmarks.snapshots import replication_figures, snapshot_figures
    from hpc_ddp.rehearsal.local import free_port

    world = 1 if smoke else torch.cuda.device_count()
    device = "cpu" if smoke else "cuda"
    with tempfile.TemporaryDirectory(dir=os.environ.get("HPC_DDP_BENCH_DIR")) as tmp:
        out = Path(tmp) / "rates.json"
        mp.spawn(worker, args=(world, free_port(), str(out), rounds, steps, every, smoke), nprocs=world, join=True)
        samples = json.loads(out.read_text())
        rates = {name: median(values) for name, values in samples.items()}
        state = snapshot_figures(state_mb, Path(tmp), 2 if smoke else 3, device=device)
        replication = replication_figures(min(state_mb, 1000), Path(tmp), 2 if smoke else 5, device=device)
    own, own_iqr = per_round(samples, "own", "raw")
    trainer, trainer_iqr = per_round(samples, "trainer", "raw")
    floor, floor_iqr = per_round(samples, "raw2", "raw")
    return {"device": "CPU (smoke run: the figures mean nothing)" if smoke else torch.cuda.get_device_name(0),
            "world_size": world, "steps_per_s": {k: round(v, 2) for k, v in rates.items()},
            "own_loop_vs_raw": round(own, 3), "own_loop_iqr": own_iqr, "trainer_vs_raw": round(trainer, 3),
            "trainer_iqr": trainer_iqr, "raw_vs_raw": round(floor, 3), "raw_vs_raw_iqr": floor_iqr,
            "sync_snapshots_vs_raw": round(per_round(samples, "sync", "raw")[0], 3),
            "async_snapshots_vs_raw": round(per_round(samples, "async", "raw")[0], 3),
            "replication": {name: replication[name] for name in ("gpt", "large", "state_mb", "met")},
            "state_mb": state["size_mb"], "sync_gb_s": round(state["sync_mb_s"] / 1024, 2),
            "dd_gb_s": round(state["dd_mb_s"] / 1024, 2), "async_blocked_s": state["async_blocked_s"],
            "sync_s": state["sync_s"], "async_blocked_vs_sync": state["async_blocked_vs_sync"],
            "sync_vs_dd": state["sync_vs_dd"], "first_sync_s": state["first_sync_s"],
            "pipeline": True,  # measured with the device-to-host pipeline (the figures before it have no such key)
            "target": "own loop + run API >= 0.99 x raw (no snapshot); async blocked <= 0.1 x sync",
            "met": None if smoke else own >= 0.99 and state["async_blocked_vs_sync"] <= 0.1,
            "rounds": rounds, "steps": steps, "snapshot_every": every,
            "workload": f"GPT {VOCAB}-token vocab, {LENGTH} tokens, batch {BATCH}/rank, bf16 autocast, AdamW"}


def pipeline_figures(state_mb: float, repeats: int, device: str = "cuda") -> dict[str, Any]:
    """The snapshot of a CUDA state alone, without the training loops (B2-GPU-PIPELINE, a few tens of seconds
    where B2-GPU takes minutes): a sync snapshot through the device-to-host pipeline against dd, the time an
    async one blocks the step, the first snapshot of the process (it allocates the pinned memory), and one
    writer thread against two on that machine's disk (benchmarks/writers.py)."""
    from benchmarks.snapshots import snapshot_figures
    from benchmarks.writers import writer_threads

    with tempfile.TemporaryDirectory(dir=os.environ.get("HPC_DDP_BENCH_DIR")) as tmp:
        state = snapshot_figures(state_mb, Path(tmp), repeats, device=device)
        writers = writer_threads(Path(tmp), 512 if device == "cuda" else 64, max(3, repeats))
    gb_s = round(state["sync_mb_s"] / 1024, 2)
    return {"device": torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke run)",
            "state_mb": state["size_mb"], "sync_gb_s": gb_s, "dd_gb_s": round(state["dd_mb_s"] / 1024, 2),
            "sync_vs_dd": state["sync_vs_dd"], "sync_s": state["sync_s"], "async_blocked_s": state["async_blocked_s"],
            "async_blocked_vs_sync": state["async_blocked_vs_sync"], "first_sync_s": state["first_sync_s"],
            "writers": writers, "repeats": repeats, "target": PIPELINE_TARGET.split(";")[0],
            "met": None if device != "cuda" else state["sync_vs_dd"] >= 0.8}


def b2_gpu_pipeline(quick: bool) -> dict[str, Any]:
    """The B2-GPU-PIPELINE section of benchmarks/run.py: measured where CUDA is, else says so."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU on the machine that ran it", "met": None}
    return pipeline_figures(500 if quick else 2048, 2 if quick else 3)


def b2_gpu(quick: bool) -> dict[str, Any]:
    """The B2-GPU section of benchmarks/run.py: measured where CUDA is, else says so (never estimated)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU on the machine that ran it", "met": None}
    return figures(1 if quick else 9, 100 if quick else 400, 50, 500 if quick else 2048, smoke=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="run the benchmark's code on the CPU (gloo), tiny sizes")
    parser.add_argument("--pipeline", action="store_true", help="only the CUDA state's snapshot figures "
                        "(B2-GPU-PIPELINE); with --smoke, on the CPU")
    args = parser.parse_args(argv)
    if args.pipeline:
        result = pipeline_figures(20, 2, device="cpu") if args.smoke else b2_gpu_pipeline(quick=False)
    else:
        result = figures(1, 20, 5, 20, smoke=True) if args.smoke else b2_gpu(quick=False)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
