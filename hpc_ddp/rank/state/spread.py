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

import gc
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.rank.group import control
from hpc_ddp.rank.group.tiers import Groups
from hpc_ddp.rundir import slicing, snapshot
from hpc_ddp.rundir.snapshot import verify as snapshot_verify
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


class _Files:
    """The step's files this rank opened: each opened once, and loaded only after the bytes outside
    its pieces verified (the pickle is never unpickled unverified). What is kept of a file is small
    and detached from it (its pieces' dtypes and sizes, the skeleton, the RNG entries): torch.load
    maps the file, and while a map of it exists the kernel reads ahead of every read of the file,
    read-ahead off or not (a slice of 13 MB cost 25 MB of disk reads here); so the map is let go
    before a slice's bytes are read."""

    def __init__(self, choice: snapshot.Choice) -> None:
        self.choice, self.loaded, self.bad = choice, {}, {}  # type: dict[str, dict[str, Any]], dict[str, str]
        self.checked: set[str] = set()

    def verified(self, name: str) -> bool:
        """Whether the file's bytes outside its pieces verify (read once, without read-ahead; the
        reason in ``bad``)."""
        if name not in self.checked and name not in self.bad:
            why = snapshot_verify.rest_problem(self.choice.directory / name,
                                               self.choice.manifest["files"].get(name) or {})
            if why is None:
                self.checked.add(name)
            else:
                self.bad[name] = why
        return name in self.checked

    def get(self, name: str) -> dict[str, Any] | None:
        """{"pieces": {index: tensor}, "skeleton", "rng"} of a verified file, or None (its reason in
        ``bad``). Pieces are meta tensors (a dtype and a size, no memory), except those the file has
        no span for (written before issue 45, or copied by torch first): those are copied out whole.
        Load a file after its slices are read: torch's reads leave the kernel's marks for read-ahead
        on the file's pages, which a later read of the file follows whatever its advice (a 13 MB
        slice cost 25 MB after a load, 13 MB before)."""
        if name not in self.loaded and self.verified(name):
            # a verified file that needs arbitrary unpickling was planted: stop, never fall back
            # (SnapshotError)
            snapshot_verify.warm_heads(self.choice.directory / name,
                                       self.choice.manifest["files"].get(name) or {})
            mapped = snapshot.load_file(self.choice.directory / name)
            spans = snapshot_verify.spans_of(self.choice.manifest["files"].get(name) or {})
            self.loaded[name] = {
                "pieces": {i: (t.clone() if i not in spans
                               else torch.empty(t.shape, dtype=t.dtype, device="meta"))
                           for i, t in (mapped.get("pieces") or {}).items()},
                "skeleton": _detached(mapped.get("skeleton")),
                "rng": _detached(mapped.get("rng") or {})}
            # the map goes with its last tensor: torch.load's unpickler holds some in a cycle
            del mapped
            gc.collect()
        return self.loaded.get(name)

    def copies_of(self, slice_: int) -> list[str]:
        """The good files holding ``slice_``: the chosen source first, then its replicas."""
        first = self.choice.sources[slice_]
        return [first] + [name
                          for name, held in sorted(slicing.file_slices(self.choice.manifest).items())
                          if slice_ in held and name != first and name in self.choice.good_files]


