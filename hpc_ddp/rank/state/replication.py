"""Is what the loop tracks as replicated really the same on every rank? Checked at each snapshot.

A snapshot keeps one copy of the replicated state, cut into slices that come from
different nodes. If a tracked object differs by rank (a model not wrapped in DDP, a
dict of per-rank counters, a batch drawn from each rank's RNG), that copy is a mix of
ranks and the resume is silently wrong. So before anything is written, every rank
fingerprints each replicated object and one all_reduce of a few int64 compares them.

A fingerprint hashes every leaf, and every element of every tensor counts at every snapshot: a
sample would miss a difference confined to the rows it skips (a few rows of an embedding that one
rank alone updated). Tensors up to 16 KiB are hashed whole. A larger one is summed on its own
device, as 8-byte words in rows of about sqrt(words) (integer sums wrap, so they are exact and the
same in any order, on any device); the row sums, the bytes before and after the rows, shape and
dtype are hashed. A changed value changes its row's sum (other changes in the same row would have to
cancel it modulo 2**64). Only a reordering of words within one row keeps the sums. The rows start at
an offset derived from the step, so words d apart are split by a row's edge at about d in
sqrt(words) snapshots: a shuffle across rows is seen at once, two neighbouring words swapped late.
On a GPU every tensor of a device is summed by one fused reduction and the summaries reach the host
in one copy (:func:`fused`); on the CPU leaf by leaf, with no copy at all. Other values are hashed
by ``repr``.

A mismatch is an error on every rank alike, naming the object, its first differing key
and the ranks that differ, with the fix: wrap it in DDP, or track it with
``hpc_ddp.per_rank``. Costs are in docs/performance.md (B8).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import math
from collections.abc import Iterator, Mapping, Set
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.rank.group import control
from hpc_ddp.core.errors import UsageError, explain
from hpc_ddp.rank.state.tracked import unwrap

# tensors up to this size are hashed byte for byte; larger ones by their row sums
WHOLE_BYTES = 16 * 1024
# on a GPU, tensors up to this size share one reduction; larger ones are summed alone
FUSED_BYTES = 1 << 20
MASK = (1 << 62) - 1  # digests fit an int64 with room to negate


def leaves(value: object, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, leaf) in a stable order: dicts by key (sorted as text), lists and tuples by
    index."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from leaves(value[key], f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def offset(step: int) -> int:
    """Where the rows start at this step's snapshot (modulo a tensor's row width): the same on every
    rank, moving from snapshot to snapshot whatever the snapshot interval is."""
    return int.from_bytes(hashlib.blake2b(str(step).encode(), digest_size=8).digest(), "little")


def summary(tensor: torch.Tensor, step: int = 0, moved: int | None = None) -> torch.Tensor:
    """A uint8 tensor on ``tensor``'s device that changes when any element does: its bytes when
    small; else the wrapped int64 sums of its 8-byte words in rows of about sqrt(words), starting at
    an offset that moves with ``step`` (``moved``: :func:`offset` of it, computed once), then the
    bytes before and after the rows as they are. No host sync: every shape is known without the
    data."""
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    if raw.numel() <= WHOLE_BYTES:
        return raw
    start, rows, width = _layout(raw, offset(step) if moved is None else moved)
    count = raw.numel() // 8
    try:
        words = raw[: count * 8].view(torch.int64)
    # a view that starts off an 8-byte boundary (a slice of a flat buffer): copy it once
    except RuntimeError:
        words = raw[: count * 8].clone().view(torch.int64)
    end = start + rows * width
    sums = words[start:end].view(rows, width).sum(1)
    return torch.cat([sums.view(torch.uint8), raw[: start * 8], raw[end * 8:]])


def _layout(raw: torch.Tensor, moved: int) -> tuple[int, int, int]:
    """(first summed word, rows, row width) of a tensor's bytes ``raw`` summed by rows (see
    :func:`summary`)."""
    count = raw.numel() // 8
    width = math.isqrt(count)
    start = moved % width
    return start, (count - start) // width, width


def fused(tensors: list[torch.Tensor], step: int = 0, moved: int | None = None) -> list[bytes]:
    """:func:`summary` of every tensor of one device, on the host, from a handful of kernels in all.

    Per leaf, :func:`summary` launches a sum and a concatenation: on a GPU, a model of hundreds of
    leaves pays hundreds of launches. Here the summed words of every tensor up to ``FUSED_BYTES``
    are concatenated and reduced into their rows by one ``index_add_`` (int64 adds wrap, so the
    order of the atomics does not matter); a larger tensor is summed alone (its long rows would make
    the atomics queue on a few addresses: 1 GB took 10.8 ms fused against 1.9 ms alone on an H100).
    The row sums, the bytes outside the rows and the small tensors reach the host in one copy. The
    bytes of each leaf are the same as
    :func:`summary`'s (tested), so ranks may mix the two.
    """
    moved = offset(step) if moved is None else moved
    parts: list[torch.Tensor] = []  # what is copied to the host after the row sums
    bodies: list[torch.Tensor] = []
    # per tensor: its first part, its first row (None: no rows), rows
    plan: list[tuple[int, int | None, int]] = []
    widths: list[int] = []  # per summed tensor: its row width and its rows
    counts: list[int] = []
    for tensor in tensors:
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        # atomics on few rows are slow when large
        if raw.numel() <= WHOLE_BYTES or raw.numel() > FUSED_BYTES:
            plan.append((len(parts), None, 0))
            parts.append(summary(tensor, step, moved))
            continue
        start, rows, width = _layout(raw, moved)
        end = start + rows * width
        plan.append((len(parts), sum(counts), rows))
        parts += [raw[: start * 8], raw[end * 8:]]
        bodies.append(raw[start * 8: end * 8])
        widths.append(width)
        counts.append(rows)
    device = tensors[0].device if tensors else torch.device("cpu")
    total_rows = sum(counts)
    sums = torch.zeros(total_rows, dtype=torch.int64, device=device)
    if bodies:
        words = torch.cat(bodies).view(torch.int64)
        # each word's row: the widths per row from two short lists (one entry per tensor), not one
        # per row
        per_row = torch.repeat_interleave(torch.tensor(widths, device=device),
                                          torch.tensor(counts, device=device),
                                          output_size=total_rows)
        rows = torch.repeat_interleave(torch.arange(total_rows, device=device), per_row,
                                       output_size=words.numel())
        sums.index_add_(0, rows, words)
    joined = torch.cat([sums.view(torch.uint8), *parts]).cpu()  # the one device-to-host copy
    raw_all = ctypes.string_at(joined.data_ptr(), joined.numel()) if joined.numel() else b""
    cuts = list(itertools.accumulate([sums.numel() * 8] + [p.numel() for p in parts], initial=0))
    sums_bytes, piece = raw_all[: cuts[1]], [raw_all[a:b] for a, b in zip(cuts[1:], cuts[2:])]
    return [piece[at] if first is None else sums_bytes[first * 8: (first + rows) * 8] + piece[at]
            + piece[at + 1]
            for at, first, rows in plan]


def _host_bytes(summaries: list[torch.Tensor]) -> list[bytes]:
    """Each CPU summary's bytes, read where it is (no copy)."""
    return [ctypes.string_at(p.contiguous().data_ptr(), p.numel()) if p.numel() else b""
            for p in summaries]


