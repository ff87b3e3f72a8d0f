"""Restoring every rank from the newest committed snapshot whose files verify.

Rank 0 reads the manifests (small) and tells everyone; the ranks verify the step's files between
them (each file hashed by one rank, the verdicts gathered), so no rank reads every file; each rank
then loads (mmap) one good file per slice and puts the state together. At the same world size a
rank's RNG comes from the file of the node that held it; when that file is bad, or the world size
changed, the Run reseeds it and says so. A step that does not verify as it is read gives way to the
one before.

Apart from :mod:`hpc_ddp.rank.state.checkpointer`, which writes snapshots: a resume only reads,
once per attempt, and shares none of the writer's state but the run dir, the ranks and their
groups. It speaks as ``hpc_ddp.checkpointer``, the logger it always had.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.core.errors import explain
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rank.group import control
from hpc_ddp.rank.state import spread
from hpc_ddp.rundir import retention, slicing, snapshot
from hpc_ddp.rundir.snapshot import steps as snapshot_steps, verify as snapshot_verify

log = logging.getLogger("hpc_ddp.checkpointer")


@dataclass(frozen=True)
class Restored:
    step: int
    state: dict[str, Any]  # the replicated training state
    rng: dict[str, Any] | None  # this rank's RNG state; None when it had to come from another node
    # the config that wrote it (flat_values), when the manifest has it
    config: dict[str, Any] | None = None
    world_size: int | None = None  # the world size that wrote it
    # on rank 0: bytes read from snapshot files (total, busiest node, state)
    read: dict[str, Any] | None = None
    # a survivors' snapshot: the ranks whose per-rank state is of an older step (per_rank mirror=N)
    stale: dict[str, int] | None = None


def auto_load(local: bool, nodes: int, replicas: int) -> str:
    """``snapshot.load=auto``, by B9: ``spread`` on a cluster of more than one node, ``every_node``
    elsewhere.

    Each reader hashes only the bytes it reads (a digest per slice, issue 45), so ``spread`` makes
    the filesystem serve the state once in all, and ``every_node`` once per node. In the local
    rehearsal every "node" shares one page cache, so the disk serves it once either way and spread's
    broadcasts only add time. ``replicas`` no longer matters (before, resume hashed every file,
    replicas included, and with ``nodes <= replicas`` every_rank read nothing more); kept for
    callers."""
    del replicas
    return "every_node" if local or nodes == 1 else "spread"


def _read_summary(read_by: list[Any], state: int) -> dict[str, Any]:
    """For the ledger: the bytes all ranks read from snapshot files, the busiest node's, the
    state's."""
    nodes: dict[int, int] = {}
    for node, read in read_by:
        nodes[node] = nodes.get(node, 0) + int(read)
    return {"bytes": sum(nodes.values()), "busiest_node": max(nodes.values()), "state": state,
            "nodes": len(nodes)}


