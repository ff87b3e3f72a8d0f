"""Your own training loop, nanoGPT style, made preemption-proof by hpc_ddp's run API.

A small character-level GPT (dropout, AdamW, warmup + cosine learning rate, gradient
accumulation, bf16 autocast, gradient clipping) on the Shakespeare text shipped in
examples/data. It is a plain DDP loop; the lines marked ``# hpc_ddp`` are all that
hpc_ddp adds (docs/own-loop.md shows them as a diff). Launch it any of these ways:

    python -m hpc_ddp.submit examples/own_loop_gpt.yaml --local --preempt-at 20   # rehearse here, 2 x 2 CPU ranks
    python -m hpc_ddp.submit examples/own_loop_gpt.yaml slurm.gpus_per_node=4 slurm.tasks_per_node=4 train.amp=bf16
    srun python examples/own_loop_gpt.py          # standalone under srun or torchrun: hpc_ddp.session() below

Hyperparameters come from the run's config (``run.config.train``): batch_size,
grad_accum (or global_batch_size), lr, max_steps, amp, clip_grad_norm, num_workers, seed, log_every.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file: find `examples` and `hpc_ddp`

import hpc_ddp  # noqa: E402  # hpc_ddp
from examples.char_gpt import BLOCK, TEXT, CharWindows  # noqa: E402

EMBED, HEADS, LAYERS, DROPOUT = 96, 4, 2, 0.1
WARMUP_STEPS, MIN_LR_FRACTION = 10, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.qkv, self.proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED),
                                 nn.Dropout(DROPOUT))
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, HEADS, EMBED // HEADS).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(EMBED, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=DROPOUT if self.training else 0.0)
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(batch, length, EMBED)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, EMBED), nn.Embedding(BLOCK, EMBED)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln, self.head = nn.LayerNorm(EMBED), nn.Linear(EMBED, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.drop(self.tokens(idx) + self.positions(positions)))))


def lr_at(step: int, max_steps: int, peak: float) -> float:
    """Linear warmup, then cosine decay to MIN_LR_FRACTION of the peak (nanoGPT's get_lr)."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = min(1.0, (step - WARMUP_STEPS) / max(1, max_steps - WARMUP_STEPS))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(run: hpc_ddp.Run) -> None:  # hpc_ddp: the function train.loop names; `run` is hpc_ddp's
    cfg = run.config.train
    torch.manual_seed(cfg.seed)  # the same initial parameters on every rank
    data = CharWindows(TEXT.read_text())
    model = DDP(GPT(len(data.vocab)).to(run.device), device_ids=run.device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    accum = run.batch.grad_accum  # hpc_ddp: micro-steps at this world size (train.global_batch_size fixes the batch)
    sampler = hpc_ddp.ShardSampler(len(data), run.rank, run.world_size, seed=cfg.seed,  # hpc_ddp: global position
                                   global_batch=run.batch.global_batch)
    # worker_init: the workers ignore the stop signals Slurm sends every process of the step, so a scancel or a
    # preemption reaches the loop, which stops at its next boundary with a snapshot. forkserver: a fork of a
    # process whose gloo threads hold a lock can hang in os.fork(); a forkserver's children are forked from a
    # server without threads (and hpc_ddp has it import torch once, so each epoch's workers start in ms).
    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        num_workers=cfg.num_workers, pin_memory=run.device.type == "cuda",
                        multiprocessing_context="forkserver" if cfg.num_workers else None,
                        worker_init_fn=hpc_ddp.worker_init())  # hpc_ddp: a stop spares the loader workers
    max_steps = cfg.max_steps or 200
    step = run.resume(model=model, optimizer=optimizer, sampler=sampler)  # hpc_ddp: 0 on a fresh start

    def batches():  # endless: one epoch after another, from the resumed position
        while True:
            yield from sampler.iterate(loader)  # hpc_ddp: counts what the loop took (for an exact resume)

    micro_batches = batches()
    while step < max_steps:
        lr = lr_at(step, max_steps, cfg.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(accum):
            inputs, targets = (t.to(run.device, non_blocking=True) for t in next(micro_batches))
            sync = micro == accum - 1  # all-reduce the gradients once per optimizer step
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"):
                    logits = model(inputs)
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
                (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm or 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_every == 0 or step == max_steps:
            run.log_metrics(step, loss=loss.item(), lr=lr)  # hpc_ddp: metrics.jsonl (rank 0), read by status
            if run.is_main:
                print(f"step {step}/{max_steps} loss {loss.item():.4f} lr {lr:.2e}", flush=True)
        if run.boundary(step):  # hpc_ddp: snapshot when due; True once every rank agreed to stop
            return  # hpc_ddp: the stop snapshot is committed; the job is requeued and resumes here


if __name__ == "__main__":
    with hpc_ddp.session() as run:  # hpc_ddp: standalone, under srun or torchrun
        train(run)
