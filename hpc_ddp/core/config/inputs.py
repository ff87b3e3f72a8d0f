"""Reading one input of a config: a YAML file, or one ``key=value`` override of the command line.

Each is refused in words that name the input and the fix: a file that cannot be read, is not UTF-8
or not YAML, or holds no mapping; an override without a value, with a key that is no dotted name,
or with a value YAML cannot parse (with what to type instead). Apart from
:mod:`hpc_ddp.core.config.load`, which merges what these read against the schema.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpc_ddp.core.errors import ConfigError, explain


def read_yaml(path: Path, what: str = "") -> Any:
    what = what or f"config file {os.fspath(path)}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(explain(f"cannot read {what}: {err.strerror}",
                                  hint="check the path (relative paths start at the current "
                                       "directory)")) from None
    except UnicodeDecodeError as err:
        raise ConfigError(explain(
            f"{what} is not UTF-8 text: the byte at offset {err.start} (line "
            f"{err.object[:err.start].count(10) + 1})"
            f" cannot be decoded ({err.reason})",
            found=err.object[max(0, err.start - 20):err.end + 20], expected="a YAML file in UTF-8",
            hint=f"re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8 {os.fspath(path)} > "
                 "fixed.yaml), or check "
            "that the path names the config and not a binary file")) from None
    try:
        data = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except Exception as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(explain(f"{what} is not valid YAML{where}: "
                                  f"{str(err).splitlines()[0]}",
                                  hint="fix the YAML syntax there")) from None
    if not OmegaConf.is_dict(data):
        raise ConfigError(explain(f"{what} must hold a mapping of keys",
                                  found=type(data._content).__name__,
                                  expected="'key: value' lines"))
    return data


def parse_override(item: str) -> Any:
    key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
    if not sep or not _KEY.fullmatch(key):
        hint = (f"give it a value: {key}=VALUE" if not sep and _KEY.fullmatch(key) else
                "keys are dotted names (train.lr); quote values with spaces: 'slurm.setup=[\"a "
                "b\"]'")
        raise ConfigError(explain("cannot read override", found=item,
                                  expected="key=value with a dotted key, e.g. "
                                  "train.lr=0.01", hint=hint),
                          key=key if sep and key else (str(item) or "<empty override>"))
    try:
        return OmegaConf.from_dotlist([item])
    except Exception as err:
        raise ConfigError(explain(f"cannot parse the value of override {item!r}: "
                                  f"{str(err).splitlines()[0]}",
                                  hint=_parse_hint(key, value)), key=key) from None


def _parse_hint(key: str, value: str) -> str:
    """What to type instead: an element with ${...} or a colon must be quoted inside a YAML list."""
    hint = "values are YAML: 0.1, true, null, [a, b], {k: v}, or quoted text"
    if value.startswith("[") and ("${" in value or ":" in value):
        items = [v.strip() for v in value.strip("[]").split(",")]
        quoted = ",".join(f'"{v}"' if ("${" in v or ":" in v) and not v.startswith(("'", '"'))
                          else v for v in items)
        hint += (f"; in a list, quote an element that holds ${{...}} or a colon, and the whole "
                 "override for the "
                 f"shell: '{key}=[{quoted}]'")
    return hint


_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")
