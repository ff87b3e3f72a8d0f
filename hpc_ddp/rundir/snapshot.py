"""Per-node snapshot files, the manifest that commits them, and choosing what to resume from.

Layout: ``RUN_DIR/snapshots/step-00000123/node-00000.pt`` (one per node, written by
its local rank 0: its slices of the replicated state, see :mod:`hpc_ddp.rundir.slicing`, and
its ranks' RNG states) and ``manifest.json`` (files with their sizes, sha256, slices
and ranks; the layout; step, world size, config), written last by global rank 0: a
step without a valid manifest does not exist. Every file is written to a temporary
name, fsynced, renamed, and the directory fsynced, so a crash at any point leaves the
last committed step intact. Loads use ``torch.load(weights_only=True)``: a file that
needs arbitrary unpickling is refused, nothing in it runs. The collective part (who
writes what, who verifies what) is in :mod:`hpc_ddp.rank.state.checkpointer`; this module is
plain file handling, and imports torch only to serialise (``status`` reads manifests
without it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hpc_ddp.core import atomic
from hpc_ddp.rundir import jit_files, layout, newest, slicing, view
from hpc_ddp.core.errors import HpcDdpError, explain

log = logging.getLogger("hpc_ddp.snapshot")
MANIFEST = "manifest.json"
WITHDRAWN = "withdrawn"  # a manifest key: the step was taken back (why), whatever name a cache still shows
REFUSES_RESIZE = "refuses_resize"  # the manifest's key: why the run cannot resume at another world size
# its reasons are joined by REASONS_JOIN; the per-rank state's starts with PER_RANK_REASON (rank/state/tracked.py)
REASONS_JOIN, PER_RANK_REASON = "; ", "the per-rank state "
# Tests only: "POINT:STEP[:SIGNAL]" with POINT one of tmp, before_rename, before_manifest: at that point of the
# write of that step this process gets SIGNAL (default KILL, as if killed there; TERM or USR2: a stop mid-write).
FAULT_POINT: str | None = None


class SnapshotError(HpcDdpError):
    """A snapshot cannot be written or read."""

    retry_may_help = True  # a full or failing filesystem: once space is freed, a requeue succeeds


class Unverified(SnapshotError):
    """A committed step's bytes did not verify as they were read (no copy of a slice, or a file's records): a
    resume takes the step before."""


def _fault(point: str, path: Path) -> None:
    """Fault injection for tests: a signal to this process at this point of the write of that step."""
    if not FAULT_POINT:
        return
    where, _, rest = FAULT_POINT.partition(":")
    step, _, name = rest.partition(":")
    if where == point and step and path.parent.name == f"step-{int(step):08d}":
        os.kill(os.getpid(), getattr(signal, f"SIG{name or 'KILL'}"))


def step_dir(run_dir: Path, step: int) -> Path:
    return layout.snapshots(run_dir) / f"step-{step:08d}"


def node_file_name(node_rank: int) -> str:
    return f"node-{node_rank:05d}.pt"


def write_atomic(path: Path, data: bytes | memoryview | Callable[[BinaryIO], None]) -> None:
    """:func:`hpc_ddp.core.atomic.write_atomic` with the fault seam, and a SnapshotError that says what to do."""
    try:
        atomic.write_atomic(path, data, fault=lambda point: _fault(point, path))
    except OSError as err:
        raise SnapshotError(explain(f"cannot write {path}: {err.strerror}",
                                    hint="check free space and permissions of the run directory; "
                                    "the previous committed snapshot is untouched")) from None


Ready = Callable[[int, int, int], None]  # (piece, start, stop): returns once those bytes of the piece are in memory


class _Hashing:
    """A write-only file that hashes and counts what passes through (torch.save writes sequentially).

    The hash of a chunk runs in a helper thread while the chunk is written: both release the
    GIL, so hashing hides behind the write (sha256 alone was ~35% of a 100 MB snapshot).

    Each byte is hashed once, into one of two kinds of digest, so that a resume can verify exactly what it
    reads (issue 45: before, every file was hashed whole, replicas included, and the disk served the state
    twice). torch.save writes a tensor's storage in one call straight from the tensor's memory, so a write
    whose address and size are a piece's (``pieces``: {index: CPU tensor}) is that piece: it gets a digest of
    its own and its place in the file (a *span*). Everything else (the zip's records, the pickle, the RNG
    states, a piece torch had to copy first, e.g. from a GPU) goes into one digest of the *rest*, the file
    outside the spans, in file order.
    """

    def __init__(self, out: BinaryIO, pool: ThreadPoolExecutor, pieces: Mapping[tuple[int, int], int] | None = None,
                 ready: Ready | None = None) -> None:
        self.out, self.pool, self.rest, self.size = out, pool, hashlib.sha256(), 0
        self.pieces = dict(pieces or {})  # (address, bytes) -> piece index
        self.spans: dict[int, tuple[int, int, Any]] = {}  # piece index -> (offset, bytes, its sha256)
        # torch re-raises a failed write as a RuntimeError; keep the cause (a full disk, a failed copy)
        self.error: BaseException | None = None
        self.ready = ready
        self.first_write: Callable[[], None] | None = None  # called once, at torch.save's first write

    def write(self, data: Any) -> int:
        if self.first_write is not None:
            self.first_write, first = None, self.first_write
            first()
        view = memoryview(data).cast("B")
        index = self.pieces.pop((_address(view), view.nbytes), None) if self.pieces and view.nbytes else None
        if index is None:
            self._write(view, self.rest)
        else:
            digest = hashlib.sha256()
            self.spans[index] = (self.size, view.nbytes, digest)
            step = WRITE_CHUNK if self.ready is not None else view.nbytes
            for start in range(0, view.nbytes, step):  # chunk k is written while chunk k+1 is still copying
                if self.ready is not None:
                    try:
                        self.ready(index, start, min(start + step, view.nbytes))
                    except BaseException as err:
                        self.error = err
                        raise
                self._write(view[start:start + step], digest)
        return view.nbytes

    def _write(self, view: memoryview, digest: Any) -> None:
        """Hash ``view`` in the helper thread while this thread writes it."""
        hashed = self.pool.submit(digest.update, view)
        try:
            self.out.write(view)
        except OSError as err:
            self.error = err
            raise
        finally:
            hashed.result()  # in order: the next chunk is hashed only after this one
        self.size += view.nbytes

    def flush(self) -> None:
        self.out.flush()

    def digests(self, slices: Mapping[int, int], sizes: Mapping[int, int]) -> dict[str, Any]:
        """The manifest's ``digests`` of the file: the rest's; each piece's span ``[index, offset, bytes,
        slice]`` (an empty piece: 0 bytes at 0); each slice's digest (:func:`slice_digest`) where every piece of
        it has a span. A piece without one (torch copied it first) is in the rest, and so is its slice."""
        found = {i: (offset, size, d.hexdigest()) for i, (offset, size, d) in self.spans.items()}
        found.update({i: (0, 0, EMPTY) for i, size in sizes.items() if size == 0})
        by_slice: dict[int, list[int]] = {}
        for index, owner in slices.items():
            by_slice.setdefault(owner, []).append(index)
        return {"rest": self.rest.hexdigest(),
                "spans": [[i, offset, size, slices.get(i, -1)] for i, (offset, size, _) in sorted(found.items())],
                "slices": {str(s): slice_digest([found[i][2] for i in sorted(indices)])
                           for s, indices in sorted(by_slice.items()) if all(i in found for i in indices)}}


EMPTY = hashlib.sha256(b"").hexdigest()
WRITE_CHUNK = 32 << 20  # a staged piece is hashed and written in chunks of this, each once its copy is done


def _address(view: memoryview) -> int:
    """Where a buffer's bytes are in memory (numpy reads it from any buffer, read-only ones too)."""
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


