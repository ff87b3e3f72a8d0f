"""``--multirun`` sweeps: ``key=a,b`` overrides expanded into one run per combination (pure).

Each combination becomes one element of a Slurm job array with its own run dir
(``RUN_DIR/<label>``), so its snapshots, ledger and requeues are its own; the
rendezvous port and ``scontrol requeue`` already key on the array task
(:func:`hpc_ddp.core.slurm_env.master_port`, :func:`hpc_ddp.core.slurm_jobs.job_spec`).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from hpc_ddp.core.errors import ConfigError, explain

# The elements of one array share one allocation request, and each needs its own run dir.
FIXED_PREFIXES = ("slurm.", "name", "run_dir")


@dataclass(frozen=True)
class Combination:
    """One run of a sweep: its overrides and a label for its run dir."""

    overrides: tuple[str, ...]
    label: str


def split_top_level(value: str) -> list[str]:
    """Split at commas outside brackets, braces and quotes: ``1,[2,3]`` -> ``['1', '[2,3]']``."""
    parts, depth, quote, current = [], 0, "", []
    for char in value:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def _axis(override: str) -> tuple[str, list[str]]:
    key, sep, value = override.partition("=")
    if not sep:
        raise ConfigError(explain(f"override {override!r} has no '='",
                                  expected="KEY=VALUE or KEY=V1,V2",
                                  hint="e.g. train.lr=0.1,0.01"), key=override)
    values = split_top_level(value)
    if len(values) > 1 and key.startswith(FIXED_PREFIXES):
        raise ConfigError(explain(f"--multirun cannot vary {key}", found=value,
                                  expected="slurm.*, name and run_dir fixed across the sweep (one "
                                           "job array "
                                  "asks for one allocation shape; each run gets RUN_DIR/<label>)",
                                  hint="submit one sweep per Slurm setting"), key=key)
    if any(not v.strip() for v in values):
        raise ConfigError(explain(f"{key} has an empty sweep value", found=value,
                                  expected="V1,V2,...",
                                  hint="remove the stray comma"), key=key)
    return key, values


def label_of(pairs: list[tuple[str, str]]) -> str:
    """A directory name for one combination: ``lr=0.1,seed=1`` (last key segment, unsafe chars ->
    _)."""
    return ",".join(f"{key.rsplit('.', 1)[-1]}={re.sub(r'[^A-Za-z0-9._+-]', '_', value)}"
                    for key, value in pairs)


def expand(overrides: list[str]) -> list[Combination]:
    """Every combination of the swept overrides (cartesian product, in the order given).

    Overrides with one value apply to every run; a sweep with no comma-separated
    value is an error, since it would submit a one-element array by mistake.
    """
    axes = [_axis(o) for o in overrides]
    swept = [(key, values) for key, values in axes if len(values) > 1]
    if not swept:
        raise ConfigError(explain("--multirun found nothing to sweep", found=" ".join(overrides)
                                  or "no overrides",
                                  expected="at least one KEY=V1,V2 override",
                                  hint="e.g. --multirun train.lr=0.1,0.01; drop --multirun for a "
                                       "single run"),
                          key="--multirun")
    fixed = [o for o, (_, values) in zip(overrides, axes) if len(values) == 1]
    combos = []
    for choice in itertools.product(*(values for _, values in swept)):
        pairs = [(key, value) for (key, _), value in zip(swept, choice)]
        combos.append(Combination(tuple(fixed + [f"{k}={v}" for k, v in pairs]), label_of(pairs)))
    labels = [c.label for c in combos]
    if len(set(labels)) != len(labels):
        raise ConfigError(explain("two sweep values give the same run dir name",
                                  found=", ".join(labels),
                                  expected="values that differ after replacing unsafe characters "
                                           "with _",
                                  hint="write the values differently"), key="--multirun")
    return combos
