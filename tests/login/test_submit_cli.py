"""The submit CLI without a cluster: --dry-run, --multirun layout, usage errors, status --plot, --endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config, save_config
from hpc_ddp.login.status import main as status
from hpc_ddp.login.submit import main as submit
from hpc_ddp.core.whoami import main as whoami
from hpc_ddp.rank.attempt.start import with_config_port

ROOT = Path(__file__).resolve().parents[2]
MLP = str(ROOT / "examples" / "mlp.yaml")


def test_dry_run_prints_the_sbatch_script_the_ranks_and_preflight(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = submit([MLP, "--dry-run", f"run_dir={tmp_path / 'r'}", "slurm.partition=gpu"])
    out = capsys.readouterr().out
    # no partition "gpu" where sinfo answers: an error, so the dry run fails as the submit would (issue 15)
    assert code == (2 if "error [slurm.partition]" in out else 0)
    assert "#SBATCH --signal=USR2@120" in out and "#SBATCH --partition=gpu" in out
    assert f"-m submitit.core._submit {tmp_path / 'r' / 'slurm'}" in out
    assert "master_addr" in out and "preflight:" in out
    # the teardown heals with steps of the worker on this run's config: its path, not submitit's placeholder
    assert f"-m hpc_ddp.worker --config {tmp_path / 'r' / 'config.yaml'}\n" in out and "{config}" not in out
    assert not (tmp_path / "r").exists()  # a dry run writes nothing


def test_multirun_dry_run_shows_one_array_element_per_combination(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert submit([MLP, "--dry-run", "--multirun", "train.lr=0.1,0.01", "train.seed=1,2",
                   f"run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-3%" in out and f"--output={tmp_path}/slurm/%A_%a_0_log.out" in out
    assert f"[3] {tmp_path}/lr=0.01,seed=2" in out
    # each element heals with its own config: the teardown's placeholder, said where the script is shown
    assert "--config '{config}'" in out and "({config} in the teardown line: each element's RUN_DIR/config.yaml)" in out


@pytest.mark.parametrize(("args", "words"), [
    (["--preempt-at", "3"], "--preempt-at, --timeout-at and --fail-at go with --local"),
    (["--launcher", "torchrun", "--dry-run"], "--launcher goes with --emit-sbatch"),
    (["--multirun", "--emit-sbatch", "x.sbatch", "train.lr=1,2"], "--multirun submits a job array"),
])
def test_usage_errors_say_what_goes_with_what(args: list[str], words: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert submit([MLP, *args]) == 2
    assert words in capsys.readouterr().err


def test_multirun_over_slurm_keys_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert submit([MLP, "--dry-run", "--multirun", "slurm.nodes=1,2"]) == 2
    assert "cannot vary slurm.nodes" in capsys.readouterr().err


def test_local_multirun_rehearses_every_combination(tmp_path: Path) -> None:
    assert submit([MLP, "--local", "--multirun", "train.lr=0.1,0.01", "slurm.nodes=1", "slurm.tasks_per_node=1",
                   "train.max_steps=5", f"run_dir={tmp_path}"]) == 0
    assert sorted(p.parent.name for p in tmp_path.glob("*/DONE.json")) == ["lr=0.01", "lr=0.1"]


def test_status_plot_draws_the_loss_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is in the dev extra that CI installs")
    save_config(load_config([MLP], [f"run_dir={tmp_path}"]), tmp_path / "config.yaml")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1 / s}) + "\n"
                                                    for s in range(1, 30)))
    assert status([str(tmp_path), "--plot", str(tmp_path / "loss.png")]) == 4  # drawn; no job, no ledger: state unknown
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_status_plot_without_metrics_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_config(load_config([MLP], [f"run_dir={tmp_path}"]), tmp_path / "config.yaml")
    assert status([str(tmp_path), "--plot", str(tmp_path / "loss.png")]) == 2
    assert "nothing to plot" in capsys.readouterr().err


def test_endpoint_for_torchrun_comes_from_the_batch_shell(capsys: pytest.CaptureFixture[str]) -> None:
    assert whoami(["--endpoint"], {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[3-4]"}) == 0
    assert capsys.readouterr().out.strip() == "gpu3:20077"


def test_config_master_port_applies_unless_the_environment_names_one() -> None:
    cfg = load_config([MLP], ["dist.master_port=29999"])
    assert with_config_port({"SLURM_JOB_ID": "1"}, cfg)["MASTER_PORT"] == "29999"
    assert with_config_port({"MASTER_PORT": "1234"}, cfg)["MASTER_PORT"] == "1234"
    assert "MASTER_PORT" not in with_config_port({}, load_config([MLP]))


def test_resume_continues_the_runs_own_config_with_only_the_new_overrides(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run started with train.lr=0.05 train.max_steps=30 and resumed with plain --resume kept the YAML's
    0.01 and 100 (issue 23): now the run's own config.yaml is the base, and only what the command line names
    changes. The CONFIG argument finds the run dir; the run dir itself may be given instead."""
    from hpc_ddp.login.resolve import resolve_all

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    save_config(load_config([MLP], [f"run_dir={run_dir}", "train.lr=0.05", "train.max_steps=30"]),
                run_dir / "config.yaml")
    plain = resolve_all([MLP, f"run_dir={run_dir}"], False, resume=True)[0]
    assert (plain.train.lr, plain.train.max_steps) == (0.05, 30)
    out = capsys.readouterr().out
    assert "differs in train.lr: 0.05 -> 0.01, train.max_steps: 30 -> 100, which is not applied" in out
    longer = resolve_all([MLP, f"run_dir={run_dir}", "train.max_steps=50"], False, resume=True)[0]
    assert (longer.train.lr, longer.train.max_steps, longer.run_dir) == (0.05, 50, str(run_dir))
    assert "differs in train.lr: 0.05 -> 0.01, which" in capsys.readouterr().out  # max_steps is named: not listed
    by_dir = resolve_all([str(run_dir), "train.max_steps=60"], False, resume=True)[0]
    assert (by_dir.train.lr, by_dir.train.max_steps) == (0.05, 60) and capsys.readouterr().out == ""
    fresh = resolve_all([MLP, f"run_dir={run_dir}"], False)[0]  # without --resume the YAML is the config
    assert fresh.train.lr == 0.01


