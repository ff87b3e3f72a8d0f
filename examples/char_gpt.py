"""A small character-level GPT, in the spirit of nanoGPT, on the opening of Shakespeare's Coriolanus.

The text (examples/data/tinyshakespeare.txt, public domain, the first 32 KB of
the "tiny shakespeare" corpus) is shipped with the repo. Small enough to train
on CPU as 2 nodes x 2 tasks in a couple of minutes; the loss falls from ln(vocab)
~ 4 towards 2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from hpc_ddp.core.config import RunConfig

TEXT = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
BLOCK, LAYERS, HEADS, EMBED, STRIDE = 64, 2, 4, 96, 4


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every STRIDE-th window of BLOCK+1 characters: input = first BLOCK, target = shifted by one."""

    def __init__(self, text: str) -> None:
        self.vocab = sorted(set(text))
        lookup = {ch: i for i, ch in enumerate(self.vocab)}
        self.data = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)

    def __len__(self) -> int:
        return (len(self.data) - BLOCK - 1) // STRIDE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[index * STRIDE: index * STRIDE + BLOCK + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.qkv, self.proj = nn.Linear(EMBED, 3 * EMBED), nn.Linear(EMBED, EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(EMBED, dim=2)
        q, k, v = (t.view(batch, length, HEADS, EMBED // HEADS).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, EMBED))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, EMBED), nn.Embedding(BLOCK, EMBED)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln, self.head = nn.LayerNorm(EMBED), nn.Linear(EMBED, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tokens(idx) + self.positions(positions))))


class CharGPTTask:
    def __init__(self) -> None:
        self.dataset = CharWindows(TEXT.read_text())

    def build_model(self, cfg: RunConfig) -> nn.Module:
        return CharGPT(len(self.dataset.vocab))

    def build_dataset(self, cfg: RunConfig) -> Dataset[Any]:
        return self.dataset

    def build_optimizer(self, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.01)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> Any:
        total, warmup = cfg.train.max_steps or 1000, 20
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
