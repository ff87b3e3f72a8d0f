"""The one config schema of a run, and loading it from YAML files and ``key=value`` overrides.

``omegaconf`` lives only in this module: it merges the YAML files in order, then
the dotlist overrides, against the dataclass schema; every omegaconf or YAML
failure is turned into a :class:`ConfigError` that names the key, the value, what
was expected and the fix. Checks omegaconf does not do (ranges, choices, the
element types of lists and dicts) are in :mod:`hpc_ddp.core.config_checks`.

The schema itself (one dataclass per section, every field documented) is in
:mod:`hpc_ddp.core.config_schema`; its classes are importable from here too, where they always were.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError

from hpc_ddp.core.config_schema import (ContainerConfig, DistConfig, MetricsConfig, RunConfig, SlurmConfig,
                                        SnapshotConfig, TrainConfig, schema_node, schema_rows, type_hints, type_name)
from hpc_ddp.core.config_checks import check_config
from hpc_ddp.core.errors import ConfigError, explain

__all__ = ["ContainerConfig", "DistConfig", "MetricsConfig", "RunConfig", "SlurmConfig", "SnapshotConfig",
           "TrainConfig", "config_diff", "describe_diff", "flat_values", "load_config", "save_config", "schema_node", "schema_rows", "to_yaml"]


def load_config(paths: Sequence[str | os.PathLike[str]] = (), overrides: Sequence[str] = ()) -> RunConfig:
    """Merge YAML files in order, then ``key=value`` overrides; validate; return the dataclass.

    ``name`` defaults to the first file's stem (``examples/mlp.yaml`` -> ``mlp``).
    Raises :class:`ConfigError` naming the key, value, expectation and fix.
    """
    merged = OmegaConf.structured(RunConfig)
    for path in paths:
        merged = _merge(merged, _read_yaml(Path(path)), f"config file {os.fspath(path)}")
    for item in overrides:
        merged = _merge(merged, _parse_override(item), f"override {item!r}", key=item.partition("=")[0])
    try:
        name = merged.name  # resolves an interpolation such as name=${x}: a missing key fails here
    except Exception as err:
        raise _translate(err, "the merged config") from err
    if not name:
        if not paths:
            raise ConfigError(explain("the run has no name", expected="a name for the run directory",
                                      hint="pass a config file or add name=my_run"), key="name")
        merged.name = Path(paths[0]).stem
    try:
        cfg = OmegaConf.to_object(merged)
    except Exception as err:  # interpolations resolve here: ${oc.env:SCRATCH}, ${name}
        raise _translate(err, "the merged config") from err
    check_config(cfg)
    return cfg  # type: ignore[return-value]


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(explain(f"cannot read config file {os.fspath(path)}: {err.strerror}",
                                  hint="check the path (relative paths start at the current directory)")) from None
    try:
        data = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except Exception as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(explain(f"config file {os.fspath(path)} is not valid YAML{where}: "
                                  f"{str(err).splitlines()[0]}", hint="fix the YAML syntax there")) from None
    if not OmegaConf.is_dict(data):
        raise ConfigError(explain(f"config file {os.fspath(path)} must hold a mapping of keys",
                                  found=type(data._content).__name__, expected="'key: value' lines"))
    return data


def _parse_override(item: str) -> Any:
    key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
    if not sep or not _KEY.fullmatch(key):
        hint = (f"give it a value: {key}=VALUE" if not sep and _KEY.fullmatch(key) else
                "keys are dotted names (train.lr); quote values with spaces: 'slurm.setup=[\"a b\"]'")
        raise ConfigError(explain("cannot read override", found=item, expected="key=value with a dotted key, "
                                  "e.g. train.lr=0.01", hint=hint),
                          key=key if sep and key else (str(item) or "<empty override>"))
    try:
        return OmegaConf.from_dotlist([item])
    except Exception as err:
        raise ConfigError(explain(f"cannot parse the value of override {item!r}: {str(err).splitlines()[0]}",
                                  hint=_parse_hint(key, value)), key=key) from None


def _parse_hint(key: str, value: str) -> str:
    """What to type instead: an element with ${...} or a colon must be quoted inside a YAML list."""
    hint = "values are YAML: 0.1, true, null, [a, b], {k: v}, or quoted text"
    if value.startswith("[") and ("${" in value or ":" in value):
        items = [v.strip() for v in value.strip("[]").split(",")]
        quoted = ",".join(f'"{v}"' if ("${" in v or ":" in v) and not v.startswith(("'", '"')) else v for v in items)
        hint += (f"; in a list, quote an element that holds ${{...}} or a colon, and the whole override for the "
                 f"shell: '{key}=[{quoted}]'")
    return hint


_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


def _unset_nulls(raw: dict[str, Any], section: type | None = None) -> None:
    """``train.task: null`` unsets a text key whose default is empty (it becomes ""), as on the command
    line ``train.task=null``: the key is then not set. Other nulls are left to the schema's check."""
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
            raw[name] = dataclasses.asdict(hints[name]())  # slurm.container: null -> its defaults (none)
        elif value is None and hints[name] is str and field.default == "":
            raw[name] = ""


