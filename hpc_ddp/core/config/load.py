"""Loading a run's config: its profile, the YAML files in order, then the ``key=value`` overrides,
merged against the dataclass schema by omegaconf, checked, and returned as a :class:`RunConfig`.

Every omegaconf or YAML failure becomes a :class:`ConfigError` that names the key, the value, what
was expected and the fix (:mod:`hpc_ddp.core.config.translate`; one file or override is read by
:mod:`hpc_ddp.core.config.inputs`). Checks omegaconf does not do (ranges, choices, the element
types of lists and dicts, rules across keys) are :mod:`hpc_ddp.core.config.checks`'.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpc_ddp.core.compile_settings import cache_place
from hpc_ddp.core.config.checks import check_config
from hpc_ddp.core.config.env import env_leaves, remember
from hpc_ddp.core.config.inputs import parse_override, read_yaml
from hpc_ddp.core.config.items import for_script, list_item, nest
from hpc_ddp.core.config.schema import RunConfig, type_hints
from hpc_ddp.core.config.translate import translate
from hpc_ddp.core.errors import ConfigError, explain
from hpc_ddp.core.profiles import NOT_IN_PROFILE, Profile, Profiles


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
        raise translate(err, "the merged config") from err
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
        merged = _merge(merged, read_yaml(Path(path)), f"config file {os.fspath(path)}")
    for item in overrides:
        key, where = str(item).partition("=")[0], f"override {item!r}"
        # train.args.3=VALUE: one item
        listed = list_item(merged, item) if isinstance(item, str) else None
        try:
            merged = _merge(merged, OmegaConf.create(nest(*listed)) if listed
                            else parse_override(item), where,
                            key=listed[0] if listed else key)
        except ConfigError as err:
            raise for_script(err, merged, key, item) from None
    return merged


def _resolved(merged: Any, key: str) -> Any:
    try:
        # resolves an interpolation such as name=${x}: a missing key fails here
        return getattr(merged, key)
    except Exception as err:
        raise translate(err, "the merged config") from err


def _read_profile(profile: Profile) -> Any:
    """The profile's keys (the schema checks them as they are merged: an unknown key is refused
    naming the profile's file)."""
    data = read_yaml(profile.path, what=profile.source)
    for key in NOT_IN_PROFILE:
        if key in data:
            raise ConfigError(explain(f"{profile.source} sets {key}, which a profile may not",
                                      found=f"{key}: {data[key]}",
                                      expected="the cluster's keys (slurm.*, dist.*, run_dir, "
                                      "...)", hint=f"remove {key} from {profile.path}; "
                                                            "the run's "
                                      f"{key} comes from its config or the command line"), key=key)
    return data


def profile_yaml(profile: Profile) -> str:
    """A profile's keys as the merge reads them (checked: an unknown key is refused), for ``profiles
    show``."""
    data = _read_profile(profile)
    _merge(OmegaConf.structured(RunConfig), data, profile.source)
    return OmegaConf.to_yaml(data)


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
        # into base itself: each caller's base is its own fresh merge, and merge()'s deep copy of it
        # at every file and override was ~5 ms of the login node's dry run (B1)
        return OmegaConf.unsafe_merge(base, data)
    except Exception as err:
        raise translate(err, source, key) from None


def _first_key(section: str) -> str:
    hint = type_hints(RunConfig)[section]
    return dataclasses.fields(hint)[0].name if dataclasses.is_dataclass(hint) else "eval_every"
