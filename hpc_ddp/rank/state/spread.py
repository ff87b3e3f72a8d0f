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

What a reader takes from its files, and how it knows the bytes are good, is
:mod:`hpc_ddp.rank.state.step_files`; this module is who reads what, and the exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.rank.group import control
from hpc_ddp.rank.group.tiers import Groups
from hpc_ddp.rank.state.step_files import StepFiles, node_rngs, read_slice
from hpc_ddp.rundir import slicing, snapshot
from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.checkpointer")


def file_number(name: str) -> int:
    """``node-00003.pt`` -> 3."""
    return int(Path(name).stem.rsplit("-", 1)[-1])


def readers(sources: Mapping[int, str], node_readers: list[int]) -> dict[int, int]:
    """slice -> the global rank that reads it: the node of its source file (mod the nodes there are
    now)."""
    return {s: node_readers[file_number(name) % len(node_readers)] for s, name in sources.items()}


@dataclass
class Loaded:
    """What a rank got from a step's files: the replicated state, the tensor bytes it read from
    files, its own RNG entry (None: reseeded), and why not when its file had one but it was not
    usable."""

    state: dict[str, Any]
    read: int
    rng: dict[str, Any] | None
    rng_unusable: str | None = None  # the file that held it, when that file was not usable


def load(choice: snapshot.Choice, env: DistEnv, groups: Groups, across: bool = True,
         rng_needed: bool = False) -> Loaded:
    """Collective: the replicated state on every rank, and each rank's RNG entry.

    Only the nodes' first ranks open files, each file once: ``across`` (``snapshot.load=spread``),
    slice ``s`` is read by one node (:func:`readers`) and sent to the others; otherwise every node
    reads every slice itself. Each reader hashes the bytes it reads against the slice's digest and
    takes a replica when they differ, so the disk serves each byte once (B9). A node's first rank
    reads its ranks' RNG entries and hands each its own; rank 0 reads the state's skeleton (small)
    and sends it with the pieces' dtypes and sizes. ``rng_needed``: ``per_rank`` objects are
    tracked, so a rank's unusable entry makes the step unusable
    (:class:`hpc_ddp.rundir.snapshot.Unverified`) instead of a reseed."""
    split, sources = choice.manifest["layout"], choice.sources
    by_slice: dict[int, list[int]] = {}
    for index, (_, _, _, owner) in enumerate(split["pieces"]):
        by_slice.setdefault(owner, []).append(index)
    who = readers(sources, groups.leaders) if across else {s: groups.leader for s in sources}
    mine = sorted(s for s, rank in who.items() if rank == env.rank)
    buffers, shapes, skeleton, rngs, problem = _read_mine(choice, env, groups, by_slice, mine,
                                                          rng_needed)
    # every rank learns every piece's dtype and size, the skeleton, or the first problem: all stop
    # alike
    shapes, problem, skeleton = control.to_main_and_back((shapes, problem, skeleton),
                                                         merge=_merged)
    if problem:
        raise (snapshot.Unverified if problem[1] else snapshot.SnapshotError)(problem[0])
    read = sum(b.numel() for b in buffers.values())
    pieces = _shared_pieces(by_slice, shapes, buffers, who, groups, across)
    state = slicing.assemble(split, skeleton, pieces)
    mine_rng = (control.scatter_within(rngs, groups.leader, groups.within)
                if groups.within is not None
                else (rngs or [(None, None)])[0])
    return Loaded(state, read, *mine_rng)


