"""A task that writes down which samples each micro-batch used: the elastic-resume tests read it back.

No dropout and no randomness in the data, so runs at different world sizes differ only in the
order floats are summed. Each process appends one line per micro-batch to
``RUN_DIR/ids/JOB-RESTART-RANK.jsonl``; the ledger's first step and accumulation of that attempt
say which optimizer step each line belongs to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from examples.mlp import MLPTask, SyntheticRegression
from hpc_ddp.core.config import RunConfig


class WithIds(Dataset[Any]):
    def __init__(self, inner: SyntheticRegression) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        return (*self.inner[index], index)


class IdsTask(MLPTask):
    samples = 256

    def build_dataset(self, cfg: RunConfig) -> Dataset[Any]:
        name = f"{os.environ.get('SLURM_JOB_ID', '0')}-{os.environ.get('SLURM_RESTART_COUNT', '0')}-{dist.get_rank()}"
        self.record = Path(cfg.run_dir) / "ids" / f"{name}.jsonl"
        self.record.parent.mkdir(parents=True, exist_ok=True)
        return WithIds(SyntheticRegression(self.samples, self.features, seed=7))

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets, ids = batch
        with open(self.record, "a") as out:
            out.write(json.dumps(ids.tolist()) + "\n")
        return torch.nn.functional.mse_loss(model(inputs), targets)
