"""Which node's file holds which part of the replicated state: the split layout of a snapshot.

Every rank holds the same replicated state (model, optimizer, ...), so writing it once per
node makes a snapshot cost N copies. Instead the state's tensors are laid end to end, in
the order the state lists them, and the byte stream is cut into one *slice* per node of
equal size (a tensor smaller than :data:`MIN_SPLIT` is never cut; a larger one may be,
into element ranges). Slice ``s`` is written by ``replicas`` nodes, ``s, s+1, ...``
(mod N), so each node writes ``replicas / N`` of the bytes and any ``replicas - 1``
files may be lost. Everything else (the structure of the state, its plain values, the
RNG states of the node's own ranks) is small and goes into the node's file as is.

The manifest records the layout (``layout``: the tensors' paths and shapes, and which
slice holds which element range of which tensor; each file's ``slices`` and ``ranks``),
so any geometry can read any layout: a reader takes each slice from one good file that
holds it. Pure arithmetic and checks here (no torch at import: ``status`` and the login
node read manifests); :func:`split` and :func:`assemble` handle the tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# format 1: every node's file held the whole replicated state ("replicated") and its ranks' RNG
FORMAT = 2
# tensors below 1 MiB stay whole: cutting them saves nothing and adds pieces to the manifest
MIN_SPLIT = 1 << 20
Path_ = tuple[Any, ...]  # keys (str or int) from the state's root to a tensor


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened tensor number ``tensor``, held by slice
    ``slice``."""

    tensor: int
    start: int
    stop: int
    slice: int


