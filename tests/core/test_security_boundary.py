"""The trust boundary (issue 61, docs/security.md): the run dir is created closed to others whatever the umask
(run_dir_mode opens it on purpose), a run dir others may write is warned about as each attempt starts, and a
value from ``${oc.env:...}`` never lands in the run dir while the ranks still get it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.core.config import flat_values, load_config, save_config, to_yaml
from hpc_ddp.core.errors import ConfigError
from hpc_ddp.core.run_dir_mode import run_dir_folders
from hpc_ddp.rundir import layout

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-0f-the-test"
VAR = "HPC_DDP_TEST_SECRET"


@pytest.fixture()
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_run_dir_is_closed_to_others_whatever_the_umask(tmp_path: Path, umask_022: None) -> None:
    cfg = load_config([], ["name=closed", f"run_dir={tmp_path / 'runs' / 'closed'}", "train.task=m:T",
                           "train.max_steps=1"])
    save_config(cfg, layout.config(cfg.run_dir))
    assert mode(Path(cfg.run_dir)) == 0o700
    assert mode(tmp_path / "runs") == 0o755  # its parents are the umask's business


def test_run_dir_mode_opens_it_to_a_group_and_keeps_a_setgid_parents_bit(tmp_path: Path, umask_022: None) -> None:
    shared = tmp_path / "group"
    shared.mkdir()
    shared.chmod(0o2770)
    if not mode(shared) & stat.S_ISGID:
        pytest.skip("this filesystem does not keep a directory's setgid bit")
    cfg = load_config([], ["name=team", f"run_dir={shared / 'team'}", "train.task=m:T", "train.max_steps=1",
                           "run_dir_mode='0770'"])
    save_config(cfg, layout.config(cfg.run_dir))
    assert mode(Path(cfg.run_dir)) == 0o2770  # group-writable as asked; files made in it keep the folder's group
    assert "run_dir_mode: '0770'" in layout.config(cfg.run_dir).read_text()


@pytest.mark.parametrize("value, words", [
    ("0777", "others could write it"), ("0570", "you could not use it yourself"), ("rwx", "four octal digits"),
    ("750", "with its leading 0, quoted: run_dir_mode: '0750'"), ("488", "YAML reads an unquoted 0750 as the number 488"),
    ("0000", "your own digit must be 7")])
def test_run_dir_mode_is_checked_with_a_fix(value: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([], ["name=x", "train.task=m:T", "train.max_steps=1", f"run_dir_mode='{value}'"])
    assert err.value.key == "run_dir_mode" and words in str(err.value) and "HINT:" in str(err.value)
    with pytest.raises(ConfigError, match="the number 488"):  # what YAML makes of run_dir_mode: 0750 unquoted
        load_config([], ["name=x", "train.task=m:T", "train.max_steps=1", "run_dir_mode=0750"])


def test_rank_zero_warns_of_a_run_dir_others_may_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hpc_ddp.rank.worker import warn_writers

    cfg = load_config([], ["name=open", f"run_dir={tmp_path / 'open'}", "train.task=m:T", "train.max_steps=1"])
    (tmp_path / "open" / "compile_cache").mkdir(parents=True)
    (tmp_path / "open").chmod(0o700)
    (tmp_path / "open" / "compile_cache").chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        warn_writers(cfg)
    [record] = caplog.records
    assert f"{tmp_path / 'open' / 'compile_cache'} can be written by everyone (mode 0777)" in record.getMessage()
    assert f"HINT: chmod go-w {tmp_path / 'open' / 'compile_cache'}" in record.getMessage()


def test_the_folders_checked_are_the_layouts() -> None:
    assert run_dir_folders("/r") == [Path("/r"), layout.slurm_logs("/r"), Path("/r") / layout.COMPILE_CACHE]


def test_env_values_are_written_as_interpolations_and_resolved_when_read(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, SECRET)
    monkeypatch.setenv("HPC_DDP_TEST_STEPS", "7")
    cfg = load_config([], ["name=env", f"run_dir={tmp_path / 'env'}", "train.script=train.py",
                           "train.max_steps=${oc.env:HPC_DDP_TEST_STEPS}", f"user.token=${{oc.env:{VAR}}}",
                           "train.args=[--token, '${user.token}', '${name}']", "user.plain=${name}"])
    assert (cfg.user["token"], cfg.train.args, cfg.train.max_steps) == (SECRET, ["--token", SECRET, "env"], 7)
    text = save_config(cfg, layout.config(cfg.run_dir)).read_text()
    assert SECRET not in text and f"token: ${{oc.env:{VAR}}}" in text and "- ${user.token}" in text
    assert "max_steps: ${oc.env:HPC_DDP_TEST_STEPS}" in text and "plain: env" in text  # ${name}: resolved
    flat = flat_values(cfg)  # what a snapshot manifest and TensorBoard record
    assert flat["user.token"] == f"${{oc.env:{VAR}}}" and flat["train.max_steps"] == 7  # a number stays one
    monkeypatch.setenv(VAR, "another")
    again = load_config([layout.config(cfg.run_dir)])
    assert again.user["token"] == "another" and again.train.args[1] == "another"  # each reader resolves it
    assert to_yaml(again) == text  # the same config hash on every rank, whatever the environment
    cfg.user["token"] = "set later"  # a value changed after loading is written as it is
    assert "token: set later" in to_yaml(cfg)


def test_resume_compares_the_interpolation_not_the_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.login.guards import write_config

    monkeypatch.setenv(VAR, SECRET)
    items = ["name=res", f"run_dir={tmp_path / 'res'}", "train.task=m:T", "train.max_steps=1",
             f"user.token=${{oc.env:{VAR}}}"]
    write_config(load_config([], items), resume=False)
    monkeypatch.setenv(VAR, "rotated")
    write_config(load_config([layout.config(tmp_path / "res")]), resume=True)
    out = capsys.readouterr().out
    assert "changed config" not in out and SECRET not in out and "rotated" not in out
    assert SECRET not in layout.config(tmp_path / "res").read_text()


@pytest.mark.slow
def test_a_rehearsal_gets_the_secret_and_leaves_no_copy_in_the_run_dir(tmp_path: Path) -> None:
    """``submit --local`` with ``user.token=${oc.env:HPC_DDP_TEST_SECRET}``: every rank resolves it (the loop
    writes its digest), and no file of the run dir holds the value (config.yaml, manifests, ledger, logs)."""
    run_dir = tmp_path / "secret"
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "--local", "name=secret", f"run_dir={run_dir}",
           "train.loop=tests.tasks.secret:digests_user_token", "slurm.nodes=1", "slurm.tasks_per_node=2",
           "snapshot.every_steps=1", f"user.token=${{oc.env:{VAR}}}", "user.copy=${user.token}"]
    env = {**os.environ, VAR: SECRET, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    for rank in (0, 1):
        assert json.loads((run_dir / f"token-{rank}.json").read_text()) == {"token": digest, "copy": digest}
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert layout.config(run_dir) in files and any(path.name == "manifest.json" for path in files)
    assert [path for path in files if SECRET.encode() in path.read_bytes()] == []
    assert mode(run_dir) == 0o700


def test_dry_run_shows_a_secret_from_the_environment_as_its_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run output gets pasted into tickets: a script argument from ${oc.env:...} shows as that text."""
    from hpc_ddp.login.submit import main

    (tmp_path / "train.py").write_text("")
    (tmp_path / "s.yaml").write_text('name: dr\ntrain:\n  script: train.py\n  args: ["--token", '
                                     '"${oc.env:HPC_DDP_TEST_SECRET}"]\n  max_steps: 5\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPC_DDP_TEST_SECRET", "s3cr3t-8675309")
    assert main([str(tmp_path / "s.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "program: python train.py --token '${oc.env:HPC_DDP_TEST_SECRET}'" in out and "8675309" not in out