def slice_digest(piece_digests: Sequence[str]) -> str:
    """A slice's digest: sha256 over its pieces' sha256 digests, in piece order (so the writer may hash the
    pieces in the order torch writes them, and the reader in the order it copies them)."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in piece_digests)).hexdigest()


_CRC_SWITCH = threading.Lock()  # torch.save's CRC option is process-wide: one writer switches it at a time


@contextlib.contextmanager
def _without_crc32(hashing: _Hashing) -> Iterator[bool]:
    """torch.save of a node file without the zip's CRC-32 of each record: whether it could be switched off.

    The CRC was a second pass over the state, serial, single-threaded, before each record is written
    (0.5 s for 512 MB here, as slow as the disk), and it read a piece before torch.save wrote it, so a
    piece still being copied from a GPU would have to be whole before its write began. The sha256 digests
    of the manifest verify every byte; torch.load reads files without CRCs (``set_crc32_options``, torch
    2.6+). The option is process-wide and read when torch.save opens its writer: it is switched back at
    the first write, so another thread's torch.save runs without CRCs for at most the pickling of this
    file's structure."""
    import torch.serialization as serialization

    get, put = (getattr(serialization, name, None) for name in ("get_crc32_options", "set_crc32_options"))
    if get is None or put is None:
        yield False
        return
    _CRC_SWITCH.acquire()
    before, restored = get(), []

    def restore() -> None:
        if not restored:
            restored.append(True)
            put(before)
            _CRC_SWITCH.release()

    put(False)
    hashing.first_write = restore
    try:
        yield True
    finally:
        restore()


