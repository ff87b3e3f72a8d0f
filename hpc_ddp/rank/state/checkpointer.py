"""Who writes which slice of a snapshot, when a snapshot is due, and the way in to restoring one.

Saving is collective. Each node's ranks hand their RNG states to the node's writer (its
local rank 0) in a gather within the node: no RNG state crosses the job. The writer
writes the node's file: its slices of the replicated state (:mod:`hpc_ddp.rundir.slicing`: about
``replicas / nodes`` of the bytes) and its ranks' RNG states. Global rank 0 writes the
manifest once every node's file is durable, then prunes; a barrier ends the save. The
writer's pieces reach host memory through :mod:`hpc_ddp.rank.state.pipeline` (a GPU's in
chunks, copied while the earlier chunks are written). In async mode the step only starts
those copies (and copies a CPU state's pieces); a background thread writes,
and the commit happens at a later step boundary, once no node's writer is busy (at most
one in flight).

:meth:`Checkpointer.restore` finds the newest committed step whose files verify and loads it
on every rank through :mod:`hpc_ddp.rank.state.snapshot_load`, which only reads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.rank.group import control
from hpc_ddp.rank.state import pipeline as pipeline_
from hpc_ddp.rank.state import snapshot_load, spread
from hpc_ddp.rank.state.snapshot_load import Restored, auto_load
from hpc_ddp.rank.group import tiers as tiers_
from hpc_ddp.rundir import retention, slicing, snapshot
from hpc_ddp.rundir.snapshot import write as snapshot_write
from hpc_ddp.core.config import SnapshotConfig
from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.checkpointer")
STEP = "step"  # the key of the step count in a snapshot's state, beside the tracked objects' names
PER_RANK = "per_rank"  # the key of a rank's per-rank states in its RNG entry of the snapshot


def stage(value: object, old: object = None) -> Any:
    """A CPU copy of every tensor in a (nested) state, so training may go on changing the originals.

    Copies into ``old``'s tensors where shapes and dtypes match: the staging memory of the
    previous async snapshot is reused, which spares the page faults of a fresh allocation
    (most of the copy's time on CPU, B3). Fresh buffers for CUDA tensors are pinned.
    """
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
            return old.copy_(value)
        buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)
        return buffer.copy_(value)
    if isinstance(value, dict):
        return {k: stage(v, old.get(k) if isinstance(old, dict) else None)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        olds = old if isinstance(old, (list,
                                       tuple)) and len(old) == len(value) else [None] * len(value)
        return type(value)(stage(v, o) for v, o in zip(value, olds))
    return value


def _commit_problem(entries: list[Any]) -> str | None:
    """Rank 0's verdict on the writers' entries: why the step must not be committed, or None."""
    written = [e for e in entries if e]
    failures = [e["error"] for e in written if "error" in e]
    # a bug, not a disk: never commit it
    if not failures and len({e["digest"] for e in written}) > 1:
        failures = ["the nodes split the state differently "
                    f"({sorted({e['digest'] for e in written})})"]
    # Slurm and torchrun both make rank 0 local rank 0 of node 0
    if not failures and entries[0] is None:
        failures = ["rank 0 is not its node's writer (local rank 0), so it has no layout to commit"]
    return failures[0] if failures else None


class Checkpointer:
    """Snapshots of one run; build it inside the process group, on every rank."""

    def __init__(self, run_dir: Path, cfg: SnapshotConfig, env: DistEnv, config_hash: str,
                 clock: Callable[[], float] = time.monotonic, config: dict[str, Any] | None = None,
                 local: bool = False) -> None:
        self.run_dir, self.cfg, self.env = run_dir, cfg, env
        self.config_hash, self.clock = config_hash, clock
        # every_rank: its name before issue 45
        load = "every_node" if cfg.load == "every_rank" else cfg.load
        self.load = load if load != "auto" else auto_load(local, env.num_nodes, cfg.replicas)
        self.config = config  # recorded in every manifest
        # why the run cannot resume at another world size (the Run says)
        self.refuses_resize: str | None = None
        # per_rank objects are tracked: a step whose file of a rank's state is bad is skipped
        self.ranks_needed = False
        self.last_time = clock()
        self.last_step: int | None = None
        self.pending: int | None = None  # an async snapshot written but not yet committed
        self._writer: threading.Thread | None = None
        self._written: dict[str, Any] | None = None
        self._failed: BaseException | None = None
        # the node's pieces to host memory, in chunks overlapped with the write; its arena is reused
        # by every snapshot
        self.pipeline = pipeline_.Pipeline()
        # step -> its layout, until committed (rank 0's goes in)
        self._layouts: dict[int, dict[str, Any]] = {}
        # this node's ranks and the nodes' leaders (made once)
        self._groups: spread.Groups | None = None
        # the commit's two levels over them (False: one level)
        self._tiers: tiers_.Tiers | bool | None = None

    def due_by_steps(self, step: int) -> bool:
        """every_steps: the same answer on every rank, so it needs no agreement."""
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def due_by_time(self) -> bool:
        """every_minutes, by this rank's clock; the trainer asks rank 0 and agrees on its answer."""
        return (bool(self.cfg.every_minutes)
                and self.clock() - self.last_time >= self.cfg.every_minutes * 60)

    def _gather_rng(self, rng: dict[str, Any]) -> dict[int, Any] | None:
        """Collective within each node: the node's writer gets {rank: RNG state} of its ranks;
        others None."""
        env = self.env
        if env.world_size == env.num_nodes:  # one rank per node: it is its own writer
            return {env.rank: rng}
        groups = self.groups()
        gathered = control.gather_within((env.rank, rng), groups.leader, len(groups.node),
                                         groups.within)
        return dict(gathered) if gathered is not None else None

    def tiers(self) -> tiers_.Tiers | None:
        """Collective, once: the commit's two levels (the nodes' writers to rank 0, the verdict back
        through them,
        :mod:`hpc_ddp.rank.group.tiers`); None for one rank, or where rank 0 is not node 0's writer
        (then one level)."""
        if self._tiers is None and self.env.world_size > 1:
            groups = self.groups()
            self._tiers = tiers_.Tiers(groups, self.env) if groups.leaders[0] == 0 else False
        return self._tiers or None

    def groups(self) -> spread.Groups:
        """Collective, once: this node's ranks and the nodes' leaders, with their gloo groups (the
        RNG gather within a node, the spread read's two levels)."""
        if self._groups is None:
            self._groups = spread.Groups.of(self.env)
        return self._groups

    def _payload(self, state: dict[str, Any], rng: dict[str, Any],
                 staged: bool = False) -> dict[str, Any] | None:
        """Collective: the node's writer gets its file's content (its slices, its ranks' RNG);
        others None.

        The slices' pieces go through the pipeline (:mod:`hpc_ddp.rank.state.pipeline`): a device's
        are copied to the host in chunks, started here and waited for by the write. ``staged``
        (async): the CPU pieces are copied too, here, into the arena the previous snapshot used (it
        is free again: async saves run only when nothing is pending).
        """
        rngs = self._gather_rng(rng)
        if rngs is None:
            return None
        content, split, held = slicing.node_content(state, self.env.node_rank, self.env.num_nodes,
                                                    self.cfg.replicas,
                                                    rngs, copy=False)
        pieces = self.pipeline.stage(content["pieces"], copy_host=staged)
        content["pieces"] = pieces.pieces
        return {"content": content, "layout": split, "slices": held, "ranks": sorted(rngs),
                "staged": pieces}

    def _write(self, step: int, payload: dict[str, Any]) -> dict[str, Any]:
        """This node's file; its manifest entry (the layout's digest: the commit checks all writers
        agree). The staged pieces' memory is released whatever happens (every copy waited for
        first)."""
        staged: pipeline_.Staged = payload["staged"]
        try:
            entry = snapshot_write.write_node_file(snapshot.step_dir(self.run_dir, step),
                                                   self.env.node_rank,
                                             payload["content"], split=payload["layout"],
                                             ready=staged.ready if staged.copying else None)
        except BaseException:
            with contextlib.suppress(Exception):
                staged.release()
            raise
        staged.release()
        return {**entry, "slices": payload["slices"], "ranks": payload["ranks"],
                "digest": slicing.layout_digest(payload["layout"])}

    def _commit(self, step: int, entry: dict[str, Any] | None) -> None:
        """Collective: once every node's file is durable, rank 0 writes the manifest; then a
        barrier.

        The entries go to rank 0 alone, and rank 0 sends back one verdict: a non-zero rank sends
        and receives one small object, however many ranks there are."""
        tiers = self.tiers()
        # the writers' entries
        entries = control.to_main(entry) if tiers is None else tiers.leaders_to_main(entry)
        problem = _commit_problem(entries) if entries is not None else None
        verdict = control.from_main(problem) if tiers is None else tiers.from_main(problem)
        if verdict:  # every rank raises the same error: none is left waiting in a collective
            raise snapshot.SnapshotError(f"snapshot of step {step} not committed: {verdict}")
        directory, split = snapshot.step_dir(self.run_dir, step), self._layouts.pop(step, None)
        if entries is not None:
            written = [e for e in entries if e]
            snapshot.commit(directory, step, written, self.env.world_size, self.config_hash,
                            self.config, split=split,
                            refuses_resize=self.refuses_resize)
            # Deleting an old step (~20 ms per 100 MB) need not hold the step up; prune uncommits
            # first, so a process that exits in the middle leaves an ignored leftover, never a
            # broken commit.
            threading.Thread(target=retention.prune, args=(self.run_dir, self.cfg.keep_last),
                             daemon=True,
                             name="snapshot-prune").start()
            log.info("snapshot of step %d committed in %s", step, directory)
        control.barrier() if tiers is None else tiers.barrier()
        self.last_step = step

    def save(self, step: int, state: dict[str, Any], rng: dict[str, Any]) -> None:
        """Collective and synchronous: returns once the step is committed."""
        if self.last_step == step:
            return  # already saved at this boundary (periodic and stop at once)
        payload = self._payload(state, rng)
        entry = None
        if payload is not None:
            self._layouts[step] = payload["layout"]
            try:
                entry = self._write(step, payload)
            except snapshot.SnapshotError as err:
                entry = {"error": str(err)}
        self._commit(step, entry)
        self.last_time = self.clock()

    def save_async(self, step: int, state: dict[str, Any], rng: dict[str, Any]) -> None:
        """Collective: copy this node's slices to CPU now; its writer writes them in a background
        thread.

        The step is blocked only for the copy, made by the node's writer alone.
        :meth:`finish_async` commits it later, at a boundary where no writer is busy any more.
        """
        payload = self._payload(state, rng, staged=True)
        self.pending = step
        self.last_time = self.clock()
        if payload is None:
            return
        self._layouts[step] = payload["layout"]

        def write() -> None:
            try:
                self._written = self._write(step, payload)
            except BaseException as err:  # re-raised on the training thread by finish_async
                self._failed = err

        self._written, self._failed = None, None
        self._writer = threading.Thread(target=write, name=f"snapshot-{step}", daemon=True)
        self._writer.start()

    @property
    def busy(self) -> bool:
        """This rank's background write is still running."""
        return self._writer is not None and self._writer.is_alive()

    def finish_async(self) -> None:
        """Collective: wait for this node's write, then commit the pending step."""
        if self.pending is None:
            return
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        step, self.pending = self.pending, None
        self._commit(step, {"error": str(self._failed)} if self._failed is not None
                     else self._written)

    def restore(self) -> Restored | None:
        """Collective: the newest committed snapshot whose every slice verifies, or None for a fresh
        start.

        Found and loaded by :func:`hpc_ddp.rank.state.snapshot_load.restore`."""
        restored = snapshot_load.restore(self.run_dir, self.env, self.groups,
                                         across=self.load == "spread",
                                         ranks_needed=self.ranks_needed)
        if restored is not None:
            self.last_step, self.last_time = restored.step, self.clock()
        return restored
