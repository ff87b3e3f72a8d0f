"""50 steps of an own DDP loop on NCCL with the run API, under ``torch.cuda.set_sync_debug_mode("error")``.

Run by tests/gpu/test_gpu.py in a process of its own (world size 1, NCCL): any host-device
synchronisation in a step (an ``.item()`` or ``.tolist()`` of a CUDA tensor, a blocking copy)
raises there. Prints ``no sync in 50 steps`` when none did.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpc_ddp.checkpointer import Checkpointer  # noqa: E402
from hpc_ddp.config import load_config  # noqa: E402
from hpc_ddp.distributed import init_process_group, teardown  # noqa: E402
from hpc_ddp.preemption import StopFlag  # noqa: E402
from hpc_ddp.run import Run  # noqa: E402
from hpc_ddp.slurm_env import from_environ, simulated_environ  # noqa: E402


def main() -> None:
    from torch.nn.parallel import DistributedDataParallel

    env = from_environ({**simulated_environ(1, 1, job_id=1)[0], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config([], ["name=sync", f"run_dir={tmp}", "train.loop=a.b:c", "dist.backend=nccl",
                               "snapshot.every_steps=1000", "snapshot.every_minutes=null"])
        device = init_process_group(env, cfg.dist)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                                            torch.nn.Linear(256, 256)).to(device), device_ids=[device])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = Run(cfg, env, device, checkpointer=Checkpointer(Path(tmp), cfg.snapshot, env, "sync"), stop=StopFlag())
        step = run.resume(model=model, optimizer=optimizer)
        x = torch.randn(64, 256, device=device)

        def one_step() -> bool:
            nonlocal step
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            return run.boundary(step)
        for _ in range(5):  # warm-up: DDP builds its buckets, AdamW its state
            one_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(50):
            assert not one_step()
        torch.cuda.set_sync_debug_mode(0)
        run.finish()
        teardown()
    print("no sync in 50 steps")


if __name__ == "__main__":
    main()
