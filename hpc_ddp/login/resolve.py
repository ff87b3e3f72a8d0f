"""The command line's configs: YAML files and ``key=value`` items resolved into run configs, one per
sweep point, with what differs from an earlier run's config said; and the command that resumes them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout
from hpc_ddp.core.config import RunConfig, load_config
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.profiles import Profiles
from hpc_ddp.login.profiles import load_with_profile, recorded_profile


def split_items(items: list[str]) -> tuple[list[str], list[str]]:
    """Config files (``*.yaml``/``*.yml``, or a run dir: its config.yaml) and ``key=value``
    overrides, each in the given order."""
    def as_path(item: str) -> str | None:
        if "=" in item:
            return None
        if item.endswith((".yaml", ".yml")):
            return item
        return str(layout.config(item)) if layout.config(item).is_file() else None

    found = [(item, as_path(item)) for item in items]
    return [p for _, p in found if p], [item for item, p in found if p is None]


def resolve(paths: list[str], overrides: list[str] | tuple[str, ...], label: str = "",
            resume: bool = False) -> RunConfig:
    """The run's config. With ``resume``, the run's own config.yaml (its earlier overrides included)
    with only this command line's ``overrides`` on top: the CONFIG file serves to find the run
    dir."""
    profiles = Profiles.from_environ(os.environ)
    cfg = load_with_profile(paths, list(overrides), profiles, resume, label)
    run_dir = Path(cfg.run_dir).expanduser().resolve()  # workers may start elsewhere
    absolute = str(run_dir / label if label else run_dir)
    # a ${run_dir} in another key (train.args) means this absolute dir too, at submit
    if absolute != cfg.run_dir:
        # as at --resume (the run's config.yaml holds it)
        overrides = [*overrides, f"run_dir={absolute}"]
        if _holds_run_dir(cfg):
            cfg = load_with_profile(paths, list(overrides), profiles, resume, label)
    cfg.run_dir = absolute
    saved = layout.config(cfg.run_dir)
    if resume and saved.is_file():
        from hpc_ddp.core.config.diff import flat_values

        named = {item.split("=", 1)[0].lstrip("+~") for item in overrides} - {"profile"}
        # the run's config holds its profile's values: a profile named now is compared, not merged
        try:
            own = load_config([saved], [o for o in overrides
                                        if not o.startswith(("run_dir=", "profile="))])
        except HpcDdpError as err:
            raise HpcDdpError(f"--resume reads the run's own config, {saved}, and it cannot be "
                              f"used: {err}",
                              key="run_dir") from None
        cfg = recorded_profile(cfg, own, paths, overrides, profiles)
        _note_file_differences(paths + ([f"profile {cfg.profile}"] if cfg.profile else []),
                               flat_values(cfg),
                               flat_values(own), named)
        own.run_dir = cfg.run_dir
        return own
    return cfg


def _holds_run_dir(cfg: RunConfig) -> bool:
    """Whether a value besides ``run_dir`` holds the run dir's text as loaded (a ``${run_dir}`` in
    train.args, say): only then is the config loaded again with the absolute dir, which costs a
    whole merge (benchmark B1). A value that interpolates run_dir holds its text (hpc_ddp registers
    no resolver that could rewrite it), so a config without it loads the same either way."""
    relative = cfg.run_dir

    def holds(value: Any) -> bool:
        if dataclasses.is_dataclass(value):
            return any(holds(getattr(value, f.name)) for f in dataclasses.fields(value)
                       if f.name != "run_dir" or value is not cfg)
        if isinstance(value, dict):
            return any(holds(k) or holds(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(holds(item) for item in value)
        return isinstance(value, str) and relative in value

    return holds(cfg)


def _note_file_differences(paths: list[str], from_file: dict[str, Any], own: dict[str, Any],
                           named: set[str]) -> None:
    """Say which keys the CONFIG file now sets otherwise than the run: --resume keeps the run's
    values."""
    from hpc_ddp.core.config.diff import config_diff, describe_diff

    ignored = [d for d in config_diff(own, from_file) if d[0] not in named and d[0] != "run_dir"]
    if ignored and paths:
        print(f"--resume continues the run with its own config; {', '.join(map(str, paths))} "
              "differs in "
              f"{describe_diff(ignored)}, which is not applied (name a key on the command line to "
              "change it)",
              flush=True)


def resolve_all(items: list[str], multirun: bool, resume: bool = False) -> list[RunConfig]:
    """The run's config, or with ``multirun`` one config per combination (each in
    RUN_DIR/<label>)."""
    paths, overrides = split_items(items)
    if not multirun:
        return [resolve(paths, overrides, resume=resume)]
    from hpc_ddp.login.sweep import expand

    return [resolve(paths, combo.overrides, combo.label, resume) for combo in expand(overrides)]


def resume_command(items: list[str], multirun: bool) -> str:
    """The command that continues this rehearsal (printed after Ctrl-C)."""
    return shlex.join(["python", "-m", "hpc_ddp.submit", *items, "--local", "--resume",
                       *(["--multirun"] if multirun else [])])


def found_from(cfg: RunConfig) -> str:
    """Where the job finds its program: relative to the WORKDIR line."""
    train = cfg.train
    if train.script:
        return f"where train.script={train.script} is found"
    key, value = ("train.loop", train.loop) if train.loop else ("train.task", train.task)
    return f"where {key}={value} is imported from"
