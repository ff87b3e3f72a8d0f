"""Cluster profiles: where they live, which one a run uses, and a missing one refused with the fix.

A profile is a YAML file of config keys that are the same for every run on one cluster (partition,
account, QOS, ``setup`` lines, srun arguments, NCCL variables, a scratch ``run_dir``). It lies in
``$XDG_CONFIG_HOME/hpc_ddp/profiles/NAME.yaml`` (``~/.config/hpc_ddp/profiles/`` without
``XDG_CONFIG_HOME``) and is merged UNDER the run's config files and overrides:
schema defaults < profile < config files < ``key=value``.

Which profile: the config key ``profile`` as the config files and overrides leave it (``--profile
NAME`` is the override ``profile=NAME``), else ``HPC_DDP_PROFILE``; ``none`` chooses none. Pure: the
caller passes the environment; reading and merging the YAML is
:func:`hpc_ddp.core.config.load_config`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.core.errors import ConfigError, explain

ENV_VAR = "HPC_DDP_PROFILE"
NO_PROFILE = "none"  # --profile none: no profile, whatever HPC_DDP_PROFILE says
SUFFIXES = (".yaml", ".yml")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
#: keys a profile may not set: the run names itself, and a profile does not choose another
NOT_IN_PROFILE = ("name", "profile")


class ProfileError(ConfigError):
    """A profile is named that does not exist, or its name cannot be a file's."""


@dataclass(frozen=True)
class Profile:
    """One profile file: its name (the file's stem) and where it is."""

    name: str
    path: Path

    @property
    def source(self) -> str:
        """How errors name it: ``profile gpu (/home/me/.config/hpc_ddp/profiles/gpu.yaml)``."""
        return f"profile {self.name} ({self.path})"


@dataclass(frozen=True)
class Profiles:
    """Where profiles are looked up, and the one ``HPC_DDP_PROFILE`` names (the lowest choice)."""

    directory: Path
    default: str = ""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Profiles:
        return cls(profile_dir(environ), environ.get(ENV_VAR, "").strip())

    def choose(self, configured: str) -> Profile | None:
        """The profile for a run whose config leaves ``profile`` as ``configured``; None for
        none."""
        name = (configured or self.default).strip()
        if not name or name == NO_PROFILE:
            return None
        key = "profile" if configured else ENV_VAR
        return find_profile(name, self.directory, key)

    def available(self) -> list[Profile]:
        return available(self.directory)


def profile_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/hpc_ddp/profiles``, or ``~/.config/hpc_ddp/profiles`` (XDG's default)."""
    base = environ.get("XDG_CONFIG_HOME", "").strip()
    if not base or not Path(base).is_absolute():  # the XDG spec: a relative value is ignored
        base = str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / "hpc_ddp" / "profiles"


def available(directory: Path) -> list[Profile]:
    """Every profile in ``directory``, by name (``NAME.yaml`` before ``NAME.yml``)."""
    try:
        files = sorted(p for p in directory.iterdir() if p.suffix in SUFFIXES and p.is_file())
    except OSError:
        return []
    found: dict[str, Profile] = {}
    for path in sorted(files, key=lambda p: (p.stem, SUFFIXES.index(p.suffix))):
        found.setdefault(path.stem, Profile(path.stem, path))
    return list(found.values())


def find_profile(name: str, directory: Path, key: str = "profile") -> Profile:
    """The profile called ``name``; a :class:`ProfileError` listing the ones there are, and where,
    if none is."""
    if not _NAME.fullmatch(name) or name.endswith(SUFFIXES):
        stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
        raise ProfileError(explain(f"bad profile name {name!r} ({key})", found=name,
                                   expected=f"a profile's name: the stem of a file in {directory}",
                                   hint="name it without directory or suffix, e.g. --profile "
                                        f"{stem or 'mycluster'}"),
                           key=key)
    for profile in available(directory):
        if profile.name == name:
            return profile
    there = available(directory)
    expected = (f"one of the profiles in {directory}: {', '.join(p.name for p in there)}" if there
                else
                f"a profile file in {directory}, which holds none (it is empty or absent)")
    raise ProfileError(explain(f"no profile named {name!r} ({key}): looked for "
                               f"{directory / (name + '.yaml')}",
                               found=name, expected=expected,
                               hint=f"create {directory / (name + '.yaml')} with the cluster's "
                                    "keys (see "
                               "python -m hpc_ddp.profiles --help), pick another, or run without "
                               "one "
                               f"(--profile {NO_PROFILE})"), key=key)