def _digest(raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & MASK


def fingerprints(states: Mapping[str, Any], step: int = 0) -> dict[str, list[tuple[str, int]]]:
    """Every object's leaves as (path, digest); its tensors summarised on their devices, read back
    together (on the CPU leaf by leaf with no copy; on a GPU by :func:`fused`, one copy per
    device)."""
    found = {name: list(leaves(value)) for name, value in states.items()}
    tensors = [leaf for items in found.values() for _, leaf in items
               if isinstance(leaf, torch.Tensor)]
    moved = offset(step)
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    summaries: list[bytes] = [b""] * len(tensors)
    for device, indices in by_device.items():
        chosen = [tensors[i] for i in indices]
        read = (_host_bytes([summary(t, step, moved) for t in chosen]) if device.type == "cpu"
                else fused(chosen, step, moved))
        for i, raw in zip(indices, read):
            summaries[i] = raw
    read_back = iter(summaries)
    return {name: [(path, _digest(f"{leaf.dtype}{tuple(leaf.shape)}".encode() + next(read_back))
                    if isinstance(leaf, torch.Tensor) else _digest(repr(leaf).encode()))
                   for path, leaf in items]
            for name, items in found.items()}


def digests(state: object, step: int = 0) -> list[tuple[str, int]]:
    """Every leaf's (path, digest) of one object's state."""
    return fingerprints({"": state}, step)[""]
def combined(items: list[tuple[str, int]]) -> int:
    """One object's fingerprint: its leaves' paths and digests together."""
    raw = "\n".join(f"{path}={d}" for path, d in items).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & MASK


def first_difference(per_rank: list[list[tuple[str, int]]]) -> tuple[str, list[int]]:
    """The first key whose digest is not the same on every rank, and the ranks that differ from rank
    0."""
    maps = [dict(items) for items in per_rank]
    for path in dict.fromkeys(p for items in per_rank for p, _ in items):
        values = [m.get(path) for m in maps]
        if len(set(values)) > 1:
            return path or "(the value itself)", [r for r, v in enumerate(values) if v != values[0]]
    return "(its keys)", [r for r, m in enumerate(maps) if m.keys() != maps[0].keys()]


def check(states: Mapping[str, Any], step: int, modules: Set[str] = frozenset(),
          doing: str | None = None) -> None:
    """Collective: raise the same UsageError on every rank when a replicated object differs by rank.
    ``modules``: the names that are modules (the fix then is DDP); for others it is computing them
    alike. ``doing``: what the error says was stopped (by default the snapshot of ``step``)."""
    names = sorted(states)
    if not names or dist.get_world_size() == 1:
        return
    items = fingerprints({name: states[name] for name in names}, step)
    values = torch.tensor([combined(items[n]) for n in names], dtype=torch.int64)
    # one all_reduce (CPU) gives max and (negated) min
    both = control.max_of(torch.cat([values, -values]))
    top, bottom = both.tensor_split(2)
    differing = [n for n, hi, lo in zip(names, top.tolist(), bottom.tolist()) if hi != -lo]
    if not differing:
        return
    name = differing[0]
    gathered = control.all_gather(items[name])  # only on this error path: which key, which ranks
    key, ranks = first_difference(gathered)
    alike = ("wrap it in DistributedDataParallel (a DDP model with broadcast_buffers=False keeps "
             "per-rank "
             "buffers such as BatchNorm statistics: use SyncBatchNorm or broadcast_buffers=True)"
             if name in modules
             else "make every rank compute it alike (e.g. dist.broadcast rank 0's value)")
    raise UsageError(explain(
        f"{doing or f'snapshot of step {step} not written'}: {name!r} is tracked as replicated but "
        "differs between ranks "
        f"(first at {key}: ranks {ranks} differ from rank 0)",
        hint=f"if {name} should be the same everywhere, "
        f"{alike}; if each rank has its own, track it per rank: "
        f"run.resume({name}=hpc_ddp.per_rank({name}))"),
        key=name)


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the state_dict: names in sorted order, each tensor's raw bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        flat = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        # raw bytes in one copy (bytes(storage) walks element by element: 2 s for a small GPT)
        digest.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))
    return digest.hexdigest()
