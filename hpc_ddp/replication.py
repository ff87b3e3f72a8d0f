"""Is what the loop tracks as replicated really the same on every rank? Checked at each snapshot.

A snapshot keeps one copy of the replicated state, cut into slices that come from
different nodes. If a tracked object differs by rank (a model not wrapped in DDP, a
dict of per-rank counters, a batch drawn from each rank's RNG), that copy is a mix of
ranks and the resume is silently wrong. So before anything is written, every rank
fingerprints each replicated object and one all_reduce of a few int64 compares them.

A fingerprint hashes every leaf: small tensors (up to 64 KiB) whole, larger ones as an
evenly strided sample of 4096 elements plus their shape and dtype, and other values by
``repr``. A mismatch is an error on every rank alike, naming the object, its first
differing key and the ranks that differ, with the fix: wrap it in DDP, or track it with
``hpc_ddp.per_rank``. Costs are in docs/performance.md (B10).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator, Mapping, Set
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp import control
from hpc_ddp.errors import UsageError, explain

WHOLE_BYTES = 64 * 1024  # tensors up to this size are hashed whole
SAMPLES = 4096  # elements sampled from a larger tensor
MASK = (1 << 62) - 1  # digests fit an int64 with room to negate


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, leaf) in a stable order: dicts by key (sorted as text), lists and tuples by index."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from leaves(value[key], f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    if flat.numel() * flat.element_size() > WHOLE_BYTES:
        flat = flat[::max(1, flat.numel() // SAMPLES)][:SAMPLES]
    data = flat.to("cpu").contiguous()
    raw = ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()) if data.numel() else b""
    return f"{tensor.dtype}{tuple(tensor.shape)}".encode() + raw


def leaf_digest(value: Any) -> int:
    raw = _tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & MASK


def digests(state: Any) -> list[tuple[str, int]]:
    """Every leaf's (path, digest) of one object's state."""
    return [(path, leaf_digest(leaf)) for path, leaf in leaves(state)]


def combined(items: list[tuple[str, int]]) -> int:
    """One object's fingerprint: its leaves' paths and digests together."""
    raw = "\n".join(f"{path}={d}" for path, d in items).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & MASK


def first_difference(per_rank: list[list[tuple[str, int]]]) -> tuple[str, list[int]]:
    """The first key whose digest is not the same on every rank, and the ranks that differ from rank 0."""
    maps = [dict(items) for items in per_rank]
    for path in dict.fromkeys(p for items in per_rank for p, _ in items):
        values = [m.get(path) for m in maps]
        if len(set(values)) > 1:
            return path or "(the value itself)", [r for r, v in enumerate(values) if v != values[0]]
    return "(its keys)", [r for r, m in enumerate(maps) if m.keys() != maps[0].keys()]


def check(states: Mapping[str, Any], step: int, modules: Set[str] = frozenset()) -> None:
    """Collective: raise the same UsageError on every rank when a replicated object differs by rank.
    ``modules``: the names that are modules (the fix then is DDP); for others it is computing them alike."""
    names = sorted(states)
    if not names or dist.get_world_size() == 1:
        return
    items = {name: digests(states[name]) for name in names}
    values = torch.tensor([combined(items[n]) for n in names], dtype=torch.int64)
    both = control.max_of(torch.cat([values, -values]))  # one all_reduce (CPU) gives max and (negated) min
    top, bottom = both.tensor_split(2)
    differing = [n for n, hi, lo in zip(names, top.tolist(), bottom.tolist()) if hi != -lo]
    if not differing:
        return
    name = differing[0]
    gathered = control.all_gather(items[name])  # only on this error path: which key, which ranks
    key, ranks = first_difference(gathered)
    alike = ("wrap it in DistributedDataParallel (a DDP model with broadcast_buffers=False keeps per-rank "
             "buffers such as BatchNorm statistics: use SyncBatchNorm or broadcast_buffers=True)" if name in modules
             else "make every rank compute it alike (e.g. dist.broadcast rank 0's value)")
    raise UsageError(explain(
        f"snapshot of step {step} not written: {name!r} is tracked as replicated but differs between ranks "
        f"(first at {key}: ranks {ranks} differ from rank 0)", hint=f"if {name} should be the same everywhere, "
        f"{alike}; if each rank has its own, track it per rank: run.resume({name}=hpc_ddp.per_rank({name}))"),
        key=name)
