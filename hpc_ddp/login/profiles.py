"""``python -m hpc_ddp.profiles list | show NAME``: the cluster profiles a submit can merge in.

A profile holds the config keys that are the same for every run on one cluster (partition,
account, QOS, setup lines, srun arguments, NCCL variables, ...): a YAML file in
``$XDG_CONFIG_HOME/hpc_ddp/profiles/`` (``~/.config/hpc_ddp/profiles/`` by default).
``python -m hpc_ddp.submit --profile NAME CONFIG.yaml`` (or ``HPC_DDP_PROFILE=NAME``) merges it
UNDER the config files and the overrides; the run's config.yaml records the merged values and
the key ``profile: NAME``, and ``python -m hpc_ddp.status RUN`` names it. No torch.
"""
# Also here: how a submit loads a config with its profile, and what --resume compares with.

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc_ddp.core.config import RunConfig, load_config, profile_yaml
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.core.profiles import ENV_VAR, ProfileError, Profiles, find_profile
from hpc_ddp.rundir import layout

EPILOG = f"""\
examples:
  python -m hpc_ddp.profiles list
  python -m hpc_ddp.profiles show mycluster
  python -m hpc_ddp.submit --profile mycluster examples/mlp.yaml train.max_steps=200
  {ENV_VAR}=mycluster python -m hpc_ddp.submit examples/mlp.yaml

a profile, e.g. ~/.config/hpc_ddp/profiles/mycluster.yaml (any config key; the run's config files
and KEY=VALUE win over it):
  slurm:
    partition: gpu
    account: proj123
    setup: ["module load cuda/12.4", "source ~/venvs/train/bin/activate"]
    srun_args: ["--cpu-bind=cores"]
  dist:
    nccl_env: {{NCCL_SOCKET_IFNAME: ib0}}
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.profiles",
                                     description=for_help(__doc__),
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="list | show NAME")
    sub.add_parser("list", help="every profile's name and file, or where they are looked for")
    show = sub.add_parser("show", help="a profile's file and the keys it merges in (checked "
                                       "against the schema)")
    show.add_argument("name", help="the profile's name (its file's stem)")
    return parser


def list_profiles(profiles: Profiles) -> str:
    found = profiles.available()
    if not found:
        return (f"no profiles in {profiles.directory}\n  create one: "
                f"{profiles.directory}/NAME.yaml with the "
                "cluster's keys (python -m hpc_ddp.profiles --help shows an example)")
    width = max(len(p.name) for p in found)
    lines = [f"profiles in {profiles.directory}:"]
    lines += [f"  {p.name:<{width}}  {p.path}"
              + ("  (default: " + ENV_VAR + ")" if p.name == profiles.default
                                                  else "") for p in found]
    return "\n".join(lines)


def show_profile(profiles: Profiles, name: str) -> str:
    profile = find_profile(name, profiles.directory)
    return f"# {profile.path}\n{profile_yaml(profile)}"


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profiles = Profiles.from_environ(os.environ if environ is None else environ)
    try:
        print((list_profiles(profiles) if args.command == "list"
               else show_profile(profiles, args.name)).rstrip())
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def load_with_profile(paths: Sequence[str], overrides: list[str], profiles: Profiles, resume: bool,
                      label: str = "") -> RunConfig:
    """The config with its profile merged under it. On ``--resume`` of a run that has its
    config.yaml, a profile that is gone is not a refusal: the run goes on with its own config, which
    holds the values."""
    try:
        return load_config(paths, overrides, profiles)
    except ProfileError as err:
        if not resume:
            raise
        cfg = load_config(paths, [o for o in overrides if not o.startswith("profile=")])
        run_dir = Path(cfg.run_dir).expanduser().resolve()
        if not layout.config(run_dir / label if label else run_dir).is_file():
            raise
        print(f"--resume: {str(err).splitlines()[0]} The run goes on with its own config (its "
              "profile's values as "
              "they were merged).", flush=True)
        return cfg


def recorded_profile(cfg: RunConfig, own: RunConfig, paths: Sequence[str], overrides: Sequence[str],
                     profiles: Profiles) -> RunConfig:
    """What ``--resume`` compares the run's own config with: ``cfg``, or, when this command names no
    profile and the run recorded one, the config files with the run's profile as it is now (so a
    changed profile shows as such, and an unchanged one not at all)."""
    if any(o.startswith("profile=")
           for o in overrides) or not own.profile or cfg.profile == own.profile:
        return cfg
    try:
        again = load_config(paths, [*overrides, f"profile={own.profile}"], profiles)
    except HpcDdpError:
        return cfg  # the profile is gone or broken: compare with the files alone
    again.run_dir = cfg.run_dir
    return again
