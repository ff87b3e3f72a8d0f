"""The survivors' per-rank state files of a just-in-time snapshot (:mod:`hpc_ddp.rundir.jit_files`
says where they meet): each survivor's ``blobs-L.pt`` on its node (``{holder, tag, blobs: {rank:
{step: packed bytes}}}``), and the node's ``blobs-node-N.pt`` in the run dir (``{holder: {rank:
{step: packed bytes}}}``), read by ranks that did not write them. A survivor holds each rank's state
of its last two boundaries (issue 55: the survivors may stand at two steps); a file of the version
before holds one, ``[step, packed bytes]``, and reads as that one step.

Such a file may be garbage: cut short by a writer killed on a filesystem where a rename is not
atomic, damaged on disk, or a stranger's bytes in a shared folder. Loading it (``torch.load``,
``weights_only``) then raises whatever the unpickler meets first (``UnpicklingError``, ``KeyError``,
``EOFError``, ``RuntimeError``), and a file that loads may hold something else than the shape above.
Either way it is read as a missing source: a warning names the file, and what it held counts for
nothing (the commit then says which ranks' state no survivor holds, and the run falls back to the
periodic snapshot). Torch only lazily, in the functions that load.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

from hpc_ddp.core.errors import first_line
from hpc_ddp.rundir import node_local

log = logging.getLogger("hpc_ddp.jit")

Held = dict[int, dict[int, bytes]]  # rank -> {step: packed bytes}


def load(path: Path, own: bool = False) -> Any | None:
    """``path`` loaded with ``weights_only=True``; None where it is missing (said by the caller if
    it matters) or cannot be loaded (a warning that names it). ``own``: a file on node-local
    storage, read only if it is this user's regular file (never through a link)."""
    import torch

    try:
        if own:
            raw = node_local.read(path, 1 << 40)
            if raw is None:
                return None
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    # garbage raises what the unpickler meets first: a corrupt source
    except Exception as err:  # noqa: BLE001
        log.warning("the per-rank states in %s cannot be read (%s: %s): treated as missing", path,
                    type(err).__name__, first_line(err, 160))
        return None


def _held(value: Any) -> Held | None:
    """``{rank: {step: bytes}}`` of a loaded file, the entries of the wrong shape left out; None if
    not a dict."""
    if not isinstance(value, dict):
        return None
    found = {rank: _states(entry) for rank, entry in value.items() if isinstance(rank, int)}
    return {rank: states for rank, states in found.items() if states is not None}


def _states(entry: Any) -> dict[int, bytes] | None:
    """One rank's states: ``{step: bytes}``, or the version before's one ``[step, bytes]``; None if
    neither (a dict with any entry of another shape is none: a step's bytes are whole or not
    there)."""
    if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
            and isinstance(entry[1], bytes)):
        return {entry[0]: entry[1]}
    if isinstance(entry, dict) and entry and all(isinstance(s, int) and isinstance(b, bytes)
                                                 for s, b in entry.items()):
        return dict(entry)
    return None


def survivor_file(path: Path, tag: str | None = None) -> tuple[int, Held] | None:
    """A survivor's ``blobs-L.pt`` on its node: (holder rank, its per-rank states), or None (missing
    or unreadable: the warning names the file). ``tag``: the attempt's tag with its token, which the
    file must carry (and be this user's: :mod:`hpc_ddp.rundir.node_local`)."""
    loaded = load(path, own=tag is not None)
    if tag is not None and isinstance(loaded, dict) and loaded.get("tag") != tag:
        log.warning("the per-rank states in %s lack this attempt's token: treated as missing", path)
        return None
    held = _held(loaded.get("blobs")) if isinstance(loaded, dict) else None
    holder = loaded.get("holder") if isinstance(loaded, dict) else None
    if held is None or not isinstance(holder, int):
        if loaded is not None:
            log.warning("the per-rank states in %s are not {holder, blobs}: treated as missing",
                        path)
        return None
    if len(held) != len(loaded["blobs"]):
        log.warning("some per-rank states in %s are not {step: bytes}: those are treated as "
                    "missing", path)
    return holder, held


def read_blobs(where: Path, node: int) -> dict[int, Held]:
    """Node ``node``'s per-rank states: {holder rank: {rank: {step: packed bytes}}} ({} if missing
    or unreadable; a file that is not that shape is named in a warning)."""
    path = where / f"blobs-node-{node}.pt"
    loaded = load(path)
    if loaded is None:
        return {}
    found = {holder: held for holder, held in ((h, _held(v))
                                               for h, v in (loaded.items() if isinstance(
        loaded, dict) else ())) if isinstance(holder, int) and held is not None}
    if not isinstance(loaded, dict) or len(found) != len(loaded):
        log.warning("the per-rank states in %s are not {holder: {rank: {step: bytes}}}: what is "
                    "not is "
                    "treated as missing", path)
    return found


def blob_of(held: dict[int, Held], holder: int, rank: int, step: int) -> bytes | None:
    """``rank``'s packed per-rank state at ``step`` as survivor ``holder`` left it (None: it holds
    others)."""
    return ((held.get(holder) or {}).get(rank) or {}).get(step)
