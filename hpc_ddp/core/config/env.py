"""``${oc.env:VAR}`` kept out of the run dir: a config value that comes from the environment is
written to ``config.yaml`` as the interpolation, never as its value, and each reader resolves it
again where it runs.

:func:`env_leaves` finds, in the merged and still unresolved config, every leaf whose value comes
from an environment variable, directly (``token: ${oc.env:TOKEN}``) or through another key (``args:
["${user.token}"]``).
:func:`remember` records them on the loaded config; :func:`unresolve` puts their text back into what
is written (``config.yaml``), and :func:`masked` into what is recorded of the config elsewhere
(snapshot manifests, TensorBoard's and W&B's hyperparameters): text values only, since a number (a
batch size) is read back as one. A value changed after loading (``cfg.run_dir = ...``) is written as
it now is. ``run_dir`` is written resolved: every reader on every node must find the same folder,
and submit prints it anyway.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

from omegaconf import OmegaConf

# on a loaded RunConfig: {path: (the text as written, the value it had when loaded)}
ATTR = "_from_env"
NOT_KEPT = ("run_dir",)
_ENV = re.compile(r"(?<!\\)\$\{\s*oc\.env\s*:")
_MARK = "@@hpc_ddp-from-the-environment@@"
Key = tuple[Any, ...]


def env_leaves(merged: Any) -> dict[Key, str]:
    """``{path: raw text}`` of every leaf of ``merged`` (an unresolved OmegaConf config) whose value
    comes from ``${oc.env:...}``; a path is a tuple of keys and list indices, ``("train", "args",
    1)``."""
    raw = OmegaConf.to_container(merged, resolve=False)
    texts = {path: value for path, value in _leaves(raw, ()) if isinstance(value, str)
             and path[0] not in NOT_KEPT}
    direct = {path for path, text in texts.items() if _ENV.search(text)}
    if not direct:
        return {}
    marked = copy.deepcopy(raw)
    for path in direct:
        _put(marked, path, _MARK)
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(marked), resolve=True)
    # a resolver that refuses the mark: keep every interpolation unresolved
    except Exception:  # noqa: BLE001
        return {path: text for path, text in texts.items() if "${" in text}
    return {path: text for path, text in texts.items()
            if path in direct or ("${" in text
                                  and _MARK in json.dumps(_get(resolved, path), default=str))}


def remember(cfg: Any, leaves: dict[Key, str]) -> None:
    """Record on ``cfg`` (just loaded) which of its values came from the environment, and their
    values now."""
    object.__setattr__(cfg, ATTR, {path: (text, _get(cfg, path)) for path, text in leaves.items()})


def unresolve(cfg: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (``cfg`` as a plain mapping, about to be written) with the environment's values as
    their ``${oc.env:...}`` text again."""
    for path, (text, value) in _kept(cfg).items():
        _put(data, path, text)
    return data


def masked(cfg: Any) -> Any:
    """A copy of ``cfg`` whose text values from the environment read as their ``${oc.env:...}``
    text."""
    kept = {path: text for path, (text, value) in _kept(cfg).items() if isinstance(value, str)}
    if not kept:
        return cfg
    twin = copy.deepcopy(cfg)
    for path, text in kept.items():
        _put(twin, path, text)
    return twin


def _kept(cfg: Any) -> dict[Key, tuple[str, Any]]:
    """The recorded leaves whose value is still the one loaded."""
    recorded: dict[Key, tuple[str, Any]] = getattr(cfg, ATTR, None) or {}
    return {path: entry for path, entry in recorded.items() if _get(cfg, path, _MARK) == entry[1]}


def _leaves(value: Any, path: Key) -> Any:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    else:
        yield path, value


def _get(value: Any, path: Key, missing: Any = None) -> Any:
    for key in path:
        try:
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = getattr(value, key)
            else:
                value = value[key]
        except (AttributeError, KeyError, IndexError, TypeError):
            return missing
    return value


def _put(value: Any, path: Key, item: Any) -> None:
    parent = _get(value, path[:-1])
    if dataclasses.is_dataclass(parent) and not isinstance(parent, type):
        setattr(parent, path[-1], item)
    elif parent is not None:
        parent[path[-1]] = item
