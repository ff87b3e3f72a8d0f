"""Resume reads the snapshot from the filesystem once: each node reads its slices, the rest comes over the group.

Before, every rank memory-mapped every slice, so the shared filesystem served the whole
state once per node (once per rank when the page cache is not shared). Now slice ``s``
has one reader: local rank 0 of the node that wrote the file it comes from (its own file
when that is good, the replica's holder when not); at another node count, the file's
number modulo the nodes. The reader copies the slice's pieces out of its file into one
byte buffer and broadcasts it; every rank unpacks the same bytes, so every rank ends
with the whole state, bit-identical to reading the files itself.

Everything here runs on the CPU control group (:mod:`hpc_ddp.rank.control`): the pieces'
dtypes and sizes go to rank 0 and back as one small object, and the slices' bytes are
broadcast as CPU tensors. On NCCL they would each need a GPU buffer as large as a slice
(with one node, the whole state: more than a GPU holds for a large model with its
optimizer) and a copy there and back, for bytes that are unpacked on the CPU anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.rank import control
from hpc_ddp.rundir import slicing, snapshot
from hpc_ddp.core.slurm_env import DistEnv


def file_number(name: str) -> int:
    """``node-00003.pt`` -> 3."""
    return int(Path(name).stem.rsplit("-", 1)[-1])


def readers(sources: Mapping[int, str], node_readers: list[int]) -> dict[int, int]:
    """slice -> the global rank that reads it: the node of its source file (mod the nodes there are now)."""
    return {s: node_readers[file_number(name) % len(node_readers)] for s, name in sources.items()}


def node_readers(env: DistEnv) -> list[int]:
    """Collective: the global rank of each node's local rank 0, by node."""
    members = control.to_main_and_back((env.node_rank, env.local_rank))
    first = {node: rank for rank, (node, local) in enumerate(members) if local == 0}
    return [first[node] for node in sorted(first)]


def load(choice: snapshot.Choice, env: DistEnv) -> tuple[dict[str, Any], int]:
    """Collective: (the replicated state, the bytes of snapshot tensors this rank read from files)."""
    split, sources = choice.manifest["layout"], choice.sources
    who = readers(sources, node_readers(env))
    mine = sorted(s for s, rank in who.items() if rank == env.rank)
    by_slice: dict[int, list[int]] = {}
    for index, (_, _, _, owner) in enumerate(split["pieces"]):
        by_slice.setdefault(owner, []).append(index)
    problem, files, shapes = None, {}, {}
    try:
        files = {name: snapshot.load_file(choice.directory / name)
                 for name in {sources[s] for s in mine} | {sources[0]}}
        shapes = {i: (str(files[sources[s]]["pieces"][i].dtype).removeprefix("torch."),
                      files[sources[s]]["pieces"][i].numel()) for s in mine for i in by_slice.get(s, [])}
    except snapshot.SnapshotError as err:
        problem = str(err)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        problem = (f"the files of step {choice.step} in {choice.directory} do not hold what its manifest says "
                   f"({err!r})")
    # every rank learns every piece's dtype and size, or the first problem: all stop alike, none waits
    shapes, problem = control.to_main_and_back((shapes, problem), merge=lambda parts: (
        {k: v for p, _ in parts for k, v in p.items()}, next((why for _, why in parts if why), None)))
    if problem:
        raise snapshot.SnapshotError(problem)
    pieces: dict[int, torch.Tensor] = {}
    read = 0
    for s in sorted(by_slice):
        indices = by_slice[s]
        sizes = [shapes[i][1] * _itemsize(shapes[i][0]) for i in indices]
        if who[s] == env.rank:
            held = files[sources[s]]["pieces"]
            buffer = torch.cat([held[i].reshape(-1).view(torch.uint8) for i in indices]) if indices else \
                torch.empty(0, dtype=torch.uint8)
            read += buffer.numel()
        else:
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        control.broadcast(buffer, src=who[s])
        offset = 0
        for i, size in zip(indices, sizes):
            dtype = getattr(torch, shapes[i][0])
            pieces[i] = buffer[offset:offset + size].clone().view(dtype)  # clone: aligned for the dtype
            offset += size
    state = slicing.assemble(split, files[sources[0]]["skeleton"], pieces)
    return state, read


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def state_bytes(state: Any) -> int:
    """The bytes of the tensors of a replicated state (what a rank reads when it reads every slice)."""
    return sum(t.numel() * t.element_size() for _, t in slicing.split(state)[1])