def plan(sizes: Sequence[tuple[int, int]], slices: int, min_split: int = MIN_SPLIT) -> list[Piece]:
    """Cut tensors of ``(numel, itemsize)`` into pieces so every slice holds about 1/``slices`` of
    the bytes.

    Deterministic (every writer computes the same plan from the same state) and
    contiguous: slice ``s`` covers bytes ``[s*T/S, (s+1)*T/S)`` of the stream, up to a
    small tensor's size (those go whole to the slice their middle falls in).
    """
    total = sum(numel * item for numel, item in sizes)
    pieces: list[Piece] = []
    offset = 0

    def slice_at(byte: int) -> int:
        return min(byte * slices // total, slices - 1) if total else 0

    for index, (numel, item) in enumerate(sizes):
        nbytes = numel * item
        if slices == 1 or nbytes < min_split:
            pieces.append(Piece(index, 0, numel, slice_at(offset + nbytes // 2)))
        else:
            start = 0
            while start < numel:
                owner = slice_at(offset + start * item)
                # where slice ``owner`` ends, rounded up
                end_byte = -(-(owner + 1) * total // slices)
                stop = numel if owner == slices - 1 else min(numel,
                                                             max(start + 1,
                                                                 -(-(end_byte - offset) // item)))
                pieces.append(Piece(index, start, stop, owner))
                start = stop
        offset += nbytes
    return pieces


def slices_of(node: int, nodes: int, replicas: int) -> list[int]:
    """The slices node ``node``'s file holds: its own first, then those it keeps a replica of."""
    return [(node - j) % nodes for j in range(min(replicas, nodes))]


def holders(slice_: int, nodes: int, replicas: int) -> list[int]:
    """The nodes whose files hold slice ``slice_``, its own node first."""
    return [(slice_ + j) % nodes for j in range(min(replicas, nodes))]


def layout_digest(layout: Mapping[str, Any]) -> str:
    """A short hash of a layout: the commit checks every writer planned the same one."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


# -- reading a manifest (no torch)
# ----------------------------------------------------------------------
def layout_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why a split manifest's layout cannot be followed (tampered, truncated), or None when it holds
    together.

    Format-1 manifests (no ``layout``) have nothing to check: every file is a whole copy.
    """
    layout = manifest.get("layout")
    if layout is None:
        return None
    files = manifest.get("files")
    if not isinstance(layout, dict) or layout.get("format") != FORMAT:
        found = layout.get("format") if isinstance(layout, dict) else repr(layout)
        return f"layout format {found}, expected {FORMAT}"
    slices, tensors, pieces = layout.get("slices"), layout.get("tensors"), layout.get("pieces")
    if not _count(slices) or not isinstance(tensors, list) or not isinstance(pieces, list):
        return "layout lacks slices, tensors or pieces"
    if not all(isinstance(t, list) and len(t) == 2 and _key_path(t[0]) and _shape(t[1])
               for t in tensors):
        return "a tensor entry is not [path, shape]"
    covered = [0] * len(tensors)
    for piece in pieces:
        if not (isinstance(piece, list) and len(piece) == 4 and all(_int(v) for v in piece)):
            return f"piece {piece!r} is not [tensor, start, stop, slice]"
        tensor, start, stop, owner = piece
        if not (0 <= tensor < len(tensors) and 0 <= owner < slices and start == covered[tensor]
                and (start < stop or stop == 0)):
            return f"piece {piece!r} does not continue tensor {tensor} within {slices} slices"
        covered[tensor] = stop
    for index, (path, shape) in enumerate(tensors):
        if covered[index] != math.prod(shape):
            return (f"the pieces of {'.'.join(map(str, path))} cover {covered[index]} of "
                    f"{math.prod(shape)} elements")
    for name, entry in files.items() if isinstance(files, dict) else ():
        held = entry.get("slices") if isinstance(entry, dict) else None
        if not (isinstance(held, list) and all(_int(s) and 0 <= s < slices for s in held)):
            return f"file {name} does not say which of the {slices} slices it holds"
    return None


def file_slices(manifest: Mapping[str, Any]) -> dict[str, list[int]]:
    """Each file's slices (format 1: every file holds the one whole copy, slice 0)."""
    files = manifest.get("files", {})
    if manifest.get("layout") is None:
        return {name: [0] for name in files}
    return {name: list(entry["slices"]) for name, entry in files.items()}


def slice_count(manifest: Mapping[str, Any]) -> int:
    layout = manifest.get("layout")
    return int(layout["slices"]) if isinstance(layout, dict) else 1


def sources(manifest: Mapping[str, Any], good: Iterable[str]) -> dict[int, str] | None:
    """For every slice, the first good file that holds it (its own node's before a replica); None
    when some slice has no good copy left (the step cannot be restored)."""
    good = set(good)
    found: dict[int, str] = {}
    for name, held in sorted(file_slices(manifest).items()):
        for position, owner in enumerate(held):
            if name in good and (owner not in found or position == 0):
                found[owner] = name
    return found if len(found) == slice_count(manifest) else None


def rank_file(manifest: Mapping[str, Any], rank: int) -> str | None:
    """The file that holds ``rank``'s RNG state in the snapshot's own geometry (None: no such
    rank)."""
    files, written_by = manifest.get("files", {}), manifest.get("world_size")
    listed = False
    for name, entry in sorted(files.items()):
        if isinstance(entry, dict) and isinstance(entry.get("ranks"), list):
            listed = True
            if rank in entry["ranks"]:
                return name
    # the files say whose RNG they hold, and none holds this rank's (a just-in-time snapshot's)
    if listed:
        return None
    nodes = manifest.get("num_nodes")  # format 1: nodes held consecutive blocks of ranks
    if _count(nodes) and _count(written_by) and written_by % nodes == 0 and 0 <= rank < written_by:
        return f"node-{rank // (written_by // nodes):05d}.pt"
    return None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return _int(value) and value > 0


def _key_path(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(k, str) or _int(k) for k in value)


def _shape(value: Any) -> bool:
    return isinstance(value, list) and all(_int(d) and d >= 0 for d in value)


# -- the tensors (torch, imported by the caller's process already)
# --------------------------------------
def split(state: Any) -> tuple[Any, list[tuple[Path_, torch.Tensor]]]:
    """(the state with every tensor replaced by None, [(path, tensor)] in the state's order).

    Only tensors reachable through dicts with str or int keys, lists and tuples are taken
    out (their paths go into a JSON manifest); any other tensor stays in the structure,
    which every file carries whole.
    """
    import torch

    found: list[tuple[Path_, torch.Tensor]] = []

    def walk(value: Any, path: Path_) -> Any:
        if isinstance(value, torch.Tensor):
            found.append((path, value))
            return None
        if isinstance(value, dict) and all(isinstance(k, str) or _int(k) for k in value):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        # a namedtuple stays whole
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
        return value

    return walk(state, ()), found


def layout_for(tensors: Sequence[tuple[Path_, torch.Tensor]], slices: int,
               replicas: int) -> dict[str, Any]:
    """The manifest's ``layout`` for these tensors split over ``slices`` nodes."""
    pieces = plan([(t.numel(), t.element_size()) for _, t in tensors], slices)
    return {"format": FORMAT, "slices": slices, "replicas": min(replicas, slices),
            "tensors": [[list(path), list(t.shape)] for path, t in tensors],
            "pieces": [[p.tensor, p.start, p.stop, p.slice] for p in pieces]}


def pieces_for(layout: Mapping[str, Any], tensors: Sequence[tuple[Path_, torch.Tensor]],
               held: Iterable[int], copy: bool = True) -> dict[int, torch.Tensor]:
    """{piece index: tensor} for the slices ``held``: a whole tensor as it is, a part as a flat copy
    (torch.save of a view writes the whole tensor's storage), a tensor whose storage is not in
    row-major order (transposed, channels_last) as a row-major copy: a resume reads a piece's bytes
    as they lie in the file and puts them in the manifest's shape. ``copy=False``: parts and such
    tensors as they are, for a caller that copies them anyway
    (:mod:`hpc_ddp.rank.state.pipeline`)."""
    import torch

    held = set(held)
    out: dict[int, torch.Tensor] = {}
    for index, (tensor, start, stop, owner) in enumerate(layout["pieces"]):
        if owner not in held:
            continue
        value = tensors[tensor][1].detach()
        if start == 0 and stop == value.numel():
            whole = value.is_contiguous() and value.untyped_storage().nbytes() == value.nbytes
            out[index] = (value if whole or not copy
                          else value.clone(memory_format=torch.contiguous_format))
        else:
            part = value.reshape(-1)[start:stop]
            out[index] = part.clone() if copy else part
    return out


def node_content(state: Any, node: int, nodes: int, replicas: int, rng: Any,
                 copy: bool = True) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """(what node ``node``'s file holds: the skeleton, its slices' pieces and ``rng``; the layout
    over ``nodes``; the slices it holds). A periodic snapshot's writers and a just-in-time
    snapshot's (one node) alike."""
    skeleton, tensors = split(state)
    layout = layout_for(tensors, nodes, replicas)
    held = slices_of(node, nodes, replicas)
    pieces = pieces_for(layout, tensors, held, copy=copy)
    return {"format": FORMAT, "skeleton": skeleton, "pieces": pieces, "rng": rng}, layout, held


def assemble(layout: Mapping[str, Any], skeleton: Any, pieces: Mapping[int, torch.Tensor]) -> Any:
    """The replicated state again: ``skeleton`` with every tensor put back from its pieces."""
    import torch

    parts: dict[int, list[torch.Tensor]] = {}
    for index, (tensor, _, _, _) in enumerate(layout["pieces"]):
        parts.setdefault(tensor, []).append(pieces[index])
    tensors: dict[Path_, torch.Tensor] = {}
    for index, (path, shape) in enumerate(layout["tensors"]):
        chunks = parts.get(index, [])
        value = chunks[0] if len(chunks) == 1 else torch.cat([c.reshape(-1) for c in chunks])
        if value.numel() != math.prod(shape):
            raise ValueError(f"{'.'.join(map(str, path))} has {value.numel()} elements, the "
                             f"manifest says {shape}")
        tensors[tuple(path)] = value.reshape(shape)

    def rebuild(value: Any, path: Path_) -> Any:
        if path in tensors:
            return tensors[path]
        if isinstance(value, dict):
            return {k: rebuild(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(rebuild(v, (*path, i)) for i, v in enumerate(value))
        return value

    return rebuild(skeleton, ())