def restore(run_dir: Path, env: DistEnv, groups: Callable[[], spread.Groups], *, across: bool,
            ranks_needed: bool) -> Restored | None:
    """Collective: the newest committed snapshot whose every slice verifies, or None for a fresh
    start. ``groups``: the node's ranks and leaders (made at the first call); ``across``:
    ``snapshot.load=spread``; ``ranks_needed``: per_rank objects are tracked (a step whose file of a
    rank's state is bad is skipped)."""
    if env.is_main:  # before the first collective: no rank of this attempt has written anything yet
        retention.drop_uncommitted(run_dir)
    found = control.from_main(snapshot_steps.agreed(run_dir, snapshot_steps.committed(
        run_dir, wait_s=snapshot_steps.NAME_CACHE_S))
                              if env.is_main else None)  # manifests, decided on rank 0
    quiet: Callable[..., None] = lambda *args: None  # noqa: E731
    warn = log.warning if env.is_main else quiet
    unverified: list[str] = []
    while True:
        # every rank decides alike (and raises alike) from the same manifests and gathered verdicts
        choice = snapshot.choose(run_dir, verify=functools.partial(verify_spread, env), found=found,
                                 warn=warn, ranks_needed=ranks_needed and env.world_size)
        if choice is None and unverified:
            raise snapshot.SnapshotError(explain(
                f"no committed snapshot of {run_dir} verifies: {'; '.join(unverified)}",
                hint=f"restore the files from a backup, or move {run_dir / 'snapshots'} away to "
                "start the run over"))
        if choice is None:
            return None
        problem, loaded = None, None
        try:
            loaded = load(choice, env, groups, across=across, ranks_needed=ranks_needed)
        except snapshot.Unverified as err:
            problem = (str(err), True)
        except snapshot.SnapshotError as err:
            problem = (str(err), False)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
            # an RNG entry of the wrong shape
            problem = (f"the files of step {choice.step} in {choice.directory} do not hold what "
                       f"its manifest says ({err!r})", False)
        # every rank stops alike, none waits in a collective
        first = control.to_main_and_back(
            problem, merge=lambda problems: next((p for p in problems if p), None))
        # read, it did not verify: the step before (each byte was hashed as it was read)
        if first and first[1]:
            warn("committed snapshot step %d does not verify as it is read (%s); trying the one "
                 "before", choice.step, first[0])
            unverified.append(first[0])
            found = [(step, manifest) for step, manifest in (found or []) if step < choice.step]
            continue
        if first or loaded is None:
            raise snapshot.SnapshotError(first[0] if first else "a snapshot could not be loaded")
        break
    state, rng, read = loaded
    read_by = control.to_main((env.node_rank, read))
    summary = _read_summary(read_by, spread.state_bytes(state)) if read_by is not None else None
    written_by = choice.manifest.get("world_size")
    log.info("resuming from the snapshot of step %d in %s", choice.step, choice.directory)
    jit = choice.manifest.get("jit")
    return Restored(choice.step, state, rng, choice.manifest.get("config"),
                    written_by if isinstance(written_by, int) else None, summary,
                    jit.get("per_rank_stale") if isinstance(jit, dict) else None)


def verify_spread(env: DistEnv, directory: Path, manifest: dict[str, Any]) -> dict[str, str | None]:
    """Collective: each file checked by one rank (file k by rank k*W/F: with one rank per file, the
    writer's node), the verdicts gathered. Its size only, where the manifest has digests per slice:
    the readers hash what they read (:func:`hpc_ddp.rank.state.spread.load`); a file without them
    is hashed whole."""
    names, world = sorted(manifest.get("files", {})), env.world_size
    # format 1: read_state reads whole copies, verified before
    deep = manifest.get("layout") is None
    mine = {name: snapshot_verify.file_problem(directory, name, e if isinstance(
                e := manifest["files"][name], dict) else {}, deep=deep)
            for k, name in enumerate(names) if k * world // len(names) == env.rank}
    return control.to_main_and_back(
        mine, merge=lambda parts: {n: why for p in parts for n, why in p.items()})


def load(choice: snapshot.Choice, env: DistEnv, groups: Callable[[], spread.Groups], *,
         across: bool, ranks_needed: bool) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
    """(the replicated state, this rank's RNG state or None, the tensor bytes this rank read from
    files) from the chosen step's good files: read by the nodes' first ranks, spread over the nodes
    (``snapshot.load=spread``: ``across``) or every slice by every node (``every_node``),
    collective; a format-1 snapshot (whole copies) on every rank."""
    manifest = choice.manifest
    if manifest.get("layout") is not None:
        same = manifest.get("world_size") == env.world_size
        loaded = spread.load(choice, env, groups(), across=across,
                             rng_needed=bool(ranks_needed and same))
        if loaded.rng_unusable:
            log.warning("snapshot file %s (this rank's RNG state) is not usable; taking the "
                        "replicated state from the copies that verify and reseeding this rank's "
                        "RNG deterministically", loaded.rng_unusable)
        return loaded.state, loaded.rng, loaded.read
    same_world = manifest.get("world_size") == env.world_size
    holder = slicing.rank_file(manifest, env.rank) if same_world else None
    if holder is not None and holder not in choice.good_files:
        log.warning("snapshot file %s (this rank's RNG state) is not usable; taking the state from "
                    "%s and reseeding this rank's RNG deterministically", holder,
                    ", ".join(sorted(set(choice.sources.values()))))
        holder = None
    state, files = snapshot.read_state(choice, also=holder)
    return state, files[holder]["rng"].get(env.rank) if holder else None, spread.state_bytes(state)
