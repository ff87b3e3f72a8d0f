"""Where torch.compile's caches live for a run (``train.compile_cache``), and how a node-local copy
stays warm.

A compile costs seconds to minutes per attempt; with its caches warm (inductor's FX graph cache, the
AOTAutograd cache, Triton's kernels) the same graphs load in a fraction of that. So the caches must
be where every step, node and requeue of the run finds them:

- ``run`` (the default): ``RUN_DIR/compile_cache`` (:func:`hpc_ddp.rundir.layout.compile_cache`), on
  the run dir's shared storage. Inductor writes every cache entry to a temporary name in the entry's
  own folder and renames it (``torch._inductor.codecache.write_atomic``), so concurrent ranks of one
  node never see a half file. Across nodes, that temporary name is ``.{pid}.{thread}.tmp``: unique
  on a host, not across hosts (two nodes whose writers have the same pid, common in containers,
  could interleave one temporary file), and its C++ builds take file locks that NFS may not honour.
  Both are rare and cost a recompile at worst where the file system renames atomically; where it
  does not (some parallel or object-backed file systems), use:
- ``node``: a node-local folder (``$TMPDIR`` or ``/tmp``, one per user and run, private: its name
  comes from the run's secret and it is made 0700 and checked, :mod:`hpc_ddp.rundir.node_local`,
  since inductor loads the Python, shared objects and pickles it finds there). At each attempt's
  start a node's first rank copies the run's shared copy into it (:func:`seed`: only names it
  lacks), so a spare node that joins in a heal starts warm; after the first compiled step, the first
  rank of node 0 copies new entries back (:func:`publish`, each to a name unique to its host, then
  renamed; regular files only, never through a link). Only the first rank of a node writes the
  shared folder, once per attempt.
- ``off``: no FX graph or AOTAutograd cache (every attempt compiles cold; for telling a cache
  problem apart).
- an absolute path: that folder, shared or not, as you say.

An explicit ``TORCHINDUCTOR_CACHE_DIR`` (or one of the other variables) in the environment wins: it
is kept, and the worker's log says so. No torch here: the variables must be set before
torch._inductor reads them.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpc_ddp.core.atomic import NEW
from hpc_ddp.rundir import layout, node_local

CACHE_DIR_VAR = "TORCHINDUCTOR_CACHE_DIR"
TRITON_VAR = "TRITON_CACHE_DIR"
FX_GRAPH_VAR = "TORCHINDUCTOR_FX_GRAPH_CACHE"  # read when torch._inductor.config is imported
AUTOGRAD_VAR = "TORCHINDUCTOR_AUTOGRAD_CACHE"  # read when torch._functorch.config is imported


@dataclass
class CacheEnv:
    """What to export for ``train.compile_cache``: ``wanted`` (set where unset), ``kept`` (the
    user's own)."""

    folder: Path | None
    place: str
    wanted: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    @property
    def exported(self) -> dict[str, str]:
        return {k: v for k, v in self.wanted.items() if k not in self.kept}


def node_folder(run_dir: Path | str, environ: Mapping[str, str]) -> Path:
    """The node-local cache of this run: ``$TMPDIR/hpc_ddp-UID-KEY-compile``, KEY from the run's
    secret (another user can neither guess nor plant it); made private by the first rank that uses
    it (:func:`hpc_ddp.rundir.node_local.ensure`)."""
    return node_local.run_folder(run_dir, Path(environ.get("TMPDIR") or "/tmp"), suffix="-compile")


def cache_env(place: str, run_dir: Path | str, environ: Mapping[str, str]) -> CacheEnv:
    """The variables that put torch.compile's caches where ``train.compile_cache`` says."""
    if place == "off":
        wanted = {FX_GRAPH_VAR: "0", AUTOGRAD_VAR: "0"}
        folder = None
    else:
        folder = (layout.compile_cache(run_dir) if place == "run" else
                  node_folder(run_dir, environ) if place == "node" else Path(place))
        wanted = {CACHE_DIR_VAR: str(folder), TRITON_VAR: str(folder / "triton"), FX_GRAPH_VAR: "1",
                  AUTOGRAD_VAR: "1"}
    kept = {k: environ[k] for k in wanted if k in environ and environ[k] != wanted[k]
            and not (k == CACHE_DIR_VAR and environ[k] == torchs_default(environ))}
    if CACHE_DIR_VAR in kept:
        folder = Path(kept[CACHE_DIR_VAR])
    return CacheEnv(folder, place, wanted, kept)


def _entries(folder: Path) -> dict[Path, Path]:
    """The cache's finished files by relative path: no temporary files (``.*``, ``tmp*``), no lock
    files, and regular files only (a link someone left would copy whatever it names)."""
    found: dict[Path, Path] = {}
    for root, dirs, files in os.walk(folder):  # never into a linked folder
        dirs[:] = [d for d in dirs if not d.startswith((".", "tmp")) and d != "locks"]
        for name in files:
            if not name.startswith((".", "tmp")) and not name.endswith((".lock", ".tmp")):
                path = Path(root) / name
                if stat.S_ISREG(path.lstat().st_mode):
                    found[path.relative_to(folder)] = path
    return found


def _copy_file(source: Path, target: Path) -> None:
    """``source``'s bytes and times into the new file ``target``: neither opened through a link."""
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(src)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{source} is not a regular file")
        with os.fdopen(os.dup(src), "rb") as reading, os.fdopen(os.open(target, NEW, 0o644),
                                                                "wb") as out:
            shutil.copyfileobj(reading, out)
        os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
    finally:
        os.close(src)


def copy_new(source: Path, target: Path) -> int:
    """Copy the cache entries of ``source`` that ``target`` lacks, each to a temporary name unique
    to this host and process, then renamed (a reader never sees half a file); the number copied. An
    entry another node may have written meanwhile is only written twice (same key, same content)."""
    if not source.is_dir():
        return 0
    have = set(_entries(target)) if target.is_dir() else set()
    copied = 0
    tag = f"{socket.gethostname()}.{os.getpid()}"
    for rel, path in _entries(source).items():
        if rel in have:
            continue
        dest = target / rel
        tmp = dest.with_name(f".{dest.name}.{tag}.tmp")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _copy_file(path, tmp)
            os.replace(tmp, dest)
            copied += 1
        except OSError:
            # an entry gone meanwhile, a full disk: that graph compiles cold
            tmp.unlink(missing_ok=True)
    return copied


def seed(run_dir: Path | str, local: Path) -> int:
    """Warm a node-local cache from the run's shared copy (a node's first rank, at the attempt's
    start)."""
    return copy_new(layout.compile_cache(run_dir), local)


def publish(local: Path, run_dir: Path | str) -> int:
    """The node-local cache's new entries into the run's shared copy (node 0's first rank, after
    compiling)."""
    return copy_new(local, layout.compile_cache(run_dir))


def drop_if_empty(run_dir: Path | str) -> bool:
    """Remove the run's cache folder when nothing was cached in it (True when removed): inductor
    creates the folder its variable names as soon as it is imported, which building an optimizer
    does, so a run that never compiled would keep an empty ``compile_cache/``. Called when the run
    has finished; only empty folders go (``rmdir`` refuses any other, atomically, whoever else
    writes there)."""
    top = layout.compile_cache(run_dir)
    if not top.is_dir():
        return False
    for root, dirs, _files in os.walk(top, topdown=False):
        for name in dirs:
            try:
                os.rmdir(Path(root, name))
            except OSError:
                return False
    try:
        top.rmdir()
    except OSError:
        return False
    return True


def torchs_default(environ: Mapping[str, str], user: str | None = None) -> str:
    """Inductor's own default cache folder, which it writes into ``os.environ`` the first time
    anything in a process imports its config (building an optimizer does): a job submitted from such
    a process inherits it, so that value is torch's, never the user's choice (torch's rule: TMPDIR,
    "torchinductor_" + user)."""
    name = re.sub(r'[\\/:*?"<>|]', "_", user if user is not None else getpass.getuser())
    return os.path.join(environ.get("TMPDIR") or "/tmp", f"torchinductor_{name}")
