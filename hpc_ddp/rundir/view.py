"""How this process sees the run dir: the seam between the decisions that another node's writes can
change (which steps are committed, which step directory is a leftover, which ranks were declared
lost) and the filesystem they read.

On one machine the answer is the disk's. On a cluster the run dir is on NFS or Lustre, and a node's
client caches names (absent names too: ``lookupcache=all``), attributes and directory listings for
up to ``acdirmax`` (60 s by default): a manifest another node committed seconds ago can look absent
here, and a listing can lack a marker. What stays trustworthy is creating a name exclusively, and
opening a file by name after its writer closed it (close-to-open), *if this node never looked the
name up while it was absent*. So the run dir's shared decisions go through :func:`current`, and
tests swap in a client that caches as NFS does (``tests/nfs_client.py``) to run them against another
node's stale view. No torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol


class View(Protocol):
    """What a node asks of the run dir. Every method raises ``OSError`` as the ``os`` call it stands
    for."""

    def listdir(self, path: Path) -> list[str]: ...

    def stat(self, path: Path) -> os.stat_result: ...

    def read_bytes(self, path: Path) -> bytes: ...


class Disk:
    """This machine's view: the ``os`` calls themselves."""

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def stat(self, path: Path) -> os.stat_result:
        return os.stat(path)

    def read_bytes(self, path: Path) -> bytes:
        with open(path, "rb") as source:
            return source.read()


_CURRENT: list[View] = [Disk()]


def current() -> View:
    """The view the run dir's shared decisions read through."""
    return _CURRENT[-1]


@contextlib.contextmanager
def seen_as(view: View) -> Iterator[View]:
    """Tests: read the run dir as ``view`` sees it (another node's cached view) inside the block."""
    _CURRENT.append(view)
    try:
        yield view
    finally:
        _CURRENT.remove(view)


def exists(path: Path) -> bool:
    """Whether ``path`` is there as the current view sees it (a stat, which a client may answer from
    its cache)."""
    try:
        current().stat(path)
    except OSError:
        return False
    return True
