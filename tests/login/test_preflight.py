"""Preflight: every check with the message it prints, and a real refusal before submitting."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hpc_ddp.core.config import load_config
from hpc_ddp.login.preflight import (check_commands, check_geometry, check_partition, check_run_dir,
                                     check_run_dir_writers, check_signal_delay, check_task, find_module)

ROOT = Path(__file__).resolve().parents[2]


def config(*overrides: str):
    return load_config([ROOT / "examples" / "mlp.yaml"], list(overrides))


def sinfo(stdout: str, returncode: int = 0):
    def runner(cmd, **_kwargs):
        assert cmd[:3] == ["sinfo", "-h", "-o"]
        return subprocess.CompletedProcess(cmd, returncode, stdout, "sinfo: error: no controller")
    return runner


def test_missing_slurm_commands_are_named() -> None:
    [finding] = check_commands(lambda cmd: None if cmd in ("sbatch", "sinfo") else f"/usr/bin/{cmd}")
    assert finding.level == "error" and "not found: sbatch, sinfo" in finding.message and "--local" in finding.hint
    assert check_commands(lambda cmd: f"/usr/bin/{cmd}") == []


def test_unknown_partition_lists_the_real_ones() -> None:
    [finding] = check_partition("gpu", sinfo("debug*\nhigh\n"))
    assert finding.level == "error" and finding.key == "slurm.partition"
    assert "partition 'gpu' does not exist; sinfo lists debug, high" in finding.message
    assert check_partition("debug", sinfo("debug*\nhigh\n")) == []  # the default's '*' is not part of the name
    assert check_partition(None, sinfo("")) == []  # the cluster's default partition


def test_failing_sinfo_is_a_warning_not_a_guess() -> None:
    [finding] = check_partition("gpu", sinfo("", returncode=1))
    assert finding.level == "warning" and "sinfo failed: sinfo: error: no controller" in finding.message


def test_run_dir_that_cannot_be_created_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    [finding] = [f for f in check_run_dir(tmp_path / "file" / "run", mounts="") if f.level == "error"]
    assert f"cannot write the run dir {tmp_path / 'file' / 'run'}" in finding.message and "run_dir=" in finding.hint


def test_node_local_run_dirs_are_warned_about() -> None:
    [under_tmp] = check_run_dir(Path("/tmp/runs/x"), mounts="")
    assert under_tmp.level == "warning" and "looks node-local (it is under /tmp)" in under_tmp.message
    mounts = "/dev/sda1 / ext4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\n/dev/sdb /home ext4 rw 0 0\n"
    [ram] = [f for f in check_run_dir(Path("/scratch/u/run"), mounts=mounts) if f.level == "warning"]
    assert "(/scratch is tmpfs)" in ram.message and "shared filesystem" in ram.hint
    assert [f for f in check_run_dir(Path("/home/u/run"), mounts=mounts) if f.level == "warning"] == []


def test_a_run_dir_others_may_write_is_warned_about_unless_run_dir_mode_says_so(tmp_path: Path) -> None:
    """Whoever can write the run dir, its slurm/ (submitit's pickles) or compile_cache/ runs code as you."""
    run_dir = tmp_path / "run"
    assert check_run_dir_writers(config(f"run_dir={run_dir}")) == []  # not made yet: submit makes it 0700
    (run_dir / "slurm").mkdir(parents=True)
    run_dir.chmod(0o775)
    [group] = check_run_dir_writers(config(f"run_dir={run_dir}"))
    assert (group.level, group.key) == ("warning", "run_dir_mode")
    assert f"{run_dir} can be written by its group (mode 0775)" in group.message and "run code as you" in group.message
    assert group.hint.startswith(f"chmod go-w {run_dir}") and "run_dir_mode: '0770'" in group.hint
    assert check_run_dir_writers(config(f"run_dir={run_dir}", "run_dir_mode='0770'")) == []  # shared on purpose
    (run_dir / "slurm").chmod(0o777)
    [everyone] = check_run_dir_writers(config(f"run_dir={run_dir}", "run_dir_mode='0770'"))
    assert f"{run_dir / 'slurm'} can be written by everyone (mode 0777)" in everyone.message
    assert everyone.hint == f"chmod go-w {run_dir / 'slurm'}"


def test_signal_delay_that_wastes_the_attempt_or_leaves_no_time() -> None:
    [wasteful] = check_signal_delay(config("slurm.timeout_min=10", "slurm.signal_delay_s=300"))
    assert "each attempt gives up 50% of its time" in wasteful.message and wasteful.key == "slurm.signal_delay_s"
    [short] = check_signal_delay(config("slurm.signal_delay_s=10"))
    assert "only 10s before the limit" in short.message and "slurm.signal_delay_s=120" in short.hint
    assert check_signal_delay(config()) == []


def test_tasks_per_node_against_gpus_per_node() -> None:
    [too_many] = check_geometry(config("slurm.gpus_per_node=4", "slurm.tasks_per_node=8"))
    assert too_many.level == "error" and "some tasks would have no GPU" in too_many.message
    assert "slurm.tasks_per_node=4" in too_many.hint
    [idle] = check_geometry(config("slurm.gpus_per_node=4", "slurm.tasks_per_node=2"))
    assert idle.level == "warning" and "2 GPUs per node stay idle" in idle.message
    [nccl] = check_geometry(config("dist.backend=nccl"))
    assert nccl.level == "error" and nccl.key == "dist.backend"
    assert check_geometry(config("slurm.gpus_per_node=2")) == []


def test_task_module_is_found_without_running_it(tmp_path: Path) -> None:
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    (package / "model.py").write_text("raise SystemExit('imported')\n")
    assert find_module("userpkg.model", [str(tmp_path)]) and not (tmp_path / "ran").exists()
    assert not find_module("userpkg.nothing", [str(tmp_path)]) and not find_module("userpkg.model.x", [str(tmp_path)])
    assert check_task(config(), search=[str(ROOT)]) == []


def test_missing_task_module_is_an_error_unless_setup_lines_may_provide_it() -> None:
    [missing] = check_task(config("train.task=nowhere.tasks:Task"), search=[])
    assert missing.level == "error" and missing.key == "train.task"
    assert "module 'nowhere.tasks' of train.task=nowhere.tasks:Task is not importable" in missing.message
    assert "PYTHONPATH" in missing.hint
    [maybe] = check_task(config("train.task=nowhere.tasks:Task", "slurm.setup=[source env/bin/activate]"), search=[])
    assert maybe.level == "warning"


def test_the_local_clusters_shared_root_is_not_node_local() -> None:
    """/var/tmp/hpc_ddp-shared is where docs/slurm-local.md puts run dirs: each node sees it (its own cached
    view); the warning for /var/tmp is for a real cluster's node-local disk (a newcomer's trial met both)."""
    from hpc_ddp.slurm_local.conf import ClusterSpec

    assert check_run_dir(ClusterSpec.shared / "runs" / "x", mounts="") == []
    assert [f.level for f in check_run_dir(Path("/var/tmp/runs/x"), mounts="")] == ["warning"]


def test_the_preflights_local_cluster_root_is_the_local_clusters_and_the_cli_does_not_import_it() -> None:
    """The preflight names the local cluster's shared root without importing its package (~9 ms of every
    `submit --dry-run`, issue 56's B1): the two must not drift apart."""
    import subprocess
    import sys

    from hpc_ddp.login.preflight.run_dir import LOCAL_CLUSTER_SHARED
    from hpc_ddp.slurm_local.conf import ClusterSpec

    assert LOCAL_CLUSTER_SHARED == ClusterSpec.shared
    probe = "import sys, hpc_ddp.login.submit; print(sorted(m for m in sys.modules if 'slurm_local' in m))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_a_node_to_be_left_out_with_no_spare_and_a_fixed_size_is_a_warning_at_submit() -> None:
    from hpc_ddp.login.preflight import check_replace

    [found] = check_replace(config("slurm.straggler.action=replace", "slurm.nodes=2"))
    assert found.level == "warning" and found.key == "slurm.straggler.action"
    assert "no spare (slurm.spare_nodes=0) and a fixed slurm.nodes" in found.message and "kept" in found.hint
    [both] = check_replace(config("slurm.straggler.action=replace", "slurm.health.checks=quick", "slurm.nodes=2"))
    assert both.message.startswith("slurm.straggler.action and slurm.health.action=replace, but no spare")
    assert check_replace(config("slurm.health.checks=quick", "slurm.nodes=2"))  # its action is replace by default
    assert not check_replace(config("slurm.health.checks=off", "slurm.nodes=2"))  # nothing to replace
    assert not check_replace(config("slurm.straggler.action=replace", "slurm.nodes=2", "slurm.spare_nodes=1"))
    assert not check_replace(config("slurm.straggler.action=replace", "slurm.nodes=1-2", "train.global_batch_size=128"))
