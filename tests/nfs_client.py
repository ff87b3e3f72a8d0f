"""A fault injector for tests: one node's NFS client, as Linux caches with ``lookupcache=all`` and an attribute
cache of 30 s (``acdirmin``), over the real files. Installed with :func:`hpc_ddp.rundir.view.seen_as`.

What it plays, and what it does not:
- a name looked up (a stat, an open) is remembered for ``ac_s``, present with its attributes or **absent**:
  while an absence is remembered, an open of that name fails as the real client's does;
- a directory listing is remembered for ``ac_s``: names created since are missing from it;
- an open of a name not remembered as absent reads the server's current content (close-to-open).
It keeps no data cache beyond that (an open always reads fresh bytes), and it ignores that a real client
drops a directory's entries early when it happens to revalidate the directory: it is the worst case a node
can see within ``ac_s``, not the average.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from pathlib import Path


class CachingClient:
    def __init__(self, clock: Callable[[], float], ac_s: float = 30.0) -> None:
        self.clock, self.ac_s = clock, ac_s
        self.names: dict[str, tuple[float, os.stat_result | None]] = {}
        self.listings: dict[str, tuple[float, list[str]]] = {}

    def _fresh(self, when: float) -> bool:
        return self.clock() - when < self.ac_s

    def _lookup(self, path: Path) -> os.stat_result | None:
        hit = self.names.get(str(path))
        if hit is not None and self._fresh(hit[0]):
            return hit[1]
        try:
            found: os.stat_result | None = os.stat(path)
        except FileNotFoundError:
            found = None
        self.names[str(path)] = (self.clock(), found)
        return found

    def stat(self, path: Path) -> os.stat_result:
        found = self._lookup(path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "absent (this client's cached view)", str(path))
        return found

    def listdir(self, path: Path) -> list[str]:
        hit = self.listings.get(str(path))
        if hit is not None and self._fresh(hit[0]):
            return list(hit[1])
        names = os.listdir(path)
        self.listings[str(path)] = (self.clock(), names)
        return list(names)

    def read_bytes(self, path: Path) -> bytes:
        hit = self.names.get(str(path))
        if hit is not None and hit[1] is None and self._fresh(hit[0]):
            raise FileNotFoundError(errno.ENOENT, "absent (a cached negative entry)", str(path))
        try:
            with open(path, "rb") as source:  # close-to-open: the server's current content
                data = source.read()
        except FileNotFoundError:
            self.names[str(path)] = (self.clock(), None)
            raise
        self.names[str(path)] = (self.clock(), os.stat(path))
        return data

    def looked_at(self, lookups: Iterable[Path] = (), listings: Iterable[Path] = ()) -> None:
        """What this node did earlier: stat these names and list these directories now (cached from now)."""
        for path in lookups:
            self._lookup(path)
        for path in listings:
            self.listdir(path)