def _read_mine(choice: snapshot.Choice, env: DistEnv, groups: Groups,
               by_slice: dict[int, list[int]], mine: list[int], rng_needed: bool,
               ) -> tuple[dict[int, torch.Tensor], dict[int, tuple[str, int]], Any,
                          list[tuple[Any, str | None]] | None, tuple[str, bool] | None]:
    """This rank's reads, before any exchange: (its slices' bytes, their pieces' dtypes and sizes,
    the skeleton (rank 0's), its node's RNG entries (the leader's), the problem: (why, whether the
    step is only unverified), or None). A problem is returned, not raised: every rank must reach
    the exchange that tells all of them alike."""
    files = StepFiles(choice)
    buffers: dict[int, torch.Tensor] = {}
    shapes: dict[int, tuple[str, int]] = {}
    skeleton: Any = None
    rngs: list[tuple[Any, str | None]] | None = None
    problem: tuple[str, bool] | None = None
    try:
        for s in mine:
            buffers[s], found = read_slice(files, s, by_slice.get(s, []))
            shapes.update(found)
        if env.rank == 0:
            skeleton = _skeleton(files)
        if env.rank == groups.leader:
            # the group's order
            rngs = node_rngs(files, sorted(groups.node), env.world_size, rng_needed)
    except snapshot.Unverified as err:
        problem = (str(err), True)
    except snapshot.SnapshotError as err:
        problem = (str(err), False)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        problem = (f"the files of step {choice.step} in {choice.directory} do not hold what its "
                   "manifest says "
                   f"({err!r})", False)
    return buffers, shapes, skeleton, rngs, problem


def _skeleton(files: StepFiles) -> Any:
    """Rank 0's: the state's skeleton, from a file it loaded already, else the first source file
    that verifies."""
    choice = files.choice
    named = next((n for n in [*files.loaded, *sorted(set(choice.sources.values()))]
                  if files.get(n)), None)
    if named is None:
        raise snapshot.Unverified(f"no file of step {choice.step} in {choice.directory} "
                                  "verifies: "
                                  + "; ".join(f"{n} ({why})"
                                              for n, why in sorted(files.bad.items())))
    return files.loaded[named]["skeleton"]


def _merged(parts: list[Any]) -> tuple[dict[int, tuple[str, int]], Any, Any]:
    """Rank 0's merge of every rank's (shapes, problem, skeleton): all the shapes, the first
    problem, rank 0's skeleton."""
    return ({k: v for p, _, _ in parts for k, v in p.items()},
            next((why for _, why, _ in parts if why), None),
            parts[0][2])


def _shared_pieces(by_slice: dict[int, list[int]], shapes: dict[int, tuple[str, int]],
                   buffers: dict[int, torch.Tensor], who: dict[int, int], groups: Groups,
                   across: bool) -> dict[int, torch.Tensor]:
    """Collective: every slice's bytes from its reader to every rank (:func:`share`), cut into the
    slice's pieces (the reader's buffers are taken out of ``buffers``)."""
    pieces: dict[int, torch.Tensor] = {}
    for s in sorted(by_slice):
        indices = by_slice[s]
        sizes = [shapes[i][1] * _itemsize(shapes[i][0]) for i in indices]
        buffer = buffers.pop(s) if s in buffers else torch.empty(sum(sizes), dtype=torch.uint8)
        share(buffer, who[s], groups, across)
        offset = 0
        for i, size in zip(indices, sizes):
            dtype = getattr(torch, shapes[i][0])
            # clone: aligned for the dtype
            pieces[i] = buffer[offset:offset + size].clone().view(dtype)
            offset += size
    return pieces


def share(buffer: torch.Tensor, reader: int, groups: Groups, across: bool = True) -> None:
    """Collective: ``reader``'s bytes into every rank's ``buffer``: to the other nodes' leaders
    (``across``; otherwise every leader read them itself), then within each node from its leader
    (global ranks name the source in a subgroup too)."""
    if across and groups.between is not None:
        control.broadcast_in(buffer, reader, groups.between)
    if groups.within is not None:
        control.broadcast_in(buffer, groups.leader, groups.within)


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def state_bytes(state: dict[str, Any]) -> int:
    """The bytes of the tensors of a replicated state (what a rank reads when it reads every
    slice)."""
    return sum(t.numel() * t.element_size() for _, t in slicing.split(state)[1])
