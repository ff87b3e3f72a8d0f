"""A torchrun-style DDP script in the shape of PyTorch's multi-node tutorial (multinode.py).

It knows nothing of hpc_ddp: it reads LOCAL_RANK/RANK from the environment, joins
the process group with ``init_process_group()``, trains for some epochs, saves a
snapshot every ``--save-every`` epochs and resumes from it when the file exists.
Launch it with torchrun, or as an hpc_ddp script (no torchrun process needed):

    torchrun --nproc-per-node=2 examples/torchrun_script.py --epochs 4 --snapshot /tmp/snap.pt
    python -m hpc_ddp.submit examples/torchrun_script.yaml --local --preempt-at 30

Under hpc_ddp the stop signal ends it (it has no handler), the attempt is recorded as
a time-out or preemption, and the requeued job runs it again: it resumes from its
last epoch snapshot. (For an exact resume at a step, use hpc_ddp's run API instead.)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.model, self.data, self.optimizer = model.to(self.device), data, optimizer
        self.save_every, self.snapshot_path = save_every, snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print(f"[rank {self.global_rank}] loading snapshot {snapshot_path}", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if self.device.type == "cuda" else None)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.global_rank}] resuming training from snapshot at epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def _run_epoch(self, epoch: int) -> None:
        self.data.sampler.set_epoch(epoch)
        for i, (source, targets) in enumerate(self.data):
            loss = self._run_batch(source.to(self.device), targets.to(self.device))
            if self.global_rank == 0:
                print(f"[rank 0] epoch {epoch} step {epoch * len(self.data) + i + 1} loss {loss:.4f}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)  # a kill mid-save keeps the old one
        print(f"[rank 0] epoch {epoch} | training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description="a torchrun-style DDP script")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--snapshot", default="snapshot.pt")
    args = parser.parse_args()
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(2048, 20), torch.randn(2048, 1))
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(data))
    trainer = Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=1e-2), args.save_every, args.snapshot)
    trainer.train(args.epochs)
    barrier()  # every rank done with its last collective before any tears the group down (a gloo peer that
    destroy_process_group()  # closed first aborted the other at exit, "terminate called", under load)


if __name__ == "__main__":
    main()
