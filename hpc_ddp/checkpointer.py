"""Who writes which snapshot file, when a snapshot is due, and restoring every rank.

Saving is collective: every rank's RNG state is gathered; local rank 0 of each
node writes that node's file (the replicated training state plus the RNG states
of its ranks); global rank 0 writes the manifest once every node's file is
durable, then prunes; a barrier ends the save. In async mode the step only
copies the state to CPU; a background thread writes, and the commit happens at
a later step boundary, once no node's writer is busy (at most one in flight). Restoring: rank 0 picks the
newest committed step that verifies and tells everyone; each rank loads its own
node's file, or another node's copy of the replicated state (then its RNG is
reseeded deterministically, with a warning). A snapshot written at another world
size loads too (any node's file holds the replicated state); no rank's RNG is
restored then, and the run object says what changed.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc_ddp import snapshot
from hpc_ddp.config import SnapshotConfig
from hpc_ddp.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.checkpointer")


def capture_rng() -> dict[str, Any]:
    """This rank's RNG states (Python, NumPy, torch CPU, CUDA where present) as plain values.

    Plain lists, not tensors: they travel through all_gather_object (which mishandles
    tensors in torch 2.13) and load under weights_only=True.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state().tolist(),
                             "numpy": (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def reseed(seed: int, step: int, rank: int) -> None:
    """A deterministic substitute when this rank's saved RNG state is lost."""
    value = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little")
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def _stage(value: Any, old: Any = None) -> Any:
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
        return {k: _stage(v, old.get(k) if isinstance(old, dict) else None) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        olds = old if isinstance(old, (list, tuple)) and len(old) == len(value) else [None] * len(value)
        return type(value)(_stage(v, o) for v, o in zip(value, olds))
    return value


@dataclass(frozen=True)
class Restored:
    step: int
    state: dict[str, Any]  # the replicated training state
    rng: dict[str, Any] | None  # this rank's RNG state; None when it had to come from another node
    config: dict[str, Any] | None = None  # the config that wrote it (flat_values), when the manifest has it
    world_size: int | None = None  # the world size that wrote it


class Checkpointer:
    """Snapshots of one run; build it inside the process group, on every rank."""

    def __init__(self, run_dir: Path, cfg: SnapshotConfig, env: DistEnv, config_hash: str,
                 clock: Callable[[], float] = time.monotonic, config: dict[str, Any] | None = None) -> None:
        self.run_dir, self.cfg, self.env, self.config_hash, self.clock = run_dir, cfg, env, config_hash, clock
        self.config = config  # recorded in every manifest
        self.last_time = clock()
        self.last_step: int | None = None
        self.pending: int | None = None  # an async snapshot written but not yet committed
        self._writer: threading.Thread | None = None
        self._written: dict[str, Any] | None = None
        self._failed: BaseException | None = None
        self._staging: Any = None  # CPU copy of the state for async writes, reused across snapshots

    def due_by_steps(self, step: int) -> bool:
        """every_steps: the same answer on every rank, so it needs no agreement."""
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def due_by_time(self) -> bool:
        """every_minutes, by this rank's clock; the trainer asks rank 0 and agrees on its answer."""
        return bool(self.cfg.every_minutes) and self.clock() - self.last_time >= self.cfg.every_minutes * 60

    def _payload(self, state: dict[str, Any], rng: dict[str, Any]) -> dict[str, Any] | None:
        """Collective: gather every rank's RNG; the node's writer gets its file's content."""
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, (self.env.node_rank, rng))
        if not self.env.is_node_main:
            return None
        mine = {rank: r for rank, (node, r) in enumerate(gathered) if node == self.env.node_rank}
        return {"replicated": state, "rng": mine}

    def _commit(self, step: int, entry: dict[str, Any] | None) -> None:
        """Collective: once every node's file is durable, rank 0 writes the manifest; then a barrier."""
        entries: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(entries, entry)
        failures = [e["error"] for e in entries if e and "error" in e]
        if failures:  # every rank raises the same error: none is left waiting in a collective
            raise snapshot.SnapshotError(f"snapshot of step {step} not committed: {failures[0]}")
        directory = snapshot.step_dir(self.run_dir, step)
        if self.env.is_main:
            snapshot.commit(directory, step, [e for e in entries if e], self.env.world_size, self.config_hash,
                            self.config)
            # Deleting an old step (~20 ms per 100 MB) need not hold the step up; prune uncommits first,
            # so a process that exits in the middle leaves an ignored leftover, never a broken commit.
            threading.Thread(target=snapshot.prune, args=(self.run_dir, self.cfg.keep_last), daemon=True,
                             name="snapshot-prune").start()
            log.info("snapshot of step %d committed in %s", step, directory)
        dist.barrier()
        self.last_step = step

    def save(self, step: int, state: dict[str, Any], rng: dict[str, Any]) -> None:
        """Collective and synchronous: returns once the step is committed."""
        if self.last_step == step:
            return  # already saved at this boundary (periodic and stop at once)
        payload = self._payload(state, rng)
        entry = None
        if payload is not None:
            try:
                entry = snapshot.write_node_file(snapshot.step_dir(self.run_dir, step), self.env.node_rank, payload)
            except snapshot.SnapshotError as err:
                entry = {"error": str(err)}
        self._commit(step, entry)
        self.last_time = self.clock()

    def save_async(self, step: int, state: dict[str, Any], rng: dict[str, Any]) -> None:
        """Collective: copy the state to CPU now; the node's writer writes it in a background thread.

        The step is blocked only for the copy, made by the node's writer alone into staging
        memory kept from the previous async snapshot (it is free again: this runs only when
        nothing is pending). :meth:`finish_async` commits it later, at a boundary where no
        writer is busy any more.
        """
        payload = self._payload(state, rng)
        self.pending = step
        self.last_time = self.clock()
        if payload is None:
            return
        payload["replicated"] = self._staging = _stage(payload["replicated"], self._staging)
        directory = snapshot.step_dir(self.run_dir, step)

        def write() -> None:
            try:
                self._written = snapshot.write_node_file(directory, self.env.node_rank, payload)
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
        self._commit(step, {"error": str(self._failed)} if self._failed is not None else self._written)

    def restore(self) -> Restored | None:
        """Collective: the newest usable committed snapshot, or None for a fresh start."""
        choice: list[Any] = [None]
        if self.env.is_main:
            try:
                choice[0] = snapshot.choose(self.run_dir)
            except snapshot.SnapshotError as err:
                choice[0] = str(err)  # every rank raises it, none waits in a collective
        dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], str):
            raise snapshot.SnapshotError(choice[0])
        found: snapshot.Choice | None = choice[0]
        if found is None:
            return None
        written_by = found.manifest.get("world_size")
        name, own = self._file_to_read(found, written_by)
        data = snapshot.load_file(found.directory / name)
        # At another world size no saved RNG state belongs to this rank any more: the Run reseeds it
        rng = data["rng"].get(self.env.rank) if own else None
        self.last_step, self.last_time = found.step, self.clock()
        log.info("resuming from the snapshot of step %d (%s)", found.step, name)
        return Restored(found.step, data["replicated"], rng, found.manifest.get("config"),
                        written_by if isinstance(written_by, int) else None)

    def _file_to_read(self, found: snapshot.Choice, written_by: Any) -> tuple[str, bool]:
        """(the file this rank loads, whether it holds this rank's RNG state).

        At the same world size, the file of the node that held this rank (its RNG is there; the
        nodes x tasks split may differ). At another one no RNG state belongs to this rank any
        more, and the nodes spread their reads over the good files: each holds the whole
        replicated state.
        """
        good, env = found.good_files, self.env
        nodes_before = found.manifest.get("num_nodes")
        if written_by == env.world_size and isinstance(nodes_before, int) and nodes_before > 0 \
                and env.world_size % nodes_before == 0:
            holder = snapshot.node_file_name(env.rank // (env.world_size // nodes_before))
            if holder in good:
                return holder, True
            fallback = good[env.rank % len(good)]
            log.warning("snapshot file %s (this rank's RNG state) is not usable; using %s for the replicated "
                        "state and reseeding this rank's RNG deterministically", holder, fallback)
            return fallback, False
        return good[env.node_rank % len(good)], False
