"""The config's ``user:`` section: the user's own settings, free-form, carried with the run.

hpc_ddp reads nothing in it. It is merged and overridden like every other section
(``user.eval_every=100`` on the command line, new keys too), written to the run's
config.yaml, compared by ``--resume``, and handed to the program:

- an own loop reads ``run.config.user`` as a mapping or by attribute
  (``run.config.user["eval_every"]``, ``run.config.user.eval_every``; nested sections alike);
- a ``train.script`` gets one environment variable per leaf: ``HPC_DDP_USER_`` + the key path joined
  with ``_``, upper-cased, any other character than a letter or digit made ``_``
  (``user.eval.every`` -> ``HPC_DDP_USER_EVAL_EVERY``). Text is passed as it is, every other value
  as JSON (``true``, ``0.5``, ``[1, 2]``, ``null``); ``HPC_DDP_USER`` holds the whole section as
  JSON. For a command-line argument, interpolate: ``train.args: [--eval_every,
  "${user.eval_every}"]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

PREFIX = "HPC_DDP_USER"
_NOT_WORD = re.compile(r"[^A-Za-z0-9]")


class UserSettings(dict):  # type: ignore[type-arg]
    """A mapping whose keys also read as attributes (``user.eval_every``), nested sections too.

    A plain ``dict`` subclass, so it is JSON, YAML and pickle as a dict is, and compares equal to
    one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for key, value in self.items():
            if isinstance(value, Mapping) and not isinstance(value, UserSettings):
                super().__setitem__(key, UserSettings(value))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            keys = ", ".join(map(str, self)) or "none"
            raise AttributeError(f"the user section has no key {name!r} (its keys: {keys}); set it "
                                 "in the config "
                                 f"(user: {{{name}: ...}}) or on the command line "
                                 f"(user.{name}=...), or read it "
                                 f"with .get({name!r}, default)") from None


def user_leaves(user: Mapping[str, Any], prefix: str = "user") -> Iterator[tuple[str, Any]]:
    """``("user.eval.every", 100)`` for every leaf; lists are leaves, an empty section is none."""
    for key, value in user.items():
        if isinstance(value, Mapping):
            yield from user_leaves(value, f"{prefix}.{key}")
        else:
            yield f"{prefix}.{key}", value


def env_name(path: str) -> str:
    """``user.eval.every`` -> ``HPC_DDP_USER_EVAL_EVERY``."""
    return PREFIX + "_" + _NOT_WORD.sub("_", path.removeprefix("user.")).upper()


def env_value(value: Any) -> str:
    """Text as it is; every other value as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def user_environ(user: Mapping[str, Any]) -> dict[str, str]:
    """The variables a ``train.script`` gets for the user section (see the module's docstring)."""
    out = {env_name(path): env_value(value) for path, value in user_leaves(user)}
    out[PREFIX] = json.dumps(user)
    return out
