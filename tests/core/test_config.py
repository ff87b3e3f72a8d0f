"""Config: YAML + dotlist overrides against the schema, every error in the house style, round trips."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hpc_ddp.core.config import RunConfig, load_config, save_config, schema_rows, to_yaml
from hpc_ddp.core.config.rules import OPTIONAL, RULES
from hpc_ddp.core.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mlp.yaml"
MINIMAL = "train:\n  task: examples.mlp:MLPTask\n  max_steps: 50\n"


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.yaml"
    path.write_text(MINIMAL)
    return path


def test_minimal_file_gets_defaults_and_its_name(cfg_file: Path) -> None:
    cfg = load_config([cfg_file])
    assert (cfg.name, cfg.run_dir, cfg.train.task, cfg.train.max_steps) == ("mlp", "runs/mlp",
                                                                            "examples.mlp:MLPTask", 50)
    assert cfg.slurm == RunConfig().slurm and cfg.snapshot.keep_last == 2


def test_files_merge_in_order_then_overrides(cfg_file: Path, tmp_path: Path) -> None:
    second = tmp_path / "big.yaml"
    second.write_text("slurm:\n  nodes: 4\n  setup: [module load cuda]\ntrain:\n  lr: 0.5\n")
    cfg = load_config([cfg_file, second], ["train.lr=0.01", "slurm.sbatch_extra.mail-type=END", "name=exp1"])
    assert (cfg.slurm.nodes, cfg.train.lr, cfg.name, cfg.run_dir) == (4, 0.01, "exp1", "runs/exp1")
    assert cfg.slurm.setup == ["module load cuda"] and cfg.slurm.sbatch_extra == {"mail-type": "END"}


def test_interpolation_and_signal_spelling(cfg_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    cfg = load_config([cfg_file], ["run_dir=${oc.env:SCRATCH}/runs/${name}", "slurm.signal=sigterm"])
    assert (cfg.run_dir, cfg.slurm.signal) == ("/scratch/me/runs/mlp", "TERM")


def test_resolved_config_round_trips(cfg_file: Path, tmp_path: Path) -> None:
    cfg = load_config([cfg_file], ["slurm.partition=gpu", "dist.nccl_env.NCCL_DEBUG=INFO", "train.amp=bf16"])
    written = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config([written]) == cfg
    assert not list(written.parent.glob(".*"))  # no temporary file left behind


def test_no_config_and_no_name() -> None:
    with pytest.raises(ConfigError, match="no name") as info:
        load_config([], ["train.max_steps=1"])
    assert info.value.key == "name"


ERRORS = [
    # (overrides, key named, words in the message)
    (["train.lrr=0.1"], "train.lrr", "did you mean train.lr?"),
    (["trian.lr=0.1"], "trian", "did you mean train?"),
    (["snapshot.async=true"], "snapshot.async", "did you mean snapshot.async_write?"),
    (["slurm.zzz=1"], "slurm.zzz", "one of the keys of slurm: nodes, tasks_per_node"),
    (["train.lr=abc"], "train.lr", "found 'abc'; expected a number"),
    (["slurm.nodes=1.5"], "slurm.nodes", "expected an integer"),
    (["slurm.exclusive=maybe"], "slurm.exclusive", "expected true or false"),
    (["slurm.nodes=null"], "slurm.nodes", "expected an integer"),
    (["slurm.setup=5"], "slurm.setup", "expected a list of text"),
    (["train=5"], "train", "train must be a section of keys"),
    (["slurm.nodes=0"], "slurm.nodes", "found 0; expected an integer >= 1"),
    (["train.lr=.inf"], "train.lr", "finite number > 0"),
    (["train.lr=-1"], "train.lr", "finite number > 0"),
    (["train.amp=fp8"], "train.amp", "one of off, bf16, fp16"),
    (["dist.backend=mpi"], "dist.backend", "one of auto, nccl, gloo"),
    (["dist.master_port=70000"], "dist.master_port", "1..65535"),
    (["train.task=mymodule"], "train.task", "'package.module:ClassName'"),
    (["train.task=''"], "train.task", "nothing to train: train.task, train.loop and train.script are all unset"),
    (["train.task="], "train.task", "nothing to train"),  # an empty YAML value is null: it unsets the key
    (["slurm.signal=USR1"], "slurm.signal", "NCCL uses SIGUSR1"),
    (["slurm.signal=BOGUS"], "slurm.signal", "a signal name"),
    (["slurm.timeout_min=1"], "slurm.signal_delay_s", "leaves no time to train"),
    (["train.max_steps=null"], "train.max_steps", "the run has no end"),
    (["slurm.setup=[a,[b]]"], "slurm.setup", "a list of shell lines"),
    (["slurm.sbatch_extra={--mail-type: END}"], "slurm.sbatch_extra", "without '--'"),
    (["dist.nccl_env={NCCL DEBUG: INFO}"], "dist.nccl_env", "environment variable names"),
    (["name=a/b"], "name", "it names a directory"),
    (["slurm.max_failures=-1"], "slurm.max_failures", "an integer >= 0"),
    (["slurm.partition='gpu debug'"], "slurm.partition", "without spaces"),
    (['slurm.sbatch_extra.comment="a\\nb"'], "slurm.sbatch_extra", "one-line"),
    (["train.lr=${oc.env:HPC_DDP_SURELY_UNSET}"], "train.lr", "HPC_DDP_SURELY_UNSET"),
    (["train.lr=[1"], "train.lr", "cannot parse the value"),
    (["nonsense"], "nonsense", "expected key=value"),
    (["=3"], "=3", "expected key=value"),
]


@pytest.mark.parametrize(("overrides", "key", "words"), ERRORS)
def test_errors_name_key_value_expectation_and_fix(cfg_file: Path, overrides: list[str], key: str | None,
                                                   words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([cfg_file], overrides)
    assert info.value.key == key and words in str(info.value)
    assert "HINT:" in str(info.value) or "expected" in str(info.value)
    assert "Traceback" not in str(info.value)


@pytest.mark.parametrize(("text", "words"), [("train: [1\n", "not valid YAML at line 2"),
                                             ("- a\n- b\n", "must hold a mapping"),
                                             ("train:\n  lr: !!python/object:os.system x\n", "not valid YAML")])
def test_bad_yaml_files(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        load_config([path])
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file .*No such file"):
        load_config([tmp_path / "nope.yaml"])


def test_every_key_is_documented_and_checked() -> None:
    rows = list(schema_rows())
    assert all(doc for _, _, _, doc in rows)
    keys = {key for key, _, _, _ in rows}
    bools = {key for key, tp, _, _ in rows if tp == "bool"}
    assert set(RULES) | bools == keys and OPTIONAL <= keys


# Random dotlists: tests/core/test_fuzz.py (its assertion is stronger: the error names the key).


texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=10)


# a setup line ending in one backslash would join the script's next line to it, and an sbatch_extra value cannot
# carry one through submitit's quoting: both refused (tests/core/test_script_safety.py)
shell_lines = texts.filter(lambda t: (len(t) - len(t.rstrip("\\"))) % 2 == 0)


@settings(max_examples=200, deadline=None)
@example(partition=None, setup=["\\${", "echo \\\\${X}", "a\\b${Y}"], lr=0.1, steps=1, extra={})  # found once
@given(partition=st.none() | st.from_regex(r"[A-Za-z0-9_,|-]{1,10}", fullmatch=True),
       setup=st.lists(shell_lines, max_size=3), lr=st.floats(1e-8, 10),
       steps=st.integers(1, 10**9), extra=st.dictionaries(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
                                                         texts.filter(lambda t: "\\" not in t), max_size=3))
def test_valid_configs_round_trip_through_yaml(tmp_path_factory: pytest.TempPathFactory, partition: str | None,
                                               setup: list[str], lr: float, steps: int,
                                               extra: dict[str, str]) -> None:
    cfg = RunConfig(name="rt", run_dir="/r/rt")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, task="a.b:C", max_steps=steps, lr=lr),
                              slurm=dataclasses.replace(cfg.slurm, partition=partition, setup=setup,
                                                        sbatch_extra=extra))
    path = tmp_path_factory.mktemp("rt") / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config([path]) == cfg


def test_shell_variables_in_setup_lines(tmp_path: Path) -> None:
    path = tmp_path / "sh.yaml"
    path.write_text(MINIMAL + "slurm:\n  setup: ['source \\${HOME}/venv/bin/activate', 'cd $SCRATCH']\n")
    cfg = load_config([path])
    assert cfg.slurm.setup == ["source ${HOME}/venv/bin/activate", "cd $SCRATCH"]
    assert load_config([save_config(cfg, tmp_path / "run" / "config.yaml")]) == cfg
    with pytest.raises(ConfigError, match=r"for a shell variable in a setup line write \$VAR") as info:
        load_config([path], ['slurm.setup=["source ${HOME}/x"]'])
    assert info.value.key == "slurm.setup[0]"


def test_null_unsets_a_text_key_and_a_required_key_says_what_to_give(tmp_path: Path) -> None:
    """`train.task=null` failed with "expected text": null now unsets a key whose default is empty, on the
    command line and in a file; a key that cannot be unset says so, with what to give and its default."""
    unset = load_config(["examples/mlp.yaml"], ["train.task=null", "train.loop=examples.own_loop_gpt:train"])
    assert (unset.train.task, unset.train.loop) == ("", "examples.own_loop_gpt:train")
    path = tmp_path / "loop.yaml"
    path.write_text("train:\n  task: ~\n  loop: examples.own_loop_gpt:train\n")
    assert load_config(["examples/mlp.yaml", path]).train.task == ""
    assert load_config(["examples/mlp.yaml"], ["slurm.mem_gb=null"]).slurm.mem_gb is None  # Optional: as before
    with pytest.raises(ConfigError) as err:
        load_config(["examples/mlp.yaml"], ["train.lr=null"])
    assert "train.lr cannot be unset (null): give a number, or leave it out for its default (0.001)" in str(err.value)


def test_off_is_off_on_the_command_line_and_in_a_file_though_yaml_reads_it_as_false(tmp_path: Path) -> None:
    """YAML 1.1 (omegaconf's) reads a bare off as false, and a string key then held 'False': `train.amp=off`, the
    documented value, was refused with "found 'False'; expected one of off, bf16, fp16"."""
    cfg = load_config([EXAMPLE], ["train.amp=off", "slurm.straggler.action=off",
                                                          "slurm.health.checks=off"])
    assert (cfg.train.amp, cfg.slurm.straggler.action, cfg.slurm.health.checks) == ("off", "off", "off")
    (tmp_path / "c.yaml").write_text("train:\n  amp: off\nslurm:\n  straggler:\n    action: off\n")
    cfg = load_config([EXAMPLE, tmp_path / "c.yaml"], [])
    assert (cfg.train.amp, cfg.slurm.straggler.action) == ("off", "off")
    with pytest.raises(ConfigError, match="slurm.health.action") as err:  # where off is no choice, false is wrong
        load_config([EXAMPLE], ["slurm.health.action=off"])
    assert "YAML reads a bare true, false, yes, no or on as a boolean" in str(err.value)
    with pytest.raises(ConfigError, match="YAML reads a bare"):
        load_config([EXAMPLE], ["train.amp=true"])


@pytest.mark.parametrize(("override", "example"), [("slurm.nodes=two", "for example slurm.nodes=1 (its default)"),
                                                   ("dist.liveness_s=-3", "for example dist.liveness_s=30 (its default)"),
                                                   ("train.lr=-1", "for example train.lr=0.001 (its default)")])
def test_a_bad_value_hints_at_a_good_one_not_only_where_to_set_it(override: str, example: str) -> None:
    """A newcomer who typed slurm.nodes=two on the command line was told to set slurm.nodes 'in the config file or
    as slurm.nodes=... on the command line': what they had done. The hint now shows a value the key takes."""
    with pytest.raises(ConfigError) as err:
        load_config([EXAMPLE], [override])
    assert f"HINT: {example}: change it where you set it" in str(err.value)
