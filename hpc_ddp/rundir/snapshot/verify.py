"""Checking a snapshot file's bytes against its manifest entry, and reading exactly the bytes asked
for.

A node file's manifest entry (written by :mod:`hpc_ddp.rundir.snapshot.write`) holds a digest per
slice of the replicated state and one of the *rest* (the zip's records, the pickle, the RNG states):
a resume reads a slice and verifies it as it reads it (:func:`slice_problem`), the rest before
(:func:`rest_problem`), and a verify of the whole file (:func:`file_problem`) checks both. Plain
file reads, no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO


def slice_digest(piece_digests: Sequence[str]) -> str:
    """A slice's digest: sha256 over its pieces' sha256 digests, in piece order (so the writer may
    hash the pieces in the order torch writes them, and the reader in the order it copies them)."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in piece_digests)).hexdigest()


def file_problem(directory: Path, name: str, expected: dict[str, Any],
                 deep: bool = True) -> str | None:
    """Why this file cannot be trusted (missing, truncated, altered), or None when it verifies.

    ``deep=False``: its size alone (what a resume checks before it reads: each slice is verified as
    it is read, :func:`rest_problem` and :func:`slice_problem`), except for a file written before
    digests per slice (issue 45), which is hashed whole as it always was."""
    if not name or "/" in name or name.startswith("."):
        return "not a file name of this snapshot"
    path = directory / name
    try:
        # an open by name: on NFS, fresh attributes (close-to-open)
        with open(path, "rb") as source:
            size = os.fstat(source.fileno()).st_size
            if size != expected.get("size"):
                return f"size {size} bytes, manifest says {expected.get('size')}"
            digests = expected.get("digests")
            if not isinstance(digests, dict):
                return None if _sha256(source, [(0, size)]) == expected.get("sha256") else \
                    "sha256 differs from the manifest"
            if not deep:
                return None
            problem = _rest_problem(source, size, digests)
            pieces = {i: _sha256(source, [(offset, length)]) for i, offset,
                      length, _ in _spans(digests)}
    except OSError:
        return "missing"
    except (TypeError, ValueError):
        return "its manifest entry is not readable"
    return problem or next((f"sha256 of slice {s} differs from the manifest" for s, want in
                            sorted(digests.get("slices", {}).items())
                            if not _composed(pieces, want, s, digests)), None)


def rest_problem(path: Path, expected: Mapping[str, Any]) -> str | None:
    """Why the file's bytes outside its pieces (the zip's records, the pickle, the RNG states)
    cannot be trusted, or None. Small: a resume reads them anyway (torch.load reads the pickle, and
    then finds them in the page cache: read here without the kernel's read-ahead, which would pull
    in megabytes of the pieces beside them); None for a file with no digests (hashed whole
    before)."""
    digests = expected.get("digests")
    if not isinstance(digests, dict):
        return None
    try:
        with open_exact(path) as source:
            return _rest_problem(source, int(expected["size"]), digests)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    except (KeyError, TypeError, ValueError):
        return "its manifest entry is not readable"


def open_exact(path: Path) -> BinaryIO:
    """``path`` opened for reads of exactly the bytes asked for: no read-ahead
    (``POSIX_FADV_RANDOM``). A reader of one slice of a file that holds two would otherwise make the
    disk serve up to ``read_ahead_kb`` (8 MB on this machine's disk) of the other slice after it:
    1.7 states for 1 in B9 at 50 MB."""
    source = open(path, "rb", buffering=0)
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(source.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
    return source  # type: ignore[return-value]


def read_span(source: BinaryIO, offset: int, into: memoryview) -> None:
    """Fill ``into`` with the file's bytes from ``offset`` (in reads of at most 16 MiB); EOFError if
    it ends."""
    done = 0
    while done < into.nbytes:
        got = os.preadv(source.fileno(), [into[done:done + (1 << 24)]], offset + done)
        if got <= 0:
            raise EOFError(f"{getattr(source, 'name', 'a snapshot file')} ends at byte "
                           f"{offset + done}")
        done += got


def warm_heads(path: Path, expected: Mapping[str, Any]) -> None:
    """Read, without read-ahead, the first 8 KiB of each piece: torch.load reads 4 KiB from each
    record's header, into the piece's bytes, and where those pages are not in the page cache the
    kernel reads ahead of torch's read by up to twice ``read_ahead_kb`` (torch advises sequential
    access), through the piece (16 MB of a slice that is not this reader's, measured in B9) and
    leaves marks that make later reads read ahead."""
    with contextlib.suppress(OSError), open_exact(path) as source:
        for offset, length in spans_of(expected).values():
            if length:
                os.pread(source.fileno(), min(length, 8192), offset)


def spans_of(expected: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    """piece -> (offset, bytes) in the file, for the pieces its digests found in the stream."""
    digests = expected.get("digests")
    return {i: (offset, length) for i, offset,
            length, _ in _spans(digests)} if isinstance(digests, dict) else {}


def slice_problem(expected: Mapping[str, Any], slice_: int,
                  piece_digests: Sequence[str]) -> str | None:
    """Why slice ``slice_`` as read from this file (``piece_digests``: sha256 of each of its pieces'
    bytes, in piece order) cannot be trusted, or None; None too when the file has no digest for it
    (its bytes were in the rest, verified with it)."""
    digests = expected.get("digests")
    want = digests.get("slices", {}).get(str(slice_)) if isinstance(digests, dict) else None
    if want is None or slice_digest(piece_digests) == want:
        return None
    return f"sha256 of slice {slice_} differs from the manifest"


def _composed(pieces: Mapping[int, str], want: str, slice_: str,
              digests: Mapping[str, Any]) -> bool:
    """Whether the slice's pieces, as hashed in the file, give its digest."""
    indices = sorted(i for i, _, _, owner in _spans(digests) if str(owner) == slice_)
    return bool(indices) and slice_digest([pieces[i] for i in indices]) == want


def _spans(digests: Mapping[str, Any]) -> list[tuple[int, int, int, int]]:
    return [(int(i), int(offset), int(length), int(owner)) for i, offset,
            length, owner in digests.get("spans", [])]


def _rest_problem(source: BinaryIO, size: int, digests: Mapping[str, Any]) -> str | None:
    """The rest's digest against the manifest: the file outside its spans, read in file order."""
    outside, at = [], 0
    for _, offset, length, _ in sorted(_spans(digests), key=lambda span: span[1]):
        outside.append((at, offset - at))
        at = offset + length
    outside.append((at, size - at))
    if _sha256(source, outside) != digests.get("rest"):
        return "sha256 of its records outside the state's pieces differs from the manifest"
    return None


def _sha256(source: BinaryIO, ranges: Sequence[tuple[int, int]]) -> str:
    """sha256 of these byte ranges of an open file, in order, read in blocks of 4 MiB."""
    digest = hashlib.sha256()
    for offset, length in ranges:
        source.seek(offset)
        while length > 0:
            block = source.read(min(length, 1 << 22))
            if not block:
                break
            digest.update(block)
            length -= len(block)
    return digest.hexdigest()
