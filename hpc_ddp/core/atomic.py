"""Durable file replacement: the one way hpc_ddp writes a file that must never be half there.

Write to a temporary name beside the target, fsync it, rename it over the target, fsync the
directory. Neither way writes through a link someone planted at the name (``O_NOFOLLOW``,
``O_EXCL``). A crash at any point leaves either the old file or the new one. And the other way, for
a small record other nodes read by name again and again (a liveness beat, the declaration of a lost
rank, the newest commit): rewritten in place, one fixed width, so the name never points at another
file. And a line appended to a JSON-lines file (the ledger, metrics.jsonl) whole or not at all. No
torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | memoryview | str | Callable[[BinaryIO], None],
                 fault: Callable[[str], None] | None = None) -> None:
    """Replace ``path`` with ``data`` durably. ``fault`` is a test seam called at "tmp" and
    "before_rename".

    ``data`` may be a function that writes into the open temporary file: a snapshot is
    serialised straight into it, without a second copy of the state in memory.
    """
    if isinstance(data, str):
        data = data.encode()
    # unique per thread: two threads of one process (a failure handler and the training thread)
    # never share one
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_native_id()}")
    try:
        with os.fdopen(_create_new(tmp), "wb") as out:
            if callable(data):
                data(out)
            else:
                out.write(data)
            if fault:
                fault("tmp")
            out.flush()
            os.fsync(out.fileno())
        if fault:
            fault("before_rename")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _create_new(tmp: Path) -> int:
    """A new file at ``tmp`` (mode 0666 less the umask), never a link's target: one a crashed
    process of the same pid and thread left is removed first (the link itself, if someone planted
    one, not what it names)."""
    try:
        return os.open(tmp, NEW, 0o666)
    except FileExistsError:
        os.unlink(tmp)
        return os.open(tmp, NEW, 0o666)


def rewrite_in_place(path: Path, data: bytes, sync: bool = False) -> None:
    """Overwrite the start of ``path`` (created if missing) with ``data``, which has the record's
    fixed width. A rename would give the name a new file, which a node that cached the old one may
    not see (NFS); the same file rewritten is read anew at every open (close-to-open). ``sync``:
    fsync before returning. A link at ``path`` is refused (``O_NOFOLLOW``: an OSError), never
    written through."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: Path, line: str | bytes, sync: bool = True) -> None:
    """Append one whole line (``line`` ends with its newline) to a JSON-lines file; all or nothing.
    ``sync``: fsync it (the ledger; metrics.jsonl, a line per step, is not synced).

    A write that fails (a full disk: ENOSPC, or a quota) is undone: the file is cut back to the size
    it had, so no line is left without its newline for the next append to be glued to (a reader
    would drop both), and the error is raised. A line the file already ends in without its newline
    (torn by a crash, or by a writer that could not cut it back) is closed first, so a reader drops
    the torn line alone and reads the new one. The files appended to have one writer at a time (rank
    0, or the batch shell once the step has ended), so the size before the write is where this line
    begins."""
    data = line.encode() if isinstance(line, str) else bytes(line)
    # read too: the last byte, by the same open
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
    start = -1
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            data = b"\n" + data  # the torn line stays alone on its line
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    except OSError:
        _cut_back(fd, start)
        os.close(fd)
        raise
    try:
        os.close(fd)  # NFS reports a write-back's failure here at the latest
    except OSError:
        _cut_back(str(path), start)
        raise


def _cut_back(file: int | str, size: int) -> None:
    """Cut a failed append's part off (best effort: a file that cannot be cut keeps a torn line,
    which the next append closes)."""
    if size < 0:
        return
    try:
        os.truncate(file, size)
    except OSError:
        pass
