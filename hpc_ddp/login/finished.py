"""``--resume`` of a finished run: train it longer, or refuse to take an allocation for nothing.

A run that wrote ``DONE.json`` is over; a requeued job that finds it exits at once. A user who
wants more steps resumes it with a larger ``train.max_steps`` (or ``train.epochs``; for a
``train.script``, other ``train.args``): the final ``DONE.json`` and ``model.pt`` are set
aside as ``DONE-step-N.json`` and ``model-step-N.pt`` (nothing is lost), and the job continues
from the newest snapshot with the ledger, metrics and TensorBoard going on. A run stops at
whichever of ``train.max_steps`` and ``train.epochs`` comes first, so a ``--resume`` after which
either still ends it at the finished step would train nothing: refused on the login node, with
the key to raise and a value for it. Login node: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout
from hpc_ddp.core.config import RunConfig, flat_values, load_config
from hpc_ddp.core.errors import HpcDdpError, explain


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def limits_reached(cfg: RunConfig, done: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """The keys that would end a resumed run at the step it finished (``done``: DONE.json; ``before``: the
    finished run's config, flat). A run stops at whichever of train.max_steps and train.epochs comes first,
    so raising one while the other is still reached trains nothing. [] when the run would train on."""
    train, step, epoch = cfg.train, done.get("step"), done.get("epoch")
    if train.max_steps is None and train.epochs is None:
        return ["train.max_steps"]  # nothing says how far: nothing more would be trained
    reached = []
    if train.max_steps is not None and not (isinstance(step, int) and train.max_steps > step):
        reached.append("train.max_steps")
    if train.epochs is not None:
        last = epoch if isinstance(epoch, int) else before.get("train.epochs") or 0  # own loops write no epoch
        if train.epochs <= last:
            reached.append("train.epochs")
    return reached


def nothing_to_train(cfg: RunConfig, done: dict[str, Any], before: dict[str, Any]) -> str | None:
    """Why resuming ``cfg`` after a finish recorded in ``done`` (with config ``before``, flat) trains nothing."""
    train = cfg.train
    if train.script:
        if [train.args, train.resume_args] != [before.get("train.args"), before.get("train.resume_args")]:
            return None
        return explain(f"--resume: train.script {train.script} already ran to its end (exit 0, DONE.json) with "
                       "these arguments, so the job would do nothing", hint="give it other train.args (e.g. more "
                       "epochs) to run it again, or start a new run with run_dir=...")
    reached = limits_reached(cfg, done, before)
    if not reached:
        return None
    step, epoch = done.get("step"), done.get("epoch")
    values = {"train.max_steps": train.max_steps, "train.epochs": train.epochs}
    raise_to = {"train.max_steps": 2 * step if isinstance(step, int) and step else "...",
                "train.epochs": epoch + 1 if isinstance(epoch, int) else "..."}
    other = next((key for key in values if key not in reached and values[key] is not None), None)
    first = (f"; {other}={values[other]} would allow more, but the run stops at whichever of train.max_steps "
             "and train.epochs comes first" if other else "")
    return explain(f"--resume: the run finished at step {step} (DONE.json) and "
                   f"{' and '.join(f'{key}={values[key]}' for key in reached)} would end it there again, so it "
                   f"would train nothing more{first}",
                   hint=f"raise {' and '.join(reached)} on this command line to train it longer (--resume "
                   f"{' '.join(f'{key}={raise_to[key]}' for key in reached)}), or start a new run with run_dir=...")


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
    """Move DONE.json (and model.pt) of a finished run to names with its step: the run goes on, nothing is lost."""
    done = layout.done(run_dir)
    if not done.exists():
        return None
    step = _read(done).get("step")
    suffix = f"step-{step}" if isinstance(step, int) else "finished"
    kept = done.with_name(f"DONE-{suffix}.json")
    model = layout.model(run_dir)
    if model.exists():
        model.replace(model.with_name(f"model-{suffix}.pt"))
    done.replace(kept)  # last: a crash in between leaves DONE.json, and the run still reads as finished
    return kept
