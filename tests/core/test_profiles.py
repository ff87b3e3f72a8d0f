"""Cluster profiles (merged under the run's config) and the config's ``user:`` section: tier-1 tables over
load_config, the submit's resolve step (--resume included), the ``profiles`` command and status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.config import flat_values, load_config, save_config
from hpc_ddp.core.errors import ConfigError
from hpc_ddp.core.profiles import Profiles, profile_dir
from hpc_ddp.core.user_settings import UserSettings, user_environ
from hpc_ddp.login import profiles as profiles_cli
from hpc_ddp.login.guards import write_config
from hpc_ddp.login.resolve import resolve_all
from hpc_ddp.login.status import render
from hpc_ddp.login.status.read import collect

ROOT = Path(__file__).resolve().parents[2]
PROFILE = """\
slurm:
  partition: gpu
  account: proj1
  qos: normal
  setup: ["export PROFILE_SET=1"]
  srun_args: ["--label"]
  sbatch_extra: {mail-type: END}
dist:
  nccl_env: {NCCL_SOCKET_IFNAME: ib0}
user:
  cluster: big
"""


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config home with one profile, ``big``, in it; HPC_DDP_PROFILE unset."""
    home = tmp_path / "xdg"
    (home / "hpc_ddp" / "profiles").mkdir(parents=True)
    (home / "hpc_ddp" / "profiles" / "big.yaml").write_text(PROFILE)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv("HPC_DDP_PROFILE", raising=False)
    return home / "hpc_ddp" / "profiles"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"run_dir: {tmp_path / 'runs' / 'run'}\ntrain: {{loop: a.b:c, max_steps: 5}}\n"
                    "slurm: {account: mine, sbatch_extra: {time-min: '10'}}\nuser: {eval_every: 50, data: {name: x}}\n")
    return path


def test_the_profile_is_merged_under_the_config_files_and_the_overrides(xdg: Path, config: Path) -> None:
    cfg = load_config([config], ["slurm.qos=high", "profile=big"], Profiles(xdg))
    assert cfg.profile == "big"
    assert (cfg.slurm.partition, cfg.slurm.account, cfg.slurm.qos) == ("gpu", "mine", "high")  # profile<file<override
    assert cfg.slurm.setup == ["export PROFILE_SET=1"] and cfg.slurm.srun_args == ["--label"]
    assert cfg.slurm.sbatch_extra == {"mail-type": "END", "time-min": "10"}  # mappings merge key by key
    assert cfg.dist.nccl_env == {"NCCL_SOCKET_IFNAME": "ib0"}
    assert cfg.user == {"cluster": "big", "eval_every": 50, "data": {"name": "x"}}


def test_which_profile_the_flag_the_config_file_the_environment_or_none(xdg: Path, config: Path) -> None:
    (xdg / "small.yml").write_text("slurm: {partition: cpu}\n")
    assert load_config([config], [], Profiles(xdg)).profile == ""  # none chosen: nothing merged
    assert load_config([config], [], Profiles(xdg, default="small")).slurm.partition == "cpu"  # HPC_DDP_PROFILE
    config.write_text(config.read_text() + "profile: big\n")
    assert load_config([config], [], Profiles(xdg, default="small")).slurm.partition == "gpu"  # the file wins
    assert load_config([config], ["profile=small"], Profiles(xdg)).profile == "small"  # --profile wins
    plain = load_config([config], ["profile=none"], Profiles(xdg, default="small"))
    assert (plain.profile, plain.slurm.partition) == ("", None)
    assert load_config([config]).slurm.partition is None  # no Profiles (a rank reading config.yaml): a record


def test_profile_dir_follows_xdg_config_home_else_home() -> None:
    assert profile_dir({"XDG_CONFIG_HOME": "/x", "HOME": "/h"}) == Path("/x/hpc_ddp/profiles")
    assert profile_dir({"HOME": "/h"}) == Path("/h/.config/hpc_ddp/profiles")
    assert profile_dir({"XDG_CONFIG_HOME": "relative", "HOME": "/h"}) == Path("/h/.config/hpc_ddp/profiles")