def write_node_file(directory: Path, node_rank: int, payload: dict[str, Any], name: str | None = None,
                    split: Mapping[str, Any] | None = None, ready: Ready | None = None) -> dict[str, Any]:
    """Serialise one node's file straight into its temporary file, hashing on the way; return its
    manifest entry (name, size, digests). No in-memory copy of the state and no second pass to
    hash it: B3 measured the two at 60% of a 100 MB snapshot's time. ``name``: another file name than
    the node's (a just-in-time snapshot's); ``split``: the layout the payload's pieces follow (each
    slice then gets a digest a resume checks as it reads the slice, :func:`slice_problem`).

    ``ready``: the pieces are still being copied into their memory (:mod:`hpc_ddp.rank.state.pipeline`):
    each is written in chunks, each chunk once ``ready`` says its bytes are there. A piece the stream
    did not write from its own memory would have been written without that wait: an error, never a commit."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    name = name or node_file_name(node_rank)
    hashing: list[_Hashing] = []
    pieces: Mapping[int, Any] = payload.get("pieces") or {}
    known = {(t.untyped_storage().data_ptr(), t.nbytes): i for i, t in pieces.items()
             if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.nbytes
             and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes}
    slices = {i: split["pieces"][i][3] for i in pieces} if split is not None else {}

    def serialise(out: BinaryIO) -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="snapshot-sha256") as pool:
            hashing.append(_Hashing(out, pool, known, ready))
            try:
                with _without_crc32(hashing[0]) as crc_off:
                    if ready is not None and not crc_off:  # the CRC reads each piece before its write
                        for index, tensor in pieces.items():
                            ready(index, 0, tensor.nbytes)
                    torch.save(payload, hashing[0])
            except Exception:
                if hashing[0].error is not None:  # e.g. ENOSPC: say that, not torch's "file write failed"
                    raise hashing[0].error from None
                raise
        if ready is not None and hashing[0].pieces:
            raise SnapshotError(explain(
                f"snapshot pieces {sorted(hashing[0].pieces.values())} of {directory / name} were not written from "
                "their staged memory, so possibly before their copy from the device ended", hint="a bug in "
                "hpc_ddp: report it; the previous committed snapshot is untouched"))

    write_atomic(directory / name, serialise)
    sizes = {i: t.nbytes for i, t in pieces.items() if isinstance(t, torch.Tensor)}
    return {"name": name, "size": hashing[0].size, "digests": hashing[0].digests(slices, sizes)}


FILE_KEYS = ("size", "sha256", "digests", "slices", "ranks")  # what the manifest keeps of a writer's entry


def commit(directory: Path, step: int, entries: list[dict[str, Any]], world_size: int, config_hash: str,
           config: dict[str, Any] | None = None, split: dict[str, Any] | None = None,
           refuses_resize: str | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write the manifest: from now on the step exists. ``config``: the config that wrote it, as
    :func:`hpc_ddp.core.config.flat_values` (a resume with another config says what changed); ``split``:
    the layout of the replicated state over the files (:func:`hpc_ddp.rundir.slicing.layout_for`);
    ``refuses_resize``: why the run cannot resume at another world size (:func:`refuses_resize`);
    ``extra``: more keys (a just-in-time snapshot's ``jit``: who wrote it, after what)."""
    _fault("before_manifest", directory / MANIFEST)
    manifest = {"step": step, "world_size": world_size, "num_nodes": len(entries), "config_hash": config_hash,
                **({"config": config} if config is not None else {}), "created": time.time(),
                "files": {e["name"]: {k: e[k] for k in FILE_KEYS if k in e} for e in entries},
                **({"layout": split} if split is not None else {}),
                **({REFUSES_RESIZE: refuses_resize} if refuses_resize else {}), **(extra or {})}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    try:  # after the commit: a node that cached the manifest's absence learns of it here (rundir/newest.py)
        jit = (extra or {}).get("jit")
        newest.publish(directory.parent.parent, step, jit.get("attempt") if isinstance(jit, dict) else None)
    except OSError as err:
        log.warning("step %d is committed, but %s could not name it (%s): another node may resume from an older "
                    "step until its view of the run dir catches up", step, newest.path(directory.parent.parent), err)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The step's manifest, or None: none, unreadable, or withdrawn (:func:`withdraw`)."""
    try:
        manifest = json.loads(view.current().read_bytes(directory / MANIFEST))
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and isinstance(
        manifest.get("step"), int) and WITHDRAWN not in manifest
    return manifest if ok else None


