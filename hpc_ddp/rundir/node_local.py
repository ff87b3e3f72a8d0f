"""Node-local storage that only the job's user can touch, and the run's secret that names it (issue
61).

A node's ``/dev/shm`` and ``/tmp`` are shared with every other user of the node, and what is left
there outlives a job. Whatever hpc_ddp keeps there (the ranks' liveness beats, the node's copy of
the config and the ledger, the survivors' offers and per-rank states, the node compile cache) would
run as the user's code or steer the user's run if another user could plant it. So:

- **The names are unguessable.** A run's folder on a node is ``BASE/hpc_ddp-UID-KEY``, where KEY is
  an HMAC of the run dir's path under the run's secret: 32 random bytes in
  ``RUN_DIR/.hpc_ddp-secret`` (mode 0600, made once with an exclusive create, by ``submit`` or by
  the first process that needs it). Every node reads the same secret from the run dir, so every rank
  of a node agrees on the folder without talking; another user, who cannot read the run dir's
  secret, cannot compute it (the job id, the uid and the run dir's path are public through
  ``scontrol show job``).
- **Every folder is checked before use** (:func:`ensure`): made with mode 0700 whatever the umask,
  then ``lstat``-ed: a real directory (not a link), owned by this user, closed to group and others;
  anything else is refused with an error that names the folder and its owner.
- **Files are opened without following links** (:func:`read`, ``O_NOFOLLOW``, and their owner
  checked with ``fstat`` before the bytes are trusted); new ones with ``O_EXCL``
  (:mod:`hpc_ddp.core.atomic`).
- **Records carry the attempt's token** (:func:`token`, an HMAC of the attempt's tag): a record on
  the node without it is ignored, and the keys hpc_ddp sets in torch's store live under it.

``BASE`` is ``/dev/shm`` where it is writable, else the temporary directory (``TMPDIR``). Where
Slurm gives each job a private ``/tmp`` and ``/dev/shm`` (``job_container/tmpfs``) all of this still
holds. No torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.rundir import layout, secret_env

SHM = Path("/dev/shm")
SECRET_BYTES = 32
READ_WAIT_S = 5.0  # a secret another node is writing this moment: how long to wait for its bytes


class NodeLocalError(HpcDdpError):
    """A node-local folder or the run's secret is not this user's own: hpc_ddp will not use it."""


def prefix(uid: int | None = None) -> str:
    """The start of every folder name hpc_ddp makes on node-local storage."""
    return f"hpc_ddp-{os.getuid() if uid is None else uid}-"


def base_dir() -> Path:
    """Where the node-local folders go: ``/dev/shm`` where this user may write, else the temporary
    directory."""
    return SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())


def run_secret(run_dir: Path | str) -> bytes:
    """The run's secret, made on first use (an exclusive create, mode 0600), read back by every
    other process."""
    return _secret(str(Path(run_dir).absolute()))


def handed_secret(run_dir: Path | str) -> dict[str, str]:
    """The environment entry a launcher gives the ranks it starts: the run's secret, read once for
    the step instead of once per rank (:mod:`hpc_ddp.rundir.secret_env`)."""
    return secret_env.entry(Path(run_dir), run_secret(run_dir))


@functools.lru_cache(maxsize=16)
def _secret(run_dir: str) -> bytes:
    given = secret_env.handed(run_dir, os.environ, SECRET_BYTES)  # a launcher's, for this run dir
    if given is not None:
        return given
    path = layout.secret(run_dir)
    # read first: every process but the run's first (submit's) finds it there, one open each, not an
    # exclusive create that fails and then a read (issue 59: B14 counts them per rank)
    found = _secret_bytes(path, 0o007 if _group_writes(path.parent) else 0o077)
    if found is not None:
        return found
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:  # a run dir nobody made yet (submit makes it first)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return _read_secret(path)
    if _group_writes(path.parent):
        # run_dir_mode '0770': the group may resume the run, so it reads the secret too
        os.fchmod(fd, 0o640)
    try:
        os.write(fd, (secrets.token_hex(SECRET_BYTES) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return _read_secret(path)


def _group_writes(run_dir: Path) -> bool:
    """The run dir's group may write it (``run_dir_mode: '0770'``): the group is trusted with the
    run."""
    try:
        return bool(os.stat(run_dir).st_mode & 0o020)
    except OSError:
        return False


def _read_secret(path: Path) -> bytes:
    deadline = time.monotonic() + READ_WAIT_S
    # who else may read it: the group, where it writes
    closed = 0o007 if _group_writes(path.parent) else 0o077
    while True:
        found = _secret_bytes(path, closed)
        if found is not None:
            return found
        if time.monotonic() > deadline or _never_readable(path, closed):
            break
        time.sleep(0.05)  # its writer created it a moment ago and writes its 65 bytes now
    raise NodeLocalError(explain(
        f"the run's secret {path} is missing, unreadable, not a private file or not "
        f"{2 * SECRET_BYTES} hex digits",
        expected="a regular file of mode 0600 that hpc_ddp wrote (0640 where the run dir's group "
                 "may write it)",
        hint=f"if nobody else can write the run dir, remove {path} (a new one is made at the next "
             "start); if "
        "someone else made it, the run dir is not yours alone: see docs/security.md"),
                         key="run_dir")


def _secret_bytes(path: Path, closed: int) -> bytes | None:
    """The secret in ``path`` if it holds one (its hex digits, none of the ``closed`` mode bits), or
    None."""
    data = read(path, 4 * SECRET_BYTES, private=closed, owner=None)
    if data is None or len(data.strip()) != 2 * SECRET_BYTES:
        return None
    try:
        return bytes.fromhex(data.strip().decode("ascii", "replace"))
    except ValueError:
        return None


def _never_readable(path: Path, closed: int) -> bool:
    """A secret no wait makes readable: a link, not a regular file, or open to others (our writer
    creates it private and only ever widens it to the group), so it is refused at once."""
    try:
        info = path.lstat()
    except OSError:  # absent: its writer may still be on its way
        return False
    return not stat.S_ISREG(info.st_mode) or bool(info.st_mode & closed)


def token(run_dir: Path | str, tag: str) -> str:
    """The attempt ``tag``'s token: what a node-local record or a store key must carry to be
    believed."""
    return hmac.new(run_secret(run_dir), b"attempt\0" + tag.encode(),
                    hashlib.sha256).hexdigest()[:32]


def run_folder(run_dir: Path | str, base: Path | None = None, suffix: str = "") -> Path:
    """The run's folder on this node (not made here: :func:`ensure`); ``suffix`` names a sibling of
    its own."""
    path = str(Path(run_dir).resolve())
    key = hmac.new(run_secret(run_dir), b"node-folder\0" + path.encode(),
                   hashlib.sha256).hexdigest()[:24]
    return (base or base_dir()) / f"{prefix()}{key}{suffix}"


def ensure(path: Path | str) -> Path:
    """``path`` as a private folder of this user, made where missing: every folder from the first
    one named ``hpc_ddp-UID-...`` down to ``path`` is made with mode 0700 and checked
    (:func:`check`)."""
    path = Path(path)
    chain = [path, *path.parents]
    top = next((i for i, p in enumerate(chain) if p.name.startswith(prefix())), 0)
    # the base (TMPDIR, a test's folder) where missing
    chain[top].parent.mkdir(parents=True, exist_ok=True)
    for folder in reversed(chain[: top + 1]):
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # a umask like 0o277 would have taken our own bits
        except FileExistsError:
            pass
        check(folder)
    return path


def check(folder: Path) -> None:
    """A real directory, this user's, closed to group and others; one of ours left open to reading
    only (an older hpc_ddp's 0755) is closed; anything else is refused."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise NodeLocalError(_refusal(folder, what, info))
    if info.st_uid != os.getuid():
        raise NodeLocalError(_refusal(folder, f"owned by uid {info.st_uid}{_name(info.st_uid)}",
                                      info))
    if info.st_mode & 0o022:
        raise NodeLocalError(_refusal(folder, "writable by others", info))
    if info.st_mode & 0o077:
        os.chmod(folder, 0o700)


def _refusal(folder: Path, what: str, info: os.stat_result) -> str:
    return explain(
        f"hpc_ddp will not use {folder} on this node: it is {what} (mode "
        f"{stat.filemode(info.st_mode)}), and "
        "something another user planted there could steer or run as your job",
        expected=f"a directory of mode 0700 owned by you (uid {os.getuid()}), or none",
        hint=f"remove it (`ls -ld {folder}` shows who made it; ask the node's admin if it is not "
             "yours); "
        "docs/security.md says what hpc_ddp keeps on node-local storage")


def _name(uid: int) -> str:
    try:
        import pwd

        return f" ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return ""


def read(path: Path | str, limit: int = 1 << 20, *, private: int = 0,
         owner: int | None = -1) -> bytes | None:
    """The first ``limit`` bytes of the regular file ``path``, opened without following a link and
    without blocking on a planted FIFO; None when it is absent, not a regular file, not ``owner``'s
    (default: this user's; None: anyone's), or with any of the mode bits ``private`` (0o077: a
    secret only its owner reads)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # absent, or a link where a file of ours should be (ELOOP)
        return None
    try:
        info = os.fstat(fd)
        wanted = os.getuid() if owner == -1 else owner
        if not stat.S_ISREG(info.st_mode) or (wanted is not None and info.st_uid != wanted):
            return None
        if info.st_mode & private:
            return None
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[int]:
    """A lock file in a node's folder, held exclusively (opened without following a link): the
    node's ranks take turns at what they publish for the node."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)
