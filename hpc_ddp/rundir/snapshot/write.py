"""Writing one node's snapshot file: serialised straight into its temporary file, hashed on the way.

:func:`write_node_file` is what every writer calls (the periodic snapshot's node files, the
survivors' just-in-time files); the manifest that commits them and the choice of what to resume from
are in :mod:`hpc_ddp.rundir.snapshot.store`, the checks of what was written in
:mod:`hpc_ddp.rundir.snapshot.verify`. Torch is imported only inside the writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from hpc_ddp.core.errors import explain
from hpc_ddp.rundir.snapshot.store import SnapshotError, node_file_name, write_atomic
from hpc_ddp.rundir.snapshot.verify import slice_digest

# (piece, start, stop): returns once those bytes of the piece are in memory
Ready = Callable[[int, int, int], None]


class _Hashing:
    """A write-only file that hashes and counts what passes through (torch.save writes
    sequentially).

    The hash of a chunk runs in a helper thread while the chunk is written: both release the
    GIL, so hashing hides behind the write (sha256 alone was ~35% of a 100 MB snapshot).

    Each byte is hashed once, into one of two kinds of digest, so that a resume can verify exactly
    what it reads (issue 45: before, every file was hashed whole, replicas included, and the disk
    served the state twice). torch.save writes a tensor's storage in one call straight from the
    tensor's memory, so a write whose address and size are a piece's (``pieces``: {index: CPU
    tensor}) is that piece: it gets a digest of its own and its place in the file (a *span*).
    Everything else (the zip's records, the pickle, the RNG states, a piece torch had to copy first,
    e.g. from a GPU) goes into one digest of the *rest*, the file outside the spans, in file order.
    """

    def __init__(self, out: BinaryIO, pool: ThreadPoolExecutor,
                 pieces: Mapping[tuple[int, int], int] | None = None,
                 ready: Ready | None = None) -> None:
        self.out, self.pool, self.rest, self.size = out, pool, hashlib.sha256(), 0
        self.pieces = dict(pieces or {})  # (address, bytes) -> piece index
        # piece index -> (offset, bytes, its sha256)
        self.spans: dict[int, tuple[int, int, Any]] = {}
        # torch re-raises a failed write as a RuntimeError; keep the cause (a full disk, a failed
        # copy)
        self.error: BaseException | None = None
        self.ready = ready
        # called once, at torch.save's first write
        self.first_write: Callable[[], None] | None = None

    def write(self, data: Any) -> int:
        if self.first_write is not None:
            self.first_write, first = None, self.first_write
            first()
        view = memoryview(data).cast("B")
        index = self.pieces.pop((_address(view), view.nbytes),
                                None) if self.pieces and view.nbytes else None
        if index is None:
            self._write(view, self.rest)
        else:
            digest = hashlib.sha256()
            self.spans[index] = (self.size, view.nbytes, digest)
            step = WRITE_CHUNK if self.ready is not None else view.nbytes
            # chunk k is written while chunk k+1 is still copying
            for start in range(0, view.nbytes, step):
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
        """The manifest's ``digests`` of the file: the rest's; each piece's span ``[index, offset,
        bytes, slice]`` (an empty piece: 0 bytes at 0); each slice's digest (:func:`slice_digest`)
        where every piece of it has a span. A piece without one (torch copied it first) is in the
        rest, and so is its slice."""
        found = {i: (offset, size, d.hexdigest()) for i, (offset, size, d) in self.spans.items()}
        found.update({i: (0, 0, EMPTY) for i, size in sizes.items() if size == 0})
        by_slice: dict[int, list[int]] = {}
        for index, owner in slices.items():
            by_slice.setdefault(owner, []).append(index)
        return {"rest": self.rest.hexdigest(),
                "spans": [[i, offset, size, slices.get(i, -1)]
                          for i, (offset, size, _) in sorted(found.items())],
                "slices": {str(s): slice_digest([found[i][2] for i in sorted(indices)])
                           for s, indices in sorted(by_slice.items())
                           if all(i in found for i in indices)}}


EMPTY = hashlib.sha256(b"").hexdigest()
# a staged piece is hashed and written in chunks of this, each once its copy is done
WRITE_CHUNK = 32 << 20


def _address(view: memoryview) -> int:
    """Where a buffer's bytes are in memory (numpy reads it from any buffer, read-only ones too)."""
    import numpy

    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data)


# torch.save's CRC option is process-wide: one writer switches it at a time
_CRC_SWITCH = threading.Lock()


@contextlib.contextmanager
def _without_crc32(hashing: _Hashing) -> Iterator[bool]:
    """torch.save of a node file without the zip's CRC-32 of each record: whether it could be
    switched off.

    The CRC was a second pass over the state, serial, single-threaded, before each record is written
    (0.5 s for 512 MB here, as slow as the disk), and it read a piece before torch.save wrote it, so
    a piece still being copied from a GPU would have to be whole before its write began. The sha256
    digests of the manifest verify every byte; torch.load reads files without CRCs
    (``set_crc32_options``, torch 2.6+). The option is process-wide and read when torch.save opens
    its writer: it is switched back at the first write, so another thread's torch.save runs without
    CRCs for at most the pickling of this file's structure."""
    import torch.serialization as serialization

    get, put = (getattr(serialization, name, None)
                for name in ("get_crc32_options", "set_crc32_options"))
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


def write_node_file(directory: Path, node_rank: int, payload: dict[str, Any],
                    name: str | None = None,
                    split: Mapping[str, Any] | None = None,
                    ready: Ready | None = None) -> dict[str, Any]:
    """Serialise one node's file straight into its temporary file, hashing on the way; return its
    manifest entry (name, size, digests). No in-memory copy of the state and no second pass to hash
    it: B3 measured the two at 60% of a 100 MB snapshot's time. ``name``: another file name than the
    node's (a just-in-time snapshot's); ``split``: the layout the payload's pieces follow (each
    slice then gets a digest a resume checks as it reads the slice, :func:`slice_problem`).

    ``ready``: the pieces are still being copied into their memory
    (:mod:`hpc_ddp.rank.state.pipeline`): each is written in chunks, each chunk once ``ready`` says
    its bytes are there. A piece the stream did not write from its own memory would have been
    written without that wait: an error, never a commit."""
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
                    # the CRC reads each piece before its write
                    if ready is not None and not crc_off:
                        for index, tensor in pieces.items():
                            ready(index, 0, tensor.nbytes)
                    torch.save(payload, hashing[0])
            except Exception:
                # e.g. ENOSPC: say that, not torch's "file write failed"
                if hashing[0].error is not None:
                    raise hashing[0].error from None
                raise
        if ready is not None and hashing[0].pieces:
            raise SnapshotError(explain(
                f"snapshot pieces {sorted(hashing[0].pieces.values())} of {directory / name} were "
                "not written from "
                "their staged memory, so possibly before their copy from the device ended",
                hint="a bug in "
                "hpc_ddp: report it; the previous committed snapshot is untouched"))

    write_atomic(directory / name, serialise)
    sizes = {i: t.nbytes for i, t in pieces.items() if isinstance(t, torch.Tensor)}
    return {"name": name, "size": hashing[0].size, "digests": hashing[0].digests(slices, sizes)}
