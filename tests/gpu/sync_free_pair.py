"""Two ranks on one GPU, each a node: the per-step protocol at world size 2 never syncs the host with the GPU.

"The per-step protocol never waits for the GPU" rested on world size 1 (tests/gpu/sync_free_loop.py), where the
stop agreement, the two-level groups, the buffer broadcast and the mirror never run (issue 58). NCCL refuses two
ranks on one device, so the process group here is gloo while the model (with BatchNorm, whose buffers the boundary
broadcasts from rank 0) and a per-rank prefetched batch live on the GPU. Every ``run.boundary`` after the first
runs under ``torch.cuda.set_sync_debug_mode("warn")``, and every such warning raised on the training thread inside
the boundary is recorded with its stack (``"error"`` would also fire in the mirror's sender thread, which waits for
its copies off the training thread by design, and end the exchange). torch.distributed's own calls are not covered
by the debug mode (torch's docs), so gloo's copies of CUDA tensors through the host do not count.

Run by tests/gpu/test_gpu.py (``spawn_ranks(rank_main, 2, 1, run_dir)``); each rank puts (rank, syncs, whether rank
0's buffers were held after the broadcast, the newest step its mirror sent, the steps it holds of its ward).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

STEPS = 30
# "cpu": the same protocol without the debug mode, rehearsed where no GPU is (tests/rank/test_device_clock.py)
DEVICE_VAR = "HPC_DDP_PAIR_DEVICE"


def rank_main(environ: dict[str, str], run_dir: str, out: Any) -> None:
    """One rank (module docstring); an exception is put on ``out`` as the rank's answer, so the test fails at
    once with it rather than waiting out its timeout for an answer that never comes."""
    try:
        _rank(environ, run_dir, out)
    except Exception as err:  # noqa: BLE001 - the test shows it
        out.put((int(environ["SLURM_PROCID"]), [f"{type(err).__name__}: {err}"], None, None, None))


def _rank(environ: dict[str, str], run_dir: str, out: Any) -> None:
    os.environ.update(environ)
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from hpc_ddp import per_rank
    from hpc_ddp.core.config import load_config
    from hpc_ddp.core.slurm_env import from_environ
    from hpc_ddp.core.stopping import StopFlag
    from hpc_ddp.rank.group.distributed import init_process_group, teardown
    from hpc_ddp.rank.loop.run import Run
    from hpc_ddp.rank.state.checkpointer import Checkpointer

    env = from_environ(environ)
    cfg = load_config([], ["name=pair", f"run_dir={run_dir}", "train.loop=a.b:c", "dist.backend=gloo",
                           "snapshot.every_steps=null", "snapshot.every_minutes=null",
                           f"slurm.nodes={env.num_nodes}", f"slurm.tasks_per_node={env.local_world_size}"])
    init_process_group(env, cfg.dist, own_control_group=True)
    device = torch.device(os.environ.get(DEVICE_VAR, "cuda:0"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 64))
    model = DistributedDataParallel(net.to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prefetched = {"batch": torch.randn(32, 64, device=device)}
    run = Run(cfg, env, device, stop=StopFlag(), checkpointer=Checkpointer(Path(run_dir), cfg.snapshot, env, "pair"))
    step = run.resume(model=model, optimizer=optimizer, prefetch=per_rank(prefetched))
    syncs: list[str] = []
    training = threading.get_ident()

    def seen(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if threading.get_ident() == training and "synchroniz" in str(message):
            syncs.append(f"{filename}:{lineno}: {message}\n" + "".join(traceback.format_stack(limit=14)))

    while step < STEPS:
        model(prefetched["batch"]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        prefetched["batch"] = torch.randn(32, 64, device=device)  # the next batch, drawn on the GPU (per rank)
        step += 1
        if step == 1:
            run.boundary(step)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown, warnings.showwarning = warnings.showwarning, seen
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                run.boundary(step)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = shown
    synced = bool(run.held is not None and run.held.buffers_synced)
    mirror = run.mirror
    deadline = time.monotonic() + 10  # the last messages may still be on their way, both ways
    if mirror is not None:
        mirror.wait_sent(STEPS, 10)
        while (mirror.kept is None or mirror.kept[0] < STEPS) and time.monotonic() < deadline:
            time.sleep(0.05)
    sent = mirror.sent if mirror is not None else -1
    ward = sorted(mirror.held().get(mirror.ward, {})) if mirror is not None else []
    run.finish()
    teardown()
    out.put((env.rank, syncs, synced, sent, ward))