def _merge(base: Any, data: Any, source: str, key: str = "") -> Any:
    raw = OmegaConf.to_container(data, resolve=False)  # unresolved: "train=${x}" must not resolve here
    if isinstance(raw, dict):
        _unset_nulls(raw)
        data = OmegaConf.create(raw)
    for section in (f.name for f in dataclasses.fields(RunConfig) if f.default_factory is not dataclasses.MISSING):
        if section in raw and not isinstance(raw[section], dict) and raw[section] is not None:
            raise ConfigError(explain(f"in {source}, {section} must be a section of keys",
                                      found=raw[section], expected=f"{section}.KEY: VALUE or a mapping",
                                      hint=f"e.g. {section}.{_first_key(section)}=..."), key=section)
    try:
        return OmegaConf.merge(base, data)
    except Exception as err:
        raise _translate(err, source, key) from None


def _first_key(section: str) -> str:
    return dataclasses.fields(type_hints(RunConfig)[section])[0].name


def _translate(err: Exception, source: str, fallback_key: str = "") -> ConfigError:
    """An omegaconf exception as a ConfigError in the house style (``fallback_key``: the override's key,
    for errors that omegaconf reports without one, such as a mapping given for a list)."""
    key = str(getattr(err, "full_key", "") or "") or fallback_key
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, InterpolationResolutionError):
        return ConfigError(explain(f"cannot resolve an interpolation in config key {key or '?'} ({source}): "
                                   f"{first_line}", hint="${name} refers to a config key and ${oc.env:VAR} to an "
                                   "environment variable; for a shell variable in a setup line write $VAR, "
                                   "or escape it as \\${VAR}"), key=key or None)
    key_path = re.sub(r"\[\d+\]", "", key)  # slurm.setup[0] -> slurm.setup
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        section, _ = schema_node(key_path)
        parent, _, leaf = key_path.rpartition(".")
        valid = [f.name for f in dataclasses.fields(section)] if section else []
        near = difflib.get_close_matches(leaf, valid, n=1)
        hint = f"did you mean {'.'.join(filter(None, [parent, near[0]]))}?" if near else \
            "see the config reference (docs/config.md) for every key"
        return ConfigError(explain(f"unknown config key {key!r} in {source}",
                                   expected=f"one of the keys of {parent or 'the top level'}: {', '.join(valid)}",
                                   hint=hint), key=key)
    if key:
        section, tp = schema_node(key_path)
        found = getattr(err, "value", None)
        hint = f"set it as {key}=<{_expected(tp)}>"
        if found is None and "Optional" not in type_name(tp):
            default = next((f.default for f in dataclasses.fields(section) if f.name == key_path.rpartition(".")[2]),
                           None) if section else None
            hint = (f"{key} cannot be unset (null): give {_expected(tp)}, or leave it out for its default"
                    + (f" ({default})" if default not in (None, dataclasses.MISSING) else ""))
        return ConfigError(explain(f"bad value for config key {key} in {source}: {first_line}",
                                   found=found, expected=_expected(tp), hint=hint), key=key)
    return ConfigError(f"invalid config in {source}: {first_line}")


def _expected(tp: Any) -> str:
    name = type_name(tp)
    for words, text in (("List", "a list of text, e.g. [a, b]"), ("Dict", "a mapping, e.g. {k: v}"),
                        ("bool", "true or false"), ("int", "an integer"), ("float", "a number"), ("str", "text")):
        if words in name:
            return text + (" or null" if "Optional" in name else "")
    return name


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML that :func:`load_config` reads back to an equal config."""
    return OmegaConf.to_yaml(OmegaConf.create(_escape(dataclasses.asdict(cfg))))


def _escape(value: Any) -> Any:
    """Resolved text may hold a literal '${' (an escaped shell variable); keep it literal on reload."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def save_config(cfg: RunConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config durably (temp file, fsync, rename): never half a file."""
    from hpc_ddp.core.atomic import write_atomic

    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, to_yaml(cfg))
    except OSError as err:
        raise ConfigError(explain(f"cannot write {target}: {err.strerror}", found=str(target.parent),
                                  expected="a writable run dir",
                                  hint="set run_dir=... to a writable directory with free space (a read-only or "
                                  "full filesystem cannot hold snapshots either)"), key="run_dir") from None
    return target


def flat_values(cfg: RunConfig) -> dict[str, Any]:
    """Every leaf as ``{"train.lr": 0.1, ...}`` in JSON terms (lists and dicts are leaves): what a
    snapshot manifest records of the config that wrote it."""
    import json

    def walk(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if dataclasses.is_dataclass(value):
            for item in dataclasses.fields(value):
                yield from walk(getattr(value, item.name), f"{prefix}{item.name}.")
        else:
            yield prefix[:-1], value
    return json.loads(json.dumps(dict(walk(cfg, ""))))


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every key of two :func:`flat_values` that differs."""
    return [(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def describe_diff(diff: list[tuple[str, Any, Any]]) -> str:
    """``train.lr: 0.1 -> 0.01, train.max_steps: 100 -> 200``."""
    return ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diff)
