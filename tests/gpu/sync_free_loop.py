"""50 steps on NCCL under ``torch.cuda.set_sync_debug_mode("error")``: an own loop with the run API, or the Trainer.

Run by tests/gpu/test_gpu.py in a process of its own (world size 1, NCCL):
``python tests/gpu/sync_free_loop.py own|own-fp16|trainer``. Any host-device synchronisation in a step
(an ``.item()`` or ``.tolist()`` of a CUDA tensor, a blocking copy) raises there. Prints
``no sync in 50 steps (VARIANT)`` when none did. The Trainer logs only at ``train.log_every``
(its loss is read back then, on purpose), so the 50 checked steps fall between two log steps.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpc_ddp.rank.state.checkpointer import Checkpointer  # noqa: E402
from hpc_ddp.core.config import load_config  # noqa: E402
from hpc_ddp.rank.group.distributed import init_process_group, teardown  # noqa: E402
from hpc_ddp.core.stopping import StopFlag  # noqa: E402
from hpc_ddp.rank.loop.run import Run  # noqa: E402
from hpc_ddp.core.slurm_env import from_environ, simulated_environ  # noqa: E402

WARMUP, CHECKED = 5, 50  # warm-up: DDP builds its buckets, AdamW its state


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))


class SquareTask:
    """The Trainer's variant: the same model, random inputs, a loss with no target."""

    def build_model(self, cfg: Any) -> torch.nn.Module:
        return model()

    def build_dataset(self, cfg: Any) -> torch.utils.data.Dataset:
        return torch.utils.data.TensorDataset(torch.randn(4096, 256, generator=torch.Generator().manual_seed(0)))

    def build_optimizer(self, net: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(net.parameters(), lr=1e-3)

    def loss(self, net: torch.nn.Module, batch: Any) -> torch.Tensor:
        return net(batch[0]).float().pow(2).mean()


def checked(step: int) -> None:
    """Sync debug mode on for steps WARMUP+1 .. WARMUP+CHECKED (the boundary calls this at each step's end)."""
    if step == WARMUP:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    elif step == WARMUP + CHECKED:
        torch.cuda.set_sync_debug_mode(0)


def own_loop(run: Run, device: torch.device, fp16: bool = False) -> None:
    """bf16 autocast; or (``fp16``) fp16 with a tracked GradScaler, whose state_dict() would call .item() twice
    at every boundary (rank/salvage/held.py clones its tensors instead), and a fused AdamW, whose step takes the scaler's
    inf check on the GPU (another optimizer's GradScaler.step reads it back: a sync of torch's, not ours)."""
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model().to(device), device_ids=[device])
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fp16)
    scaler = torch.amp.GradScaler("cuda", enabled=fp16)
    step = run.resume(model=net, optimizer=optimizer, **({"scaler": scaler} if fp16 else {}))
    x = torch.randn(64, 256, device=device)
    while step < WARMUP + CHECKED:
        with torch.autocast("cuda", dtype=torch.float16 if fp16 else torch.bfloat16):
            loss = net(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        assert not run.boundary(step)
    run.finish()


def main(variant: str) -> None:
    from hpc_ddp.rank.loop.trainer import Trainer

    env = from_environ({**simulated_environ(1, 1, job_id=1)[0], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    with tempfile.TemporaryDirectory() as tmp:
        program = (["train.loop=a.b:c"] if variant.startswith("own") else
                   ["train.task=tests.gpu.sync_free_loop:SquareTask", "train.batch_size=64", "train.amp=bf16",
                    f"train.max_steps={WARMUP + CHECKED + 5}", "train.log_every=1000"])
        cfg = load_config([], ["name=sync", f"run_dir={tmp}", "dist.backend=nccl", "snapshot.every_steps=1000",
                               "snapshot.every_minutes=null", *program])
        device = init_process_group(env, cfg.dist)
        run = Run(cfg, env, device, checkpointer=Checkpointer(Path(tmp), cfg.snapshot, env, "sync"), stop=StopFlag(),
                  on_step=checked)
        if variant.startswith("own"):
            own_loop(run, device, fp16=variant == "own-fp16")
        else:
            Trainer(SquareTask(), cfg, run).train()
        teardown()
    print(f"no sync in {CHECKED} steps ({variant})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "own")
