"""omegaconf's exceptions in the house's words: a :class:`ConfigError` that names the key, the
value found, what was expected and the fix (an unknown key gets "did you mean", a user's own
setting is pointed at ``user:``, an unresolved interpolation says how to write a shell variable).
Apart from :mod:`hpc_ddp.core.config.load`: the merge only calls it where omegaconf refuses.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError

from hpc_ddp.core.config.hints import suggest
from hpc_ddp.core.config.schema import schema_default, schema_node, type_name
from hpc_ddp.core.errors import ConfigError, explain


def translate(err: Exception, source: str, fallback_key: str = "") -> ConfigError:
    """An omegaconf exception as a ConfigError in the house style (``fallback_key``: the override's
    key, for errors that omegaconf reports without one, such as a mapping given for a list)."""
    key = str(getattr(err, "full_key", "") or "") or fallback_key
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, InterpolationResolutionError):
        return ConfigError(explain(f"cannot resolve an interpolation in config key {key or '?'} "
                                   f"({source}): "
                                   f"{first_line}", hint="${name} refers to a config key and "
                                   "${oc.env:VAR} to an environment variable; for a shell variable "
                                   "in a setup line write $VAR, or escape it as "
                                   "\\${VAR}"), key=key or None)
    key_path = re.sub(r"\[\d+\]", "", key)  # slurm.setup[0] -> slurm.setup
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        section, _ = schema_node(key_path)
        parent, _, leaf = key_path.rpartition(".")
        valid = [f.name for f in dataclasses.fields(section)] if section else []
        near = suggest(key_path)
        hint = (f"did you mean {near}?" if near
                else "see the config reference (docs/config.md) for every key")
        if parent in ("", "train"):  # train.eval_every, model.hidden: the user's own settings
            own = fallback_key if fallback_key.startswith(key_path + ".") else key_path
            hint += ((" Y" if near else "; y")
                     + f"our own settings go under user: (user.{own.removeprefix('train.')}=...)")
        return ConfigError(explain(f"unknown config key {key!r} in {source}",
                                   expected=f"one of the keys of {parent or 'the top level'}: "
                                            f"{', '.join(valid)}",
                                   hint=hint), key=key)
    if key:
        _, tp = schema_node(key_path)
        found = getattr(err, "value", None)
        if dataclasses.is_dataclass(tp):  # slurm.straggler=replace: a section given one value
            keys = [f.name for f in dataclasses.fields(tp)]
            return ConfigError(explain(f"bad value for config key {key} in {source}: it is a "
                                       "section, not one value", found=found,
                                       expected=f"its keys: {', '.join(keys)}",
                                       hint=f"set a key inside it, e.g. {key}.{keys[0]}=..."),
                               key=key)
        hint = f"set it as {key}=<{_expected(tp)}>"
        if found is None and "Optional" not in type_name(tp):
            default = schema_default(key_path)
            hint = (f"{key} cannot be unset (null): give {_expected(tp)}, or leave it out for its "
                    "default" + (f" ({default})" if default is not None else ""))
        # OmegaConf's own sentence ("Value '8.5' of type 'float' could not be converted to
        # Integer") says again what found and expected say, in its internal names
        said = "" if found is not None else f": {first_line}"
        return ConfigError(explain(f"bad value for config key {key} in {source}{said}",
                                   found=found, expected=_expected(tp), hint=hint), key=key)
    return ConfigError(f"invalid config in {source}: {first_line}")


def _expected(tp: Any) -> str:
    name = type_name(tp)
    for words, text in (("List", "a list of text, e.g. [a, b]"), ("Dict", "a mapping, e.g. {k: v}"),
                        ("bool", "true or false"), ("int", "an integer"), ("float", "a number"),
                        ("str", "text")):
        if words in name:
            return text + (" or null" if "Optional" in name else "")
    return name