def withdraw(directory: Path, why: str) -> None:
    """Take a committed step back (survivors that disagree on its state). The mark goes into the manifest's own
    file first, rewritten in place: a node whose cache still maps the name to that file reads the mark, which a
    rename alone would not show it. Then the name goes (``manifest.json.withdrawn``). A reader that catches the
    rewrite half-way reads no manifest, which is what it should read."""
    path = directory / MANIFEST
    with open(path, "r+b") as out:
        manifest = json.loads(out.read())
        out.seek(0)
        out.write(json.dumps({**manifest, WITHDRAWN: why}, indent=1).encode())
        out.truncate()
        out.flush()
        os.fsync(out.fileno())
    os.replace(path, directory / f"{MANIFEST}.withdrawn")
    atomic.fsync_dir(directory)


# How long an NFS client may keep a name's absence (acdirmax, 60 s by default), and a margin.
NAME_CACHE_S = 65.0


def committed(run_dir: Path, wait_s: float = 0.0, sleep: Callable[[float], None] = time.sleep
              ) -> list[tuple[int, dict[str, Any]]]:
    """(step, manifest) of every step with a readable manifest, newest first.

    The listing of ``snapshots/`` and a lookup of a manifest can both be another node's cached view; the
    newest commit's own file cannot (:mod:`hpc_ddp.rundir.newest`). When it names a step newer than any this
    node sees, that step's manifest is read by name again for up to ``wait_s`` (the resume passes
    :data:`NAME_CACHE_S`): the survivors' snapshot committed on another node seconds ago is found, not skipped
    for an older step."""
    root = layout.snapshots(run_dir)
    try:
        names = [n for n in view.current().listdir(root) if n.startswith("step-")]
    except OSError:
        names = []
    found = []
    for name in names:
        manifest = read_manifest(root / name)
        if manifest is not None and name == f"step-{manifest['step']:08d}":
            found.append((manifest["step"], manifest))
    named = newest.read(run_dir)
    if named is not None and named["step"] > max((step for step, _ in found), default=-1):
        manifest = _named(step_dir(run_dir, named["step"]), wait_s, sleep)
        if manifest is not None and manifest["step"] == named["step"]:
            found.append((named["step"], manifest))
    return sorted(found, key=lambda pair: pair[0], reverse=True)