def test_dry_run_shows_what_every_task_runs_and_emit_sbatch_names_the_program_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = str(ROOT / "examples" / "torchrun_script.yaml")
    assert submit([script, "--dry-run", "--no-preflight", f"run_dir={tmp_path / 's'}", "train.args=[--a,1]",
                   "train.resume_args=[--resume]"]) == 0
    out = capsys.readouterr().out
    assert "program: python examples/torchrun_script.py --a 1 (then on every attempt that continues the run: " \
           "+ --resume)" in out
    loop = str(ROOT / "examples" / "own_loop_gpt.yaml")
    assert submit([loop, "--emit-sbatch", str(tmp_path / "job.sbatch"), f"run_dir={tmp_path / 'l'}"]) == 0
    out = capsys.readouterr().out
    assert "where train.loop=examples.own_loop_gpt:train is imported from" in out and "train.task=" not in out


def test_a_list_override_with_an_interpolation_gets_the_quoted_form_to_type(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert submit([MLP, "--dry-run", "train.args=[--ckpt,${run_dir}/x]"]) == 2
    err = capsys.readouterr().err
    assert "quote an element that holds ${...}" in err and """'train.args=[--ckpt,"${run_dir}/x"]'""" in err


def test_every_command_says_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp import __version__

    for command in (submit, status, whoami):
        with pytest.raises(SystemExit) as end:
            command(["--version"])
        assert end.value.code == 0 and f"hpc_ddp {__version__}" in capsys.readouterr().out


@pytest.mark.parametrize("args, loads", [((), 1), (("train.script=x.py", "train.task=null",
                                                    'train.args=[--out,"${run_dir}/o"]'), 2)])
def test_a_relative_run_dir_is_merged_again_only_when_another_value_holds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], loads: int) -> None:
    """A second merge with the absolute run dir is a whole config load more for a dry run (benchmark
    B1): it is made only where a ${run_dir} elsewhere must read the absolute dir."""
    from hpc_ddp.login import resolve

    calls = []
    real = resolve.load_with_profile
    monkeypatch.setattr(resolve, "load_with_profile",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.chdir(tmp_path)
    cfg = resolve.resolve_all([MLP, *args], multirun=False)[0]
    assert len(calls) == loads and cfg.run_dir == str(tmp_path.resolve() / "runs" / "mlp")
    assert cfg.train.args == ([] if not args else ["--out", f"{cfg.run_dir}/o"])
