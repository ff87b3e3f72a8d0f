"""What the salvage code reads of the run a failure cut short: the seam between salvage/ and the run
API.

The survivors' snapshot (:mod:`hpc_ddp.rank.salvage.jit`, :mod:`~hpc_ddp.rank.salvage.jit_commit`)
and the per-rank mirror (:mod:`~hpc_ddp.rank.salvage.mirror`) take the run (a
:class:`hpc_ddp.rank.loop.run.Run`) as a
:class:`Survivor`: the fields they read, named here, without an import of loop/ (an import up the
rank's layers). :class:`hpc_ddp.rank.state.restore.Resuming` is the same seam for a resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hpc_ddp.core.config import RunConfig
    from hpc_ddp.core.slurm_env import DistEnv
    from hpc_ddp.rank.salvage.held import Held
    from hpc_ddp.rank.state.checkpointer import Checkpointer
    from hpc_ddp.rank.state.tracked import PerRank


class Mirrored(Protocol):
    """What a survivor reads of its mirror (a :class:`hpc_ddp.rank.salvage.mirror.Mirror`; named by
    its fields so that mirror.py, which takes a :class:`Survivor`, is not imported back)."""

    broken: str | None  # why the exchange stopped before the end (a peer died)
    ward: int  # whose state this rank keeps
    # after ``held``: states given at a later step than theirs (mirror=N): {rank: {step: theirs}}
    stale: dict[int, dict[int, int]]

    def held(self) -> dict[int, dict[int, bytes]]: ...  # {rank: {step: packed state}}, newest first


class Survivor(Protocol):
    """What the salvage code reads of the run: read only, so a run's narrower fields (a ``Mirror``
    for ``mirror``) fit."""

    @property
    def config(self) -> RunConfig: ...

    @property
    def env(self) -> DistEnv: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    # the user's replicated objects: anything with a state_dict
    def tracked(self) -> dict[str, Any]: ...

    @property
    def per_rank(self) -> dict[str, PerRank]: ...

    @property
    def held(self) -> Held | None: ...  # None: snapshot.jit is off

    @property
    def mirror(self) -> Mirrored | None: ...  # None: no per_rank objects, or one rank

    @property
    def checkpointer(self) -> Checkpointer | None: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def local_world_size(self) -> int: ...
