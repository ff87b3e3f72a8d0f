"""What changed between two configs: every leaf of a config flattened, and the keys that differ.

A snapshot manifest records :func:`flat_values` of the config that wrote it; a resume compares
it with the new config's (:func:`config_diff`, :func:`describe_diff`) to say what changed. Apart
from :mod:`hpc_ddp.core.config` because it is no part of loading a config: it reads a loaded one,
needs no omegaconf, and its rules (which leaves a diff leaves out) are about old snapshots, not
the schema. These names are importable from :mod:`hpc_ddp.core.config` too, where they always were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from hpc_ddp.core.config.env import masked
from hpc_ddp.core.config.schema import RunConfig
from hpc_ddp.core.user_settings import user_leaves

__all__ = ["config_diff", "describe_diff", "flat_values"]


def flat_values(cfg: RunConfig) -> dict[str, Any]:
    """Every leaf as ``{"train.lr": 0.1, ...}`` in JSON terms (lists and dicts are leaves, but the
    user section's keys each are one, ``user.eval_every``, so a diff names them): what a snapshot
    manifest records of the config that wrote it. A text value from ``${oc.env:VAR}`` reads as that
    text."""
    import json

    cfg = masked(cfg)

    def walk(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if prefix == "slurm.container." and not value.runtime:
            return  # none: as a config from before containers: an older snapshot's shows no change
        if dataclasses.is_dataclass(value):
            for item in dataclasses.fields(value):
                yield from walk(getattr(value, item.name), f"{prefix}{item.name}.")
        elif prefix == "user.":
            yield from user_leaves(value)
        elif prefix == "run_dir_mode." and value == "0700":
            return  # the default: as a config from before the key; an older snapshot's: no change
        elif prefix == "profile." and not value:
            return  # none: as a config from before profiles: an older snapshot's shows no change
        else:
            yield prefix[:-1], value
    return json.loads(json.dumps(dict(walk(cfg, ""))))


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every key of two :func:`flat_values` that differs."""
    return [(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)]


def describe_diff(diff: list[tuple[str, Any, Any]]) -> str:
    """``train.lr: 0.1 -> 0.01, train.max_steps: 100 -> 200``."""
    return ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diff)