def _detached(value: object) -> Any:
    """``value`` with every tensor in it copied out of the file's map (small: a skeleton, RNG
    states)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_detached(v) for v in value)
    return value


def _read_slice(files: _Files, slice_: int,
                indices: list[int]) -> tuple[torch.Tensor, dict[int, tuple[str, int]]]:
    """One slice's pieces end to end in one byte buffer, from the first copy whose bytes give the
    slice's digest (hashed here, as they are read: nothing else hashes them): (the buffer, {piece:
    (dtype, numel)}).

    The pieces' bytes are read straight from their spans in the file (their places, in the manifest)
    into the buffer, with no read-ahead: exactly the slice's bytes, not the other slice's beside
    them, and no copy out of a memory map. A piece with no span (a file written before issue 45, or
    a piece torch copied first) comes from the memory-mapped file, whose rest was verified."""
    tried = []
    for name in files.copies_of(slice_):
        if not files.verified(name):
            tried.append(f"{name} ({files.bad[name]})")
            continue
        entry = files.choice.manifest["files"][name]
        spans = snapshot_verify.spans_of(entry)
        # every piece has its place: read them before any load of the file
        early = all(i in spans for i in indices)
        loaded = None if early else files.get(name)
        sizes = [spans[i][1] for i in indices] if early else [loaded["pieces"][i].nbytes
                                                              for i in indices]  # type: ignore[index]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        view, digests, offset, why = memoryview(buffer.numpy()), [], 0, None
        try:
            with snapshot_verify.open_exact(files.choice.directory / name) as source:
                for i, size in zip(indices, sizes):
                    part = view[offset:offset + size]
                    if i in spans and spans[i][1] == size:
                        snapshot_verify.read_span(source, spans[i][0], part)
                    else:  # no span: copied out of the file's load, whose rest verified
                        part[:] = memoryview(loaded["pieces"][i].reshape(-1).view(torch.uint8).numpy())  # type: ignore[index]
                    digests.append(hashlib.sha256(part).hexdigest())
                    offset += size
            why = snapshot_verify.slice_problem(entry, slice_, digests)
        except (OSError, EOFError) as err:
            why = f"cannot be read ({err})"
        if why is None:
            loaded = loaded or files.get(name)
            held = [loaded["pieces"][i] for i in indices] if loaded is not None else []
            if loaded is None or [t.nbytes for t in held] != sizes:
                why = "its pieces' sizes differ from their places in the manifest"
        if why is None:
            if tried:
                log.warning("slice %d of step %d read from %s instead: %s", slice_,
                            files.choice.step, name,
                            "; ".join(f"{files.choice.directory / t}" for t in tried))
            return buffer, {i: (str(t.dtype).removeprefix("torch."), t.numel())
                            for i, t in zip(indices, held)}
        files.bad[name] = why
        log.warning("snapshot file %s is not usable (%s)", files.choice.directory / name, why)
        tried.append(f"{name} ({why})")
    raise snapshot.Unverified(f"no copy of slice {slice_} of step {files.choice.step} in "
                              f"{files.choice.directory} "
                              f"verifies as it is read: {'; '.join(tried)}")


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
    files, buffers, shapes, skeleton, rngs = _Files(choice), {}, {}, None, None
    problem: tuple[str, bool] | None = None
    try:
        for s in mine:
            buffers[s], found = _read_slice(files, s, by_slice.get(s, []))
            shapes.update(found)
        if env.rank == 0:
            named = next((n for n in [*files.loaded, *sorted(set(sources.values()))]
                          if files.get(n)), None)
            if named is None:
                raise snapshot.Unverified(f"no file of step {choice.step} in {choice.directory} "
                                          "verifies: "
                                          + "; ".join(f"{n} ({why})"
                                                      for n, why in sorted(files.bad.items())))
            skeleton = files.loaded[named]["skeleton"]
        if env.rank == groups.leader:
            # the group's order
            rngs = _node_rngs(files, sorted(groups.node), env.world_size, rng_needed)
    except snapshot.Unverified as err:
        problem = (str(err), True)
    except snapshot.SnapshotError as err:
        problem = (str(err), False)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        problem = (f"the files of step {choice.step} in {choice.directory} do not hold what its "
                   "manifest says "
                   f"({err!r})", False)
    # every rank learns every piece's dtype and size, the skeleton, or the first problem: all stop
    # alike
    shapes, problem, skeleton = control.to_main_and_back((shapes, problem, skeleton),
                                                         merge=lambda parts: (
        {k: v for p, _, _ in parts for k, v in p.items()},
        next((why for _, why, _ in parts if why), None),
        parts[0][2]))
    if problem:
        raise (snapshot.Unverified if problem[1] else snapshot.SnapshotError)(problem[0])
    pieces: dict[int, torch.Tensor] = {}
    read = sum(b.numel() for b in buffers.values())
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
    state = slicing.assemble(split, skeleton, pieces)
    mine_rng = (control.scatter_within(rngs, groups.leader, groups.within)
                if groups.within is not None
                else (rngs or [(None, None)])[0])
    return Loaded(state, read, *mine_rng)


def _node_rngs(files: _Files, node: list[int], world_size: int,
               needed: bool) -> list[tuple[Any, str | None]]:
    """For each rank of this node, in order: (its RNG entry or None, the file that held it when that
    file was not usable). Read from the files that hold them in the snapshot's own geometry (none at
    another world size: every rank is reseeded)."""
    manifest, out = files.choice.manifest, []
    for rank in node:
        holder = slicing.rank_file(manifest,
                                   rank) if manifest.get("world_size") == world_size else None
        loaded = files.get(holder) if holder is not None and holder in files.choice.good_files else None
        if holder is not None and loaded is None:
            why = files.bad.get(holder, "not usable")
            if needed:
                raise snapshot.Unverified(f"the file of rank {rank}'s per_rank state in step "
                                          f"{files.choice.step}, "
                                          f"{files.choice.directory / holder}, is not usable "
                                          f"({why})")
            out.append((None, holder))
        else:
            out.append((loaded["rng"].get(rank) if loaded is not None else None, None))
    return out


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
