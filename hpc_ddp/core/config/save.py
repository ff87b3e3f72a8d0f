"""Writing a loaded config: :func:`to_yaml` (what :func:`hpc_ddp.core.config.load.load_config` reads
back to an equal config) and :func:`save_config` (durably, into a run dir made with its mode).
Apart from the loading: a job writes its run's config.yaml once, every later reader only loads.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpc_ddp.core.config.env import unresolve
from hpc_ddp.core.config.schema import RunConfig
from hpc_ddp.core.errors import ConfigError, explain
from hpc_ddp.core.run_dir_mode import make_run_dir


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML that :func:`load_config` reads back to an equal config; a value from
    ``${oc.env:VAR}`` is written as that text (:mod:`hpc_ddp.core.config.env`), resolved again by
    each reader."""
    return OmegaConf.to_yaml(OmegaConf.create(unresolve(cfg, _escape(dataclasses.asdict(cfg)))))


def _escape(value: Any) -> Any:
    r"""Resolved text may hold a literal '${' (an escaped shell variable); keep it literal on
    reload. The backslashes right before it are doubled first: omegaconf reads ``\\${`` as a
    backslash and then an interpolation (a setup line ``echo \${X}`` failed to save)."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def save_config(cfg: RunConfig, path: str | os.PathLike[str]) -> Path:
    """Write the config durably (temp file, fsync, rename): never half a file. A run dir it creates
    is made with ``run_dir_mode`` (0700 by default), whatever the umask."""
    from hpc_ddp.core.atomic import write_atomic

    target = Path(path)
    try:
        make_run_dir(target.parent, cfg.run_dir_mode)
        write_atomic(target, to_yaml(cfg))
    except OSError as err:
        raise ConfigError(explain(f"cannot write {target}: {err.strerror}",
                                  found=str(target.parent),
                                  expected="a writable run dir",
                                  hint="set run_dir=... to a writable directory with free space (a "
                                  "read-only or full filesystem cannot hold snapshots either)"),
                          key="run_dir") from None
    return target