def _named(directory: Path, wait_s: float, sleep: Callable[[float], None]) -> dict[str, Any] | None:
    """The manifest of the step the newest commit names, read by name until this node sees it (``wait_s``);
    None at once for a withdrawn step."""
    waited = 0.0
    while (manifest := read_manifest(directory)) is None and waited < wait_s and not _withdrawn(directory):
        if not waited:
            log.warning("%s names %s as committed, but its manifest is not visible from this node yet (a cached "
                        "view of the run dir); reading it again for up to %.0f s",
                        newest.path(directory.parent.parent), directory.name, wait_s)
        sleep(1.0)
        waited += 1.0
    if manifest is None and waited >= wait_s > 0:
        log.warning("the manifest of %s did not become visible within %.0f s (removed by hand?): resuming from "
                    "an older step", directory, wait_s)
    return manifest


def _withdrawn(directory: Path) -> bool:
    for name in (MANIFEST, f"{MANIFEST}.withdrawn"):
        try:
            if WITHDRAWN in json.loads(view.current().read_bytes(directory / name)):
                return True
        except (OSError, ValueError, TypeError):
            continue
    return False


def agreed(run_dir: Path, found: list[tuple[int, dict[str, Any]]],
           warn: Callable[..., None] = log.warning) -> list[tuple[int, dict[str, Any]]]:
    """``found`` without the survivors' snapshots that a survivor's offer disagrees with
    (:func:`hpc_ddp.rundir.jit_files.disagreeing`): as if withdrawn. Read on one rank (rank 0), whose list
    every rank then takes: the offers are files another node may see otherwise."""
    kept = []
    for step, manifest in found:
        differ = jit_files.disagreeing(run_dir, manifest)
        if differ:
            warn("the survivors' snapshot of step %d is not used: rank(s) %s offered another state of it than its "
                 "writer, rank %s (a replicated object that differs by rank?)", step, differ,
                 manifest["jit"].get("writer"))
            continue
        kept.append((step, manifest))
    return kept


def committed_steps(run_dir: Path) -> list[int]:
    """Steps with a readable manifest, newest first."""
    return [step for step, _ in committed(run_dir)]


def refuses_resize(run_dir: Path, per_rank_only: bool = False) -> str | None:
    """Why the run in ``run_dir`` cannot resume at another world size (naming the per-rank state that refuses
    it, or the global batch that would change), or None when it can (or has no snapshot: a fresh start can
    run at any size). From the newest committed manifest; no torch, for the batch shell: a heal by fewer
    nodes would only be refused by every rank of the new step. ``per_rank_only``: the per-rank reason alone
    (the batch reason was recorded under the config that wrote the snapshot; a --resume checks its own)."""
    found = committed(run_dir)
    reason = found[0][1].get(REFUSES_RESIZE) if found else None
    if not isinstance(reason, str) or not reason:
        return None
    if per_rank_only:
        reason = REASONS_JOIN.join(r for r in reason.split(REASONS_JOIN) if r.startswith(PER_RANK_REASON))
    return reason or None


def file_problem(directory: Path, name: str, expected: dict[str, Any], deep: bool = True) -> str | None:
    """Why this file cannot be trusted (missing, truncated, altered), or None when it verifies.

    ``deep=False``: its size alone (what a resume checks before it reads: each slice is verified as it is
    read, :func:`rest_problem` and :func:`slice_problem`), except for a file written before digests per
    slice (issue 45), which is hashed whole as it always was."""
    if not name or "/" in name or name.startswith("."):
        return "not a file name of this snapshot"
    path = directory / name
    try:
        with open(path, "rb") as source:  # an open by name: on NFS, fresh attributes (close-to-open)
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
            pieces = {i: _sha256(source, [(offset, length)]) for i, offset, length, _ in _spans(digests)}
    except OSError:
        return "missing"
    except (TypeError, ValueError):
        return "its manifest entry is not readable"
    return problem or next((f"sha256 of slice {s} differs from the manifest" for s, want in
                            sorted(digests.get("slices", {}).items())
                            if not _composed(pieces, want, s, digests)), None)


