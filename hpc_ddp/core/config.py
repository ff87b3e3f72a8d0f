"""The one config schema of a run, and loading it from YAML files and ``key=value`` overrides.

``omegaconf`` lives only here (and in its helpers config_items and config_env): it merges the YAML
files in order, then the dotlist overrides, against the dataclass schema; every omegaconf or YAML
failure is turned into a :class:`ConfigError` that names the key, the value, what was expected and
the fix. Checks omegaconf does not do (ranges, choices, the element types of lists and dicts) are in
:mod:`hpc_ddp.core.config_checks`.

The schema itself (one dataclass per section, every field documented) is in
:mod:`hpc_ddp.core.config_schema`; its classes are importable from here too, where they always were,
as are :func:`flat_values`, :func:`config_diff` and :func:`describe_diff` from
:mod:`hpc_ddp.core.config_diff`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError

from hpc_ddp.core.config_schema import (ContainerConfig, DistConfig, MetricsConfig, RunConfig,
                                        SlurmConfig,
                                        SnapshotConfig, TrainConfig, schema_node, schema_rows,
                                        type_hints, type_name)
from hpc_ddp.core.config_checks import check_config
from hpc_ddp.core.config_env import env_leaves, remember, unresolve
from hpc_ddp.core.compile_settings import cache_place
from hpc_ddp.core.profiles import NOT_IN_PROFILE, Profile, Profiles
from hpc_ddp.core.config_items import for_script, list_item, nest
from hpc_ddp.core.config_hints import suggest
from hpc_ddp.core.run_dir_mode import make_run_dir
from hpc_ddp.core.errors import ConfigError, explain
from hpc_ddp.core.config_diff import config_diff, describe_diff, flat_values

__all__ = ["ContainerConfig", "DistConfig", "MetricsConfig", "RunConfig", "SlurmConfig",
           "SnapshotConfig",
           "TrainConfig", "config_diff", "describe_diff", "flat_values", "load_config",
           "profile_yaml", "save_config",
           "schema_node", "schema_rows", "to_yaml"]


def load_config(paths: Sequence[str | os.PathLike[str]] = (), overrides: Sequence[str] = (),
                profiles: Profiles | None = None) -> RunConfig:
    """Merge YAML files in order, then ``key=value`` overrides; validate; return the dataclass.

    ``name`` defaults to the last file's stem (``cluster.yaml examples/mlp.yaml`` -> ``mlp``):
    shared defaults are stacked first, the run's own file last; a file or override that sets
    ``name`` wins. With ``profiles`` (a submit: :mod:`hpc_ddp.core.profiles`), the profile that the
    merged ``profile`` key (or ``HPC_DDP_PROFILE``) names is merged first, under the files; without,
    ``profile`` is only a record (a run's own config.yaml already holds its profile's values).
    Raises :class:`ConfigError` naming the key, value, expectation and fix.
    """
    merged = _merge_all(paths, overrides)
    chosen = profiles.choose(_resolved(merged, "profile")) if profiles is not None else None
    if chosen is not None:
        merged = _merge_all(paths, overrides, (_read_profile(chosen), chosen.source))
        merged.profile = chosen.name
    elif profiles is not None:
        merged.profile = ""  # 'none', or nothing chosen: the record says no profile
    name = _resolved(merged, "name")
    if not name:
        if not paths:
            raise ConfigError(explain("the run has no name",
                                      expected="a name for the run directory",
                                      hint="pass a config file or add name=my_run"), key="name")
        # the run's own file comes last, after shared defaults (cluster.yaml)
        merged.name = Path(paths[-1]).stem
    try:
        cfg = OmegaConf.to_object(merged)
    except Exception as err:  # interpolations resolve here: ${oc.env:SCRATCH}, ${name}
        raise _translate(err, "the merged config") from err
    cfg.train.compile_cache = cache_place(cfg.train.compile_cache)  # YAML's off is False
    check_config(cfg)
    # ${oc.env:...} values are written as such, never as their value
    remember(cfg, env_leaves(merged))
    return cfg  # type: ignore[return-value]


def _merge_all(paths: Sequence[str | os.PathLike[str]], overrides: Sequence[str],
               base: tuple[Any, str] | None = None) -> Any:
    """The schema, then ``base`` (a profile's keys and how errors name it), the files, the
    overrides."""
    merged = OmegaConf.structured(RunConfig)
    if base is not None:
        merged = _merge(merged, *base)
    for path in paths:
        merged = _merge(merged, _read_yaml(Path(path)), f"config file {os.fspath(path)}")
    for item in overrides:
        key, where = str(item).partition("=")[0], f"override {item!r}"
        # train.args.3=VALUE: one item
        listed = list_item(merged, item) if isinstance(item, str) else None
        try:
            merged = _merge(merged, OmegaConf.create(nest(*listed)) if listed
                            else _parse_override(item), where,
                            key=listed[0] if listed else key)
        except ConfigError as err:
            raise for_script(err, merged, key, item) from None
    return merged


def _resolved(merged: Any, key: str) -> Any:
    try:
        # resolves an interpolation such as name=${x}: a missing key fails here
        return getattr(merged, key)
    except Exception as err:
        raise _translate(err, "the merged config") from err


def _read_profile(profile: Profile) -> Any:
    """The profile's keys (the schema checks them as they are merged: an unknown key is refused
    naming the profile's file)."""
    data = _read_yaml(profile.path, what=profile.source)
    for key in NOT_IN_PROFILE:
        if key in data:
            raise ConfigError(explain(f"{profile.source} sets {key}, which a profile may not",
                                      found=f"{key}: {data[key]}",
                                      expected="the cluster's keys (slurm.*, dist.*, "
                                      "run_dir, ...)", hint=f"remove {key} from {profile.path}; "
                                                            "the run's "
                                      f"{key} comes from its config or the command line"), key=key)
    return data


def profile_yaml(profile: Profile) -> str:
    """A profile's keys as the merge reads them (checked: an unknown key is refused), for ``profiles
    show``."""
    data = _read_profile(profile)
    _merge(OmegaConf.structured(RunConfig), data, profile.source)
    return OmegaConf.to_yaml(data)


def _read_yaml(path: Path, what: str = "") -> Any:
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


def _parse_override(item: str) -> Any:
    key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
    if not sep or not _KEY.fullmatch(key):
        hint = (f"give it a value: {key}=VALUE" if not sep and _KEY.fullmatch(key) else
                "keys are dotted names (train.lr); quote values with spaces: 'slurm.setup=[\"a "
                "b\"]'")
        raise ConfigError(explain("cannot read override", found=item,
                                  expected="key=value with a dotted key, "
                                  "e.g. train.lr=0.01", hint=hint),
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


def _unset_nulls(raw: dict[str, Any], section: type | None = None) -> None:
    """``train.task: null`` unsets a text key whose default is empty (it becomes ""), as on the
    command line ``train.task=null``: the key is then not set. Other nulls are left to the schema's
    check."""
    section = section or RunConfig
    fields = {f.name: f for f in dataclasses.fields(section)}
    hints = type_hints(section)
    for name, value in raw.items():
        field = fields.get(name)
        if field is None:
            continue
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[name]):
            _unset_nulls(value, hints[name])
        elif value is None and dataclasses.is_dataclass(hints[name]) and section is not RunConfig:
            # slurm.container: null -> its defaults (none)
            raw[name] = dataclasses.asdict(hints[name]())
        elif value is None and hints[name] is str and field.default == "":
            raw[name] = ""


def _merge(base: Any, data: Any, source: str, key: str = "") -> Any:
    # unresolved: "train=${x}" must not resolve here
    raw = OmegaConf.to_container(data, resolve=False)
    if isinstance(raw, dict):
        _unset_nulls(raw)
        data = OmegaConf.create(raw)
    for section in (f.name for f in dataclasses.fields(RunConfig)
                    if f.default_factory is not dataclasses.MISSING):
        if section in raw and not isinstance(raw[section], dict) and raw[section] is not None:
            raise ConfigError(explain(f"in {source}, {section} must be a section of keys",
                                      found=raw[section],
                                      expected=f"{section}.KEY: VALUE or a mapping",
                                      hint=f"e.g. {section}.{_first_key(section)}=..."),
                              key=section)
    try:
        return OmegaConf.merge(base, data)
    except Exception as err:
        raise _translate(err, source, key) from None


def _first_key(section: str) -> str:
    hint = type_hints(RunConfig)[section]
    return dataclasses.fields(hint)[0].name if dataclasses.is_dataclass(hint) else "eval_every"


def _translate(err: Exception, source: str, fallback_key: str = "") -> ConfigError:
    """An omegaconf exception as a ConfigError in the house style (``fallback_key``: the override's
    key, for errors that omegaconf reports without one, such as a mapping given for a list)."""
    key = str(getattr(err, "full_key", "") or "") or fallback_key
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, InterpolationResolutionError):
        return ConfigError(explain(f"cannot resolve an interpolation in config key {key or '?'} "
                                   f"({source}): "
                                   f"{first_line}", hint="${name} refers to a config key and "
                                                         "${oc.env:VAR} to an "
                                   "environment variable; for a shell variable in a setup line "
                                   "write $VAR, "
                                   "or escape it as \\${VAR}"), key=key or None)
    key_path = re.sub(r"\[\d+\]", "", key)  # slurm.setup[0] -> slurm.setup
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        section, _ = schema_node(key_path)
        parent, _, leaf = key_path.rpartition(".")
        valid = [f.name for f in dataclasses.fields(section)] if section else []
        near = suggest(key_path)
        hint = f"did you mean {near}?" if near else "see the config reference (docs/config.md) for every key"
        if parent in ("", "train"):  # train.eval_every, model.hidden: the user's own settings
            own = fallback_key if fallback_key.startswith(key_path + ".") else key_path
            hint += (" Y" if near
                     else "; y") + f"our own settings go under user: (user.{own.removeprefix('train.')}=...)"
        return ConfigError(explain(f"unknown config key {key!r} in {source}",
                                   expected=f"one of the keys of {parent or 'the top level'}: "
                                            f"{', '.join(valid)}",
                                   hint=hint), key=key)
    if key:
        section, tp = schema_node(key_path)
        found = getattr(err, "value", None)
        hint = f"set it as {key}=<{_expected(tp)}>"
        if found is None and "Optional" not in type_name(tp):
            default = next((f.default for f in dataclasses.fields(section)
                            if f.name == key_path.rpartition(".")[2]),
                           None) if section else None
            hint = (f"{key} cannot be unset (null): give {_expected(tp)}, or leave it out for its "
                    "default"
                    + (f" ({default})" if default not in (None, dataclasses.MISSING) else ""))
        return ConfigError(explain(f"bad value for config key {key} in {source}: {first_line}",
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


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML that :func:`load_config` reads back to an equal config; a value from
    ``${oc.env:VAR}`` is written as that text (:mod:`hpc_ddp.core.config_env`), resolved again by
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
                                       "read-only or "
                                  "full filesystem cannot hold snapshots either)"),
                          key="run_dir") from None
    return target
