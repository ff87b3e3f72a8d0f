"""The step's files as one reader of a resume opens them: each file once, verified before it is
loaded, a slice's bytes read exactly from their places and hashed as they are read.

Apart from :mod:`hpc_ddp.rank.state.spread`, which it serves: this is the disk's side of a resume
(what a reader takes from its files, and how it knows the bytes are good, falling back to a
replica when not); spread is the network's side (which rank reads which slice, and how the bytes
reach every rank). Nothing here is collective: a reader's problem is raised to spread, which makes
every rank stop alike.
"""

from __future__ import annotations

import gc
import hashlib
import logging
from typing import Any

import torch

from hpc_ddp.rundir import slicing, snapshot
from hpc_ddp.rundir.snapshot import verify as snapshot_verify

log = logging.getLogger("hpc_ddp.checkpointer")


class StepFiles:
    """The step's files this rank opened: each opened once, and loaded only after the bytes outside
    its pieces verified (the pickle is never unpickled unverified). What is kept of a file is small
    and detached from it (its pieces' dtypes and sizes, the skeleton, the RNG entries): torch.load
    maps the file, and while a map of it exists the kernel reads ahead of every read of the file,
    read-ahead off or not (a slice of 13 MB cost 25 MB of disk reads here); so the map is let go
    before a slice's bytes are read."""

    def __init__(self, choice: snapshot.Choice) -> None:
        self.choice = choice
        self.loaded: dict[str, dict[str, Any]] = {}
        self.bad: dict[str, str] = {}
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
                "skeleton": detached(mapped.get("skeleton")),
                "rng": detached(mapped.get("rng") or {})}
            # the map goes with its last tensor: torch.load's unpickler holds some in a cycle
            del mapped
            gc.collect()
        return self.loaded.get(name)

    def copies_of(self, slice_: int) -> list[str]:
        """The good files holding ``slice_``: the chosen source first, then its replicas."""
        first = self.choice.sources[slice_]
        holding = sorted(slicing.file_slices(self.choice.manifest).items())
        return [first] + [name for name, held in holding
                          if slice_ in held and name != first and name in self.choice.good_files]


def detached(value: object) -> Any:
    """``value`` with every tensor in it copied out of the file's map (small: a skeleton, RNG
    states)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(detached(v) for v in value)
    return value


def read_slice(files: StepFiles, slice_: int,
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
        sizes = ([spans[i][1] for i in indices] if early
                 else [loaded["pieces"][i].nbytes for i in indices])  # type: ignore[index]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        view, digests, offset, why = memoryview(buffer.numpy()), [], 0, None
        try:
            with snapshot_verify.open_exact(files.choice.directory / name) as source:
                for i, size in zip(indices, sizes):
                    part = view[offset:offset + size]
                    if i in spans and spans[i][1] == size:
                        snapshot_verify.read_span(source, spans[i][0], part)
                    else:  # no span: copied out of the file's load, whose rest verified
                        piece = loaded["pieces"][i]  # type: ignore[index]
                        part[:] = memoryview(piece.reshape(-1).view(torch.uint8).numpy())
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


def node_rngs(files: StepFiles, node: list[int], world_size: int,
              needed: bool) -> list[tuple[Any, str | None]]:
    """For each rank of this node, in order: (its RNG entry or None, the file that held it when that
    file was not usable). Read from the files that hold them in the snapshot's own geometry (none at
    another world size: every rank is reseeded)."""
    manifest, out = files.choice.manifest, []
    for rank in node:
        holder = (slicing.rank_file(manifest, rank) if manifest.get("world_size") == world_size
                  else None)
        loaded = (files.get(holder) if holder is not None and holder in files.choice.good_files
                  else None)
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