def test_an_unknown_key_in_a_profile_is_refused_naming_the_profile_file(xdg: Path, config: Path) -> None:
    (xdg / "typo.yaml").write_text("slurm:\n  partiton: gpu\n")
    with pytest.raises(ConfigError) as err:
        load_config([config], ["profile=typo"], Profiles(xdg))
    assert f"unknown config key 'slurm.partiton' in profile typo ({xdg / 'typo.yaml'})" in str(err.value)
    assert "did you mean slurm.partition?" in str(err.value) and err.value.key == "slurm.partiton"
    (xdg / "named.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError, match="sets name, which a profile may not"):
        load_config([config], ["profile=named"], Profiles(xdg))


def test_a_missing_profile_is_refused_listing_the_ones_there_are_and_where(xdg: Path, config: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([config], ["profile=bgi"], Profiles(xdg))
    text = str(err.value)
    assert f"looked for {xdg / 'bgi.yaml'}" in text and f"one of the profiles in {xdg}: big" in text
    assert "--profile none" in text and err.value.key == "profile"
    with pytest.raises(ConfigError, match="HPC_DDP_PROFILE"):
        load_config([config], [], Profiles(xdg, default="gone"))
    with pytest.raises(ConfigError, match="without directory or suffix"):
        load_config([config], ["profile=big.yaml"], Profiles(xdg))


def test_user_settings_are_merged_overridden_and_read_by_attribute(config: Path) -> None:
    cfg = load_config([config], ["user.eval_every=100", "user.data.shards=[1,2]", "user.new=true",
                                 "train.args=[]"])
    assert cfg.user == {"eval_every": 100, "data": {"name": "x", "shards": [1, 2]}, "new": True}
    assert isinstance(cfg.user, UserSettings) and cfg.user.data.shards == [1, 2] and cfg.user["new"] is True
    with pytest.raises(AttributeError, match="user.missing=..."):
        cfg.user.missing  # noqa: B018
    assert flat_values(cfg)["user.data.name"] == "x" and "user" not in flat_values(cfg)
    again = load_config([save_config(cfg, config.parent / "saved.yaml")])  # round trip through config.yaml
    assert again.user == cfg.user and isinstance(again.user.data, UserSettings)
    script = config.parent / "s.yaml"  # train.args reads a user key by interpolation
    script.write_text("train: {script: t.py, args: [--eval_every, '${user.eval_every}']}\nuser: {eval_every: 7}\n")
    assert load_config([script]).train.args == ["--eval_every", "7"]


def test_a_script_gets_the_user_section_as_variables() -> None:
    env = user_environ({"eval_every": 100, "data": {"name": "tiny", "shards": [1, 2]}, "on": True, "lr-x": None})
    assert env == {"HPC_DDP_USER_EVAL_EVERY": "100", "HPC_DDP_USER_DATA_NAME": "tiny",
                   "HPC_DDP_USER_DATA_SHARDS": "[1, 2]", "HPC_DDP_USER_ON": "true", "HPC_DDP_USER_LR_X": "null",
                   "HPC_DDP_USER": json.dumps({"eval_every": 100, "data": {"name": "tiny", "shards": [1, 2]},
                                               "on": True, "lr-x": None})}


def test_an_unknown_train_or_top_level_key_points_to_the_user_section(config: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([config], ["train.eval_every=100"])
    assert "did you mean train.log_every? Your own settings go under user: (user.eval_every=...)" in str(err.value)
    with pytest.raises(ConfigError, match=r"your own settings go under user: \(user\.model\.hidden=\.\.\.\)"):
        load_config([config], ["model.hidden=3"])
    with pytest.raises(ConfigError) as err:
        load_config([config], ["slurm.partiton=x"])
    assert "user" not in str(err.value).split("HINT:")[1]  # a cluster key's typo is only a typo


def test_resume_keeps_the_recorded_profile_and_shows_what_changed(xdg: Path, config: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    [cfg] = resolve_all([str(config), "profile=big"], False)
    write_config(cfg, resume=False)
    capsys.readouterr()
    [own] = resolve_all([str(config)], False, resume=True)  # no --profile now: the recorded one is compared
    assert own.profile == "big" and own.slurm.partition == "gpu" and capsys.readouterr().out == ""
    (xdg / "big.yaml").write_text(PROFILE.replace("partition: gpu", "partition: gpu2"))
    [own] = resolve_all([str(config)], False, resume=True)
    out = capsys.readouterr().out
    assert own.slurm.partition == "gpu" and "profile big differs in slurm.partition: 'gpu' -> 'gpu2'" in out
    (xdg / "other.yaml").write_text("slurm: {partition: cpu}\n")
    [own] = resolve_all([str(config), "profile=other"], False, resume=True)  # named now: compared, not merged
    out = capsys.readouterr().out
    assert (own.profile, own.slurm.partition) == ("big", "gpu") and "profile: 'big' -> 'other'" in out
    (xdg / "big.yaml").unlink()
    [own] = resolve_all([str(config.parent / "runs" / "run"), "user.eval_every=60"], False, resume=True)
    out = capsys.readouterr().out
    assert own.profile == "big" and "no profile named 'big'" in out and "goes on with its own config" in out
    write_config(own, resume=True)
    assert "user.eval_every: 50 -> 60" in capsys.readouterr().out


def test_the_profiles_command_lists_and_shows(xdg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    environ = {"XDG_CONFIG_HOME": str(xdg.parent.parent), "HPC_DDP_PROFILE": "big"}
    assert profiles_cli.main(["list"], environ) == 0
    assert f"big  {xdg / 'big.yaml'}  (default: HPC_DDP_PROFILE)" in capsys.readouterr().out
    assert profiles_cli.main(["show", "big"], environ) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# {xdg / 'big.yaml'}\n") and "partition: gpu" in out and "--label" in out
    assert profiles_cli.main(["show", "nope"], environ) == 2
    assert "one of the profiles in" in capsys.readouterr().err
    assert profiles_cli.main(["list"], {"XDG_CONFIG_HOME": str(xdg.parent.parent / "empty")}) == 0
    assert "no profiles in" in capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.profiles", "--help"], cwd="/", capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0 and "python -m hpc_ddp.profiles show mycluster" in proc.stdout


def test_status_names_the_profile(xdg: Path, config: Path) -> None:
    [cfg] = resolve_all([str(config), "profile=big"], False)
    write_config(cfg, resume=False)
    info = collect(Path(cfg.run_dir))
    assert info["profile"] == "big" and "profile big" in render(info)


def test_submit_dry_run_with_the_flag_or_the_variable(xdg: Path, config: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.login.submit import main

    assert main(["--profile", "big", str(config), "--dry-run", "--no-preflight"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --partition=gpu" in out and "export PROFILE_SET=1" in out and "srun" in out and "--label" in out
    assert "profile: big (merged under the config files" in out
    monkeypatch.setenv("HPC_DDP_PROFILE", "nope")
    assert main([str(config), "--dry-run", "--no-preflight"]) == 2
    assert "no profile named 'nope' (HPC_DDP_PROFILE)" in capsys.readouterr().err
    assert main(["--profile", "none", str(config), "--dry-run", "--no-preflight"]) == 0
    assert "--partition" not in capsys.readouterr().out
