"""``--resume`` of a finished run: train it longer, or refuse to take an allocation for nothing.

A run that wrote ``DONE.json`` is over; a requeued job that finds it exits at once. A user who wants
more steps resumes it with a larger ``train.max_steps`` (or ``train.epochs``; for a
``train.script``, other ``train.args``): the final ``DONE.json`` and ``model.pt`` are set aside as
``DONE-step-N.json`` and ``model-step-N.pt`` (a script's, which has no step:
``DONE-finished-N.json``, N = 1, 2, ...; nothing is lost), and the job continues from the newest
snapshot (the finish commits one of its step) with the ledger, metrics and TensorBoard going on. A
run stops at whichever of ``train.max_steps`` and ``train.epochs`` comes first, so a ``--resume``
after which either still ends it at the finished step would train nothing: refused on the login
node, with the key to raise and a value for it. Login node: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout
from hpc_ddp.core.config import RunConfig, load_config
from hpc_ddp.core.config.diff import flat_values
from hpc_ddp.core.errors import HpcDdpError, explain


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def limits_reached(cfg: RunConfig, done: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """The keys that would end a resumed run at the step it finished (``done``: DONE.json;
    ``before``: the finished run's config, flat). A run stops at whichever of train.max_steps and
    train.epochs comes first, so raising one while the other is still reached trains nothing. []
    when the run would train on."""
    train, step, epoch = cfg.train, done.get("step"), done.get("epoch")
    if train.max_steps is None and train.epochs is None:
        return ["train.max_steps"]  # nothing says how far: nothing more would be trained
    reached = []
    if train.max_steps is not None and not (isinstance(step, int) and train.max_steps > step):
        reached.append("train.max_steps")
    if train.epochs is not None:
        # own loops write no epoch
        last = epoch if isinstance(epoch, int) else before.get("train.epochs") or 0
        if train.epochs <= last:
            reached.append("train.epochs")
    return reached


def nothing_to_train(cfg: RunConfig, done: dict[str, Any], before: dict[str, Any]) -> str | None:
    """Why resuming ``cfg`` after a finish recorded in ``done`` (with config ``before``, flat)
    trains nothing."""
    train = cfg.train
    if train.script:
        if [train.args, train.resume_args] != [before.get("train.args"),
                                               before.get("train.resume_args")]:
            return None
        return explain(f"--resume: train.script {train.script} already ran to its end (exit 0, "
                       "DONE.json) with "
                       "these arguments, so the job would do nothing",
                       hint="give it other train.args (e.g. more "
                       "epochs) to run it again, or start a new run with run_dir=...")
    reached = limits_reached(cfg, done, before)
    if not reached:
        return None
    step, epoch = done.get("step"), done.get("epoch")
    values = {"train.max_steps": train.max_steps, "train.epochs": train.epochs}
    raise_to = {"train.max_steps": 2 * step if isinstance(step, int) and step else "...",
                "train.epochs": epoch + 1 if isinstance(epoch, int) else "..."}
    other = next((key for key in values if key not in reached and values[key] is not None), None)
    first = (f"; {other}={values[other]} would allow more, but the run stops at whichever of "
             "train.max_steps "
             "and train.epochs comes first" if other else "")
    return explain(f"--resume: the run finished at step {step} (DONE.json) and "
                   f"{' and '.join(f'{key}={values[key]}' for key in reached)} would end it there "
                   "again, so it "
                   f"would train nothing more{first}",
                   hint=f"raise {' and '.join(reached)} on this command line to train it longer "
                        "(--resume "
                   f"{' '.join(f'{key}={raise_to[key]}' for key in reached)}), or start a new run "
                   "with run_dir=...")


def check(cfg: RunConfig) -> None:
    """Refuse a --resume of a finished run that would train nothing (before anything is written)."""
    run_dir = Path(cfg.run_dir)
    if not layout.done(run_dir).exists():
        return
    try:
        before = flat_values(load_config([layout.config(run_dir)]))
    except HpcDdpError:
        before = {}
    done = _read(layout.done(run_dir))
    problem = nothing_to_train(cfg, done, before)
    if problem:
        key = "train.args" if cfg.train.script else limits_reached(cfg, done, before)[0]
        raise HpcDdpError(problem, key=key)


def set_aside(run_dir: Path) -> Path | None:
    """Move DONE.json (and model.pt) of a finished run to names with its step: the run goes on,
    nothing is lost."""
    kept = done_step(run_dir)
    if kept is None:
        return None
    model = layout.model(run_dir)
    if model.exists():
        model.replace(_kept_model(run_dir, kept))
    # last: a crash in between leaves DONE.json, and the run still reads as finished
    layout.done(run_dir).replace(kept)
    return kept


def done_step(run_dir: Path) -> Path | None:
    """Where :func:`set_aside` would keep this run's DONE.json, or None when the run has not
    finished."""
    done = layout.done(run_dir)
    if not done.exists():
        return None
    step = _read(done).get("step")
    if isinstance(step, int):
        return done.with_name(f"DONE-step-{step}.json")
    # no step (a train.script run's DONE.json): numbered, so that a second finish does not replace
    # the first
    return next(kept for n in range(1, 10_000)
                if not (kept := done.with_name(f"DONE-finished-{n}.json")).exists())


def put_back(run_dir: Path, kept: Path) -> None:
    """Undo :func:`set_aside` when the job that would have trained the run longer was never queued
    (sbatch refused it): the run reads as finished again, as it did before the command."""
    done = layout.done(run_dir)
    if done.exists() or not kept.exists():
        return
    model = _kept_model(run_dir, kept)
    if model.exists():
        model.replace(layout.model(run_dir))
    kept.replace(done)


def goes_on_from(run_dir: Path, kept: Path, script: str = "") -> str:
    """Where a finished run resumed longer goes on from, said before the job is queued. A run
    finished before the finish committed a snapshot of its step may have only an older one, or none:
    then steps are trained again and their metrics replaced, and the user should know before an
    allocation is spent on it. A ``script`` keeps its own checkpoint, which hpc_ddp neither writes
    nor reads."""
    from hpc_ddp.rundir.snapshot.steps import committed_steps  # manifests only: no torch

    if script:
        return (f"train.script {script} is started again with the new train.args and goes on from "
                "its own "
                "checkpoint, if it saves one (hpc_ddp keeps no snapshot, metrics or model of a "
                "script)")

    finished, steps = _read(kept).get("step"), committed_steps(run_dir)
    newest = steps[0] if steps else None
    if newest is not None and newest == finished:
        return f"it goes on from step {newest}, where it finished"
    if newest is None:
        return ("WARNING: it has no snapshot, so it starts again from step 0 and trains the "
                f"{finished} finished "
                "steps again (their rows in metrics.jsonl are replaced; the finished model is kept "
                "beside "
                "DONE.json)")
    return (f"WARNING: its newest snapshot is step {newest}, not the step it finished at "
            f"({finished}): steps "
            f"{newest + 1}-{finished} are trained again (their rows in metrics.jsonl are replaced)")


def _kept_model(run_dir: Path, kept: Path) -> Path:
    """model.pt's name beside a kept DONE-step-N.json (DONE-finished-N.json): model-step-N.pt
    (model-finished-N.pt)."""
    tag = kept.name.removeprefix("DONE-").removesuffix(".json")
    return layout.model(run_dir).with_name(f"model-{tag}.pt")
