"""A finished run's end on a rank: the last write drained, the final snapshot, model.pt, DONE.

:func:`finish_run` is what :meth:`hpc_ddp.rank.loop.run.Run.finish` does after the last agreement
is drained: every rank takes part (the final snapshot is collective), rank 0 writes model.pt, and
the record (step, world size, params_sha256, the program's result) goes back to the session, which
writes DONE.json after the ledger's finished line. Apart from the run API, which calls it once; it
reads the run through :class:`Finishing`, so it does not import the run API back. It logs as the
run (``hpc_ddp.run``).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rank.group import control
from hpc_ddp.rank.loop.step_state import Capturing, checked_state
from hpc_ddp.rank.state.checkpointer import Checkpointer
from hpc_ddp.rank.state.replication import params_sha256
from hpc_ddp.rank.state.tracked import unwrap
from hpc_ddp.rundir import layout

log = logging.getLogger("hpc_ddp.run")
UPDATED_PAST = ("no final snapshot: the optimizer stepped after the last run.boundary(%d), so a "
                "snapshot of that step would hold a later state; training this run longer goes on "
                "from its newest snapshot")


class Finishing(Capturing, Protocol):
    """What the end reads of the run (a :class:`hpc_ddp.rank.loop.run.Run`)."""

    checkpointer: Checkpointer | None
    run_dir: Path
    step: int
    boundaries: int

    @property
    def is_main(self) -> bool: ...

    def model(self) -> torch.nn.Module | None: ...


def finish_run(run: Finishing, result: Mapping[str, object]) -> dict[str, Any]:
    """Collective: any async write drained, the final snapshot, the mirror closed; rank 0 writes
    model.pt. Returns the DONE record: the step, ``result``, the world size, params_sha256."""
    if run.checkpointer is not None:
        run.checkpointer.finish_async()  # never leave a background write behind
        final_snapshot(run, run.checkpointer)
    if run.mirror is not None:
        run.mirror.close()  # nothing in flight when the process group goes
    model = run.model()
    done: dict[str, Any] = {"step": run.step, **result, "world_size": run.world_size}
    if model is not None:
        done["params_sha256"] = params_sha256(model)
    if run.is_main:
        if model is not None:
            buffer = io.BytesIO()
            torch.save(unwrap(model).state_dict(), buffer)
            write_atomic(layout.model(run.run_dir), buffer.getbuffer())
        sha = f", params_sha256 {done['params_sha256'][:16]}" if "params_sha256" in done else ""
        log.info("done: step %d%s", run.step, sha)
    return done


def final_snapshot(run: Finishing, ckpt: Checkpointer) -> None:
    """Collective: the finished step committed, unless it already is.

    A finished run trained longer (``--resume train.max_steps=...``) goes on from where it
    finished, not from an older snapshot, or from step 0 when no periodic one came (a run shorter
    than snapshot.every_minutes). Not when the loop made no boundary in this attempt, or updated
    past its last one (a snapshot labelled with that step would hold a later state): every rank
    decides alike."""
    if ckpt.last_step == run.step or not run.boundaries:
        return
    if control.to_main_and_back(bool(run.held is not None and run.held.updates), merge=any):
        log.warning(UPDATED_PAST, run.step)
        return
    state, rng = checked_state(run, run.step)
    ckpt.save(run.step, state, rng)
