"""Resume reads the snapshot from the filesystem once, and sends it over the network once per node.

Before, every rank memory-mapped every slice, so the shared filesystem served the whole
state once per node (once per rank when the page cache is not shared). Now slice ``s``
has one reader: local rank 0 of the node that wrote the file it comes from (its own file
when that is good, the replica's holder when not); at another node count, the file's
number modulo the nodes. The reader copies the slice's pieces out of its file into one
byte buffer and broadcasts it in two levels: first among the nodes' local ranks 0 (the
"leaders", one per node: the only traffic between nodes, one copy of the state per node),
then from each leader to the other ranks of its node (a group of the node's ranks: gloo
connects them through the node's own address, which the kernel delivers locally, never on
the wire). Every rank unpacks the same bytes, so every rank ends with the whole state,
bit-identical to reading the files itself. Before issue 36 every slice went to every rank
over one group: a node with T ranks took T copies from the network.

Everything here runs on gloo groups of CPU tensors (:mod:`hpc_ddp.rank.group.control`): the
pieces' dtypes and sizes go to rank 0 and back as one small object, and the slices' bytes
are broadcast as CPU tensors. On NCCL they would each need a GPU buffer as large as a slice
(with one node, the whole state: more than a GPU holds for a large model with its
optimizer) and a copy there and back, for bytes that are unpacked on the CPU anyway. So the
exchange between nodes uses the network gloo binds to (the interface of the node's hostname,
or ``GLOO_SOCKET_IFNAME``), which on most clusters is the same fabric NCCL uses, over TCP
(IP over InfiniBand on an InfiniBand cluster), not RDMA.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.rank.group import control
from hpc_ddp.rank.group.tiers import Groups
from hpc_ddp.rundir import slicing, snapshot
from hpc_ddp.core.slurm_env import DistEnv


def file_number(name: str) -> int:
    """``node-00003.pt`` -> 3."""
    return int(Path(name).stem.rsplit("-", 1)[-1])


def readers(sources: Mapping[int, str], node_readers: list[int]) -> dict[int, int]:
    """slice -> the global rank that reads it: the node of its source file (mod the nodes there are now)."""
    return {s: node_readers[file_number(name) % len(node_readers)] for s, name in sources.items()}


def load(choice: snapshot.Choice, env: DistEnv, groups: Groups) -> tuple[dict[str, Any], int]:
    """Collective: (the replicated state, the bytes of snapshot tensors this rank read from files)."""
    split, sources = choice.manifest["layout"], choice.sources
    who = readers(sources, groups.leaders)
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
        share(buffer, who[s], groups)
        offset = 0
        for i, size in zip(indices, sizes):
            dtype = getattr(torch, shapes[i][0])
            pieces[i] = buffer[offset:offset + size].clone().view(dtype)  # clone: aligned for the dtype
            offset += size
    state = slicing.assemble(split, files[sources[0]]["skeleton"], pieces)
    return state, read


def share(buffer: torch.Tensor, reader: int, groups: Groups) -> None:
    """Collective: ``reader``'s bytes into every rank's ``buffer``: to the other nodes' leaders, then within
    each node from its leader (global ranks name the source in a subgroup too)."""
    if groups.between is not None:
        control.broadcast_in(buffer, reader, groups.between)
    if groups.within is not None:
        control.broadcast_in(buffer, groups.leader, groups.within)


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def state_bytes(state: Any) -> int:
    """The bytes of the tensors of a replicated state (what a rank reads when it reads every slice)."""
    return sum(t.numel() * t.element_size() for _, t in slicing.split(state)[1])
