"""Overrides that name one item of a list (``train.args.3=VALUE``), and what a script run's config
error should add: the script's own arguments go in ``train.args``, not at the top level. Pure; no
torch.

OmegaConf reads ``train.args.3=x`` as a mapping ``{3: x}`` and refuses to merge it into a list
("Cannot merge DictConfig with ListConfig"), which read as "train.args.3 cannot be unset (null)". An
index that exists replaces that item, the next index after the last appends one, and any other says
how many items there are and how to give the list.
"""

from __future__ import annotations

import json
import re
from typing import Any

from omegaconf import OmegaConf

from hpc_ddp.core.errors import ConfigError, explain

_ITEM = re.compile(r"(?P<list>[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*)\.(?P<index>\d+)")


def list_item(merged: Any, item: str) -> tuple[str, list[Any]] | None:
    """For ``KEY.N=VALUE`` where KEY is a list in ``merged``: (KEY, the list with item N replaced,
    or appended when N is its length). None when the override names no list item. Raises past the
    end."""
    key, sep, value = item.partition("=")
    found = _ITEM.fullmatch(key)
    if found is None or not sep:
        return None
    listed = OmegaConf.select(merged, found["list"], default=None)
    if not OmegaConf.is_list(listed):
        return None
    items = list(OmegaConf.to_container(listed, resolve=False))
    index = int(found["index"])
    parsed = OmegaConf.from_dotlist([f"value={value}"])
    new = OmegaConf.to_container(parsed, resolve=False)["value"]
    if index < len(items):
        items[index] = new
    elif index == len(items):
        items.append(new)
    else:
        raise ConfigError(explain(
            f"{key} is past the end of {found['list']}, which has {len(items)} item(s) "
            f"({found['list']}.0 to {found['list']}.{len(items) - 1})" if items else
            f"{key} is past the end of {found['list']}, which is empty",
            found=item, expected=f"an index from 0 to {len(items)}",
            hint=f"{found['list']}.N=VALUE replaces item N, {found['list']}.{len(items)}=VALUE "
                 "adds one at the end; "
            "or give the whole list, quoted for the shell: "
            f"{whole_list(found['list'], items + [new])}"),
            key=key)
    return found["list"], items


def whole_list(key: str, items: list[Any]) -> str:
    """``'train.args=["a=1", "b"]'``: a list override as a shell takes it (each item quoted for
    YAML)."""
    return f"'{key}=[" + ", ".join(json.dumps(str(v)) for v in items) + "]'"


def script_args_hint(merged: Any, key: str, item: str) -> str:
    """For an unknown top-level (or train.) key in a ``train.script`` run: its script's own
    arguments go in train.args, with the override to type (this item replacing the one with its
    name, else added)."""
    script = OmegaConf.select(merged, "train.script", default="", throw_on_resolution_failure=False)
    if not script:
        return ""
    args = OmegaConf.select(merged, "train.args", default=None, throw_on_resolution_failure=False)
    items = ([str(v) for v in OmegaConf.to_container(args, resolve=False)]
             if OmegaConf.is_list(args) else [])
    same = [i for i, v in enumerate(items) if v.partition("=")[0] == key]
    index = same[0] if same else len(items)
    example = f"'train.args.{index}={item}'"
    merged_items = [*items[:index], item, *items[index + 1:]]
    return (f"\nHINT: train.script={script} runs your script: its own arguments go in train.args "
            f"(now {len(items)} "
            f"item(s)), not on the command line as keys. To {'replace' if same else 'add'} this "
            f"one: {example}, or "
            f"give the whole list, quoted for the shell: {whole_list('train.args', merged_items)}")


def nest(key: str, value: Any) -> dict[str, Any]:
    """``train.args``, [..] -> {"train": {"args": [..]}}."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def for_script(err: ConfigError, merged: Any, key: str, item: str) -> ConfigError:
    """``err`` for an override, with :func:`script_args_hint` in place of its hint where a
    ``train.script`` run got an unknown top-level or ``train.`` key
    (``trainer_config.max_epochs=3``: the script's own argument)."""
    unknown = str(err).startswith("unknown config key") and ("." not in (err.key or ".") or
                                                              str(err.key).startswith("train."))
    hint = script_args_hint(merged, key, item) if unknown else ""
    return ConfigError(str(err).split("\nHINT:")[0] + hint, key=err.key) if hint else err
