"""Fuzzing the inputs a user or a cluster hands us: only HpcDdpError comes out, naming the key or variable.

Each property runs 1000 cases (hypothesis, no deadline; a few seconds each here).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from hypothesis import example, HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_ddp.rundir import snapshot
from hpc_ddp.core.config import load_config, schema_rows
from hpc_ddp.core.errors import ConfigError, HpcDdpError, SlurmEnvError
from hpc_ddp.core.hostlist import expand_hostlist
from hpc_ddp.core.slurm_env import JOB_ID_VARS, NODELIST_VARS, NUM_NODES_VARS, STEP_ID_VARS, TASKS_PER_NODE_VARS, TORCHRUN_VARS, WORLD_SIZE_VARS, from_environ

CASES = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# load_config runs omegaconf's merge and the schema checks (~30 ms): 300 drawn dotlists (fixed in CI, new ones on a
# developer's runs) and the explicit examples; the pure parsers above and below take 1000
CONFIG_CASES = settings(CASES, max_examples=300)
KEYS = [key for key, *_ in schema_rows()]
VALUES = st.one_of(st.text(max_size=12), st.integers(-10**12, 10**12).map(str), st.floats().map(str),
                   st.sampled_from(["null", "true", "[]", "{}", "[1,[2]]", "{a: 1}", "${x}", "'", "USR1", "nccl",
                                    "-1", "0", "1e400", "nan"]))


@CONFIG_CASES
@given(st.lists(st.one_of(st.tuples(st.sampled_from(KEYS + ["train", "slurm.sbatch_extra.a", "x.y", "name"]),
                                    VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"),
                          st.text(max_size=20)), min_size=1, max_size=4))
@example(["name=${x}"])  # found by a random run: the name's interpolation escaped as an omegaconf error
def test_dotlists_fail_only_with_a_config_error_that_names_the_key(overrides: list[str]) -> None:
    try:
        load_config([], ["name=fuzz", "train.task=a.b:C", "train.max_steps=1", *overrides])
    except ConfigError as err:
        assert err.key, f"no key named for {overrides!r}: {err}"
        head = err.key.split("[")[0].split(".")[0]
        empty = err.key == "<empty override>" and "found ''" in str(err)
        assert empty or head in str(err) or head in " ".join(overrides), (err.key, str(err))


SLURM_VARS = sorted({*WORLD_SIZE_VARS, *NUM_NODES_VARS, *NODELIST_VARS, *TASKS_PER_NODE_VARS, *JOB_ID_VARS,
                     *STEP_ID_VARS, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_ARRAY_JOB_ID",
                     "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                     "GROUP_WORLD_SIZE"})
ENV_VALUES = st.one_of(st.integers(-3, 70000).map(str), st.sampled_from(["n[1-2]", "n1,n2", "2(x2)", "1,3", "",
                                                                        "gpu[01-04]", "x", "4(x", "n[2-1]"]),
                       st.text(max_size=8))


@CASES
@given(st.dictionaries(st.sampled_from(SLURM_VARS + list(TORCHRUN_VARS)), ENV_VALUES, max_size=12))
def test_slurm_environments_fail_only_with_an_error_that_names_the_variable(env: dict[str, str]) -> None:
    try:
        from_environ(env)
    except SlurmEnvError as err:
        assert err.key, f"no variable named for {env!r}: {err}"
        assert err.key in str(err) or err.key in env, (err.key, str(err))


@CASES
@given(st.text(alphabet="abn01239-[],. x", max_size=24) | st.text(max_size=16))
def test_hostlists_fail_only_with_a_slurm_env_error(text: str) -> None:
    try:
        hosts = expand_hostlist(text)
    except SlurmEnvError as err:
        assert str(err)
    else:
        assert all(isinstance(h, str) and h for h in hosts)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 10**10) | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=3), max_leaves=8)
MANIFESTS = st.fixed_dictionaries({}, optional={
    "step": st.integers(-2, 10**9) | JSON, "world_size": JSON,
    "files": st.dictionaries(st.sampled_from(["node-00000.pt", "node-00001.pt", "../escape.pt", "x"]),
                             st.fixed_dictionaries({}, optional={"size": st.integers(-1, 40) | JSON,
                                                                 "sha256": st.text(max_size=64) | JSON}) | JSON,
                             max_size=3)}) | JSON


@CASES
@given(manifest=MANIFESTS, payload=st.binary(max_size=40), dir_step=st.integers(0, 3))
def test_tampered_manifests_give_a_choice_or_an_error_that_names_the_file(manifest: object, payload: bytes,
                                                                         dir_step: int) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="fuzz-manifest-"))
    try:
        directory = snapshot.step_dir(run_dir, dir_step)
        directory.mkdir(parents=True)
        (directory / "node-00000.pt").write_bytes(payload)
        (directory / snapshot.MANIFEST).write_text(json.dumps(manifest))
        try:
            choice = snapshot.choose(run_dir)
        except HpcDdpError as err:
            assert str(directory) in str(err)  # the error names the file that failed to verify
        else:
            if choice is not None:
                assert choice.step == dir_step and all((directory / name).is_file() for name in choice.good_files)
                assert all("/" not in name for name in choice.good_files)
    finally:
        shutil.rmtree(run_dir)