def rest_problem(path: Path, expected: Mapping[str, Any]) -> str | None:
    """Why the file's bytes outside its pieces (the zip's records, the pickle, the RNG states) cannot be
    trusted, or None. Small: a resume reads them anyway (torch.load reads the pickle, and then finds them in
    the page cache: read here without the kernel's read-ahead, which would pull in megabytes of the pieces
    beside them); None for a file with no digests (hashed whole before)."""
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
    """``path`` opened for reads of exactly the bytes asked for: no read-ahead (``POSIX_FADV_RANDOM``). A
    reader of one slice of a file that holds two would otherwise make the disk serve up to ``read_ahead_kb``
    (8 MB on this machine's disk) of the other slice after it: 1.7 states for 1 in B9 at 50 MB."""
    source = open(path, "rb", buffering=0)
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(source.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
    return source  # type: ignore[return-value]


def read_span(source: BinaryIO, offset: int, into: memoryview) -> None:
    """Fill ``into`` with the file's bytes from ``offset`` (in reads of at most 16 MiB); EOFError if it ends."""
    done = 0
    while done < into.nbytes:
        got = os.preadv(source.fileno(), [into[done:done + (1 << 24)]], offset + done)
        if got <= 0:
            raise EOFError(f"{getattr(source, 'name', 'a snapshot file')} ends at byte {offset + done}")
        done += got


def warm_heads(path: Path, expected: Mapping[str, Any]) -> None:
    """Read, without read-ahead, the first 8 KiB of each piece: torch.load reads 4 KiB from each record's
    header, into the piece's bytes, and where those pages are not in the page cache the kernel reads ahead of
    torch's read by up to twice ``read_ahead_kb`` (torch advises sequential access), through the piece (16 MB
    of a slice that is not this reader's, measured in B9) and leaves marks that make later reads read ahead."""
    with contextlib.suppress(OSError), open_exact(path) as source:
        for offset, length in spans_of(expected).values():
            if length:
                os.pread(source.fileno(), min(length, 8192), offset)


def spans_of(expected: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    """piece -> (offset, bytes) in the file, for the pieces its digests found in the stream."""
    digests = expected.get("digests")
    return {i: (offset, length) for i, offset, length, _ in _spans(digests)} if isinstance(digests, dict) else {}


def slice_problem(expected: Mapping[str, Any], slice_: int, piece_digests: Sequence[str]) -> str | None:
    """Why slice ``slice_`` as read from this file (``piece_digests``: sha256 of each of its pieces' bytes,
    in piece order) cannot be trusted, or None; None too when the file has no digest for it (its bytes were
    in the rest, verified with it)."""
    digests = expected.get("digests")
    want = digests.get("slices", {}).get(str(slice_)) if isinstance(digests, dict) else None
    if want is None or slice_digest(piece_digests) == want:
        return None
    return f"sha256 of slice {slice_} differs from the manifest"


def _composed(pieces: Mapping[int, str], want: str, slice_: str, digests: Mapping[str, Any]) -> bool:
    """Whether the slice's pieces, as hashed in the file, give its digest."""
    indices = sorted(i for i, _, _, owner in _spans(digests) if str(owner) == slice_)
    return bool(indices) and slice_digest([pieces[i] for i in indices]) == want


def _spans(digests: Mapping[str, Any]) -> list[tuple[int, int, int, int]]:
    return [(int(i), int(offset), int(length), int(owner)) for i, offset, length, owner in digests.get("spans", [])]


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


@dataclass(frozen=True)
class Choice:
    """What to resume from: a committed step, its files that verified, and which to read each slice from."""

    step: int
    directory: Path
    good_files: tuple[str, ...]
    manifest: dict[str, Any]
    sources: dict[int, str]  # slice -> a good file that holds it (format 1: slice 0, a whole copy)


Verify = Callable[[Path, dict[str, Any]], dict[str, "str | None"]]


def verify_here(directory: Path, manifest: dict[str, Any]) -> dict[str, str | None]:
    """Every file of the step checked by this process: {name: problem or None}."""
    files = manifest.get("files", {})
    return {name: file_problem(directory, name, e if isinstance(e, dict) else {}) for name, e in sorted(files.items())}


def choose(run_dir: Path, verify: Verify = verify_here, found: list[tuple[int, dict[str, Any]]] | None = None,
           warn: Callable[..., None] = log.warning, ranks_needed: int = 0) -> Choice | None:
    """The newest committed step of which every slice has a file that verifies; warn about every bad file.

    ``verify`` checks a step's files (the checkpointer spreads that over the ranks);
    ``found``: the committed steps, when already read; ``ranks_needed``: the world size when ``per_rank``
    objects are tracked (each rank's state has no other copy: a step written at that size whose file of a
    rank's state is bad is skipped, as one with a bad slice is; without them a rank's RNG is reseeded). None when there is no committed
    step (a fresh start). When there are committed steps but none can be restored,
    raise: starting over would silently throw the run away, and its snapshots might be
    restorable from a backup.
    """
    bad: list[str] = []
    for step, manifest in agreed(run_dir, committed(run_dir), warn) if found is None else found:
        directory = step_dir(run_dir, step)
        problem = slicing.layout_problem(manifest)
        if problem:
            warn("snapshot manifest %s is not usable (%s)", directory / MANIFEST, problem)
            bad.append(f"{directory / MANIFEST} ({problem})")
            continue
        verdicts = verify(directory, manifest)
        for name, why in sorted(verdicts.items()):
            if why:
                warn("snapshot file %s is not usable (%s)", directory / name, why)
                bad.append(f"{directory / name} ({why})")
        good = tuple(name for name, why in sorted(verdicts.items()) if why is None)
        sources = slicing.sources(manifest, good) if good else None
        lacking = sorted(r for r in range(ranks_needed) if (f := slicing.rank_file(manifest, r)) and f not in good)
        if sources is not None and lacking and manifest.get("world_size") == ranks_needed:
            warn("committed snapshot step %d has no usable file of the per_rank state of rank(s) %s; trying the "
                 "one before", step, lacking)
            continue
        if sources is not None:
            return Choice(step, directory, good, manifest, sources)
        warn("committed snapshot step %d has no usable copy of %s; trying the one before", step,
             "its files" if not good else "every slice")
    if bad:
        raise SnapshotError(explain(f"no committed snapshot of {run_dir} verifies: {'; '.join(bad[:4])}"
                                    + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""),
                                    hint=f"restore the files from a backup, or move {run_dir / 'snapshots'} "
                                    "away to start the run over"))
    return None


def load_file(path: Path) -> dict[str, Any]:
    """Load a node file with weights_only=True; refuse anything that needs arbitrary unpickling."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # type: ignore[no-any-return]
    except pickle.UnpicklingError as err:
        raise SnapshotError(explain(f"refused to load snapshot file {path}: it needs arbitrary unpickling, "
                                    f"which could run code ({str(err).splitlines()[0][:120]})",
                                    hint="snapshots hold tensors and plain values only; delete this step "
                                    "directory if you did not write it")) from None


def read_state(choice: Choice, also: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the replicated state, {name: loaded file}) of a chosen step: one good file per slice, plus ``also``
    (the file of a rank's RNG state). Not collective: a notebook can read a run's newest snapshot with
    ``read_state(choose(run_dir))[0]``."""
    split = choice.manifest.get("layout")
    needed = {choice.sources[0]} if split is None else set(choice.sources.values())
    files = {name: load_file(choice.directory / name) for name in sorted(needed | ({also} if also else set()))}
    if split is None:  # format 1: every file holds the whole replicated state
        return files[choice.sources[0]]["replicated"], files
    try:
        pieces = {index: files[choice.sources[owner]]["pieces"][index]
                  for index, (_, _, _, owner) in enumerate(split["pieces"])}
        return slicing.assemble(split, files[choice.sources[0]]["skeleton"], pieces), files
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise SnapshotError(explain(f"the files of step {choice.step} in {choice.directory} do not hold what its "
                                    f"manifest says ({err!r})", hint="move this step directory away to resume "
                                    "from the one before")) from None
