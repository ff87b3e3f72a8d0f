"""Rank derivation from Slurm / torchrun / nothing: tables, every error path, and properties."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_ddp.core.errors import SlurmEnvError
from hpc_ddp.core.slurm_env import MASTER_PORT_BASE, MASTER_PORT_SPAN, SINGLE_PROCESS_PORT, DistEnv, from_environ, master_port, parse_tasks_per_node, simulated_environ, torch_env
from tests.helpers import FAKE_IMAGE, fake_apptainer


def srun_task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    """What srun gives one task of `srun -N2 --ntasks-per-node=4` in job 777 (as measured on Slurm 22.05)."""
    env = {"SLURM_JOB_ID": "777", "SLURM_JOBID": "777", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NODELIST": "gpu[01-02]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
           "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NPROCS": "8",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
           "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
           "SLURMD_NODENAME": f"gpu0{nodeid + 1}"}
    env.update(extra)
    return env


def test_one_node_one_task() -> None:
    env = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "1",
           "SLURM_TASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert from_environ(env) == DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                                        num_nodes=1, master_addr="n1", master_port=master_port(5), job_id=5,
                                        nodelist=("n1",), source="slurm")


def test_two_nodes_by_four_tasks() -> None:
    envs = [from_environ(srun_task(n * 4 + t, t, n)) for n in range(2) for t in range(4)]
    assert [e.rank for e in envs] == list(range(8))
    assert [e.local_rank for e in envs] == [0, 1, 2, 3] * 2
    assert [e.node_rank for e in envs] == [0] * 4 + [1] * 4
    assert {(e.master_addr, e.master_port, e.world_size, e.local_world_size, e.num_nodes) for e in envs} == {
        ("gpu01", master_port(777), 8, 4, 2)}
    assert envs[5].nodelist == ("gpu01", "gpu02") and envs[5].job_id == 777


def test_heterogeneous_tasks_per_node() -> None:
    base = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_NTASKS": "7",
            "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NUM_NODES": "3"}
    with pytest.raises(SlurmEnvError, match="does not match 3 nodes and 7 tasks"):
        from_environ({**base, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    base.update({"SLURM_STEP_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_NUM_NODES": "4"})
    last = from_environ({**base, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"})
    assert (last.local_world_size, last.node_rank, last.num_nodes, last.master_addr) == (1, 3, 4, "n1")
    with pytest.raises(SlurmEnvError, match="SLURM_LOCALID=1 does not fit tasks on node 3=1"):
        from_environ({**base, "SLURM_PROCID": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "3"})


def test_step_variables_win_over_job_variables() -> None:
    env = srun_task(1, 1, 0, SLURM_JOB_NODELIST="gpu[01-04]", SLURM_JOB_NUM_NODES="4", SLURM_NTASKS="16",
                    SLURM_TASKS_PER_NODE="4(x4)")
    got = from_environ(env)
    assert (got.nodelist, got.world_size, got.num_nodes) == (("gpu01", "gpu02"), 8, 2)


def test_torchrun_under_slurm_wins_over_slurm() -> None:
    env = srun_task(1, 0, 1, SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                    RANK="6", LOCAL_RANK="2", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
                    GROUP_WORLD_SIZE="2", MASTER_ADDR="gpu01", MASTER_PORT="29400", TORCHELASTIC_RUN_ID="none")
    got = from_environ(env)
    assert (got.rank, got.local_rank, got.world_size, got.local_world_size, got.node_rank, got.num_nodes) == (
        6, 2, 8, 4, 1, 2)
    assert (got.master_addr, got.master_port, got.source, got.job_id) == ("gpu01", 29400, "torchrun", 777)


def test_an_enroot_hooks_variables_in_a_slurm_step_give_way_to_slurms_with_one_warning() -> None:
    """Issue 57: enroot's PyTorch hook (or a site's wrapper) sets RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR
    from the job (no LOCAL_WORLD_SIZE, no TORCHELASTIC_RUN_ID): every rank used to fail on the torchrun path.
    After a heal that left out the job's first node, its MASTER_ADDR names a node the step does not run on."""
    from hpc_ddp.core import foreign_env

    hook = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu01", "OMP_NUM_THREADS": "1"}
    env = srun_task(5, 1, 1, **hook)
    got = from_environ(env)
    assert (got.rank, got.local_rank, got.world_size, got.local_world_size, got.source) == (5, 1, 8, 4, "slurm")
    assert foreign_env.disagreements(env, got) == []  # it agreed: nothing to say
    healed = srun_task(3, 1, 1, SLURM_STEP_NODELIST="gpu[02-03]", SLURM_JOB_NODELIST="gpu[01-03]",
                       SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)", **hook)
    got = from_environ(healed)
    assert (got.rank, got.world_size, got.master_addr, got.nodelist) == (3, 4, "gpu02", ("gpu02", "gpu03"))
    said = foreign_env.disagreements(healed, got)
    assert said == ["RANK=5 but Slurm says 3", "WORLD_SIZE=8 but Slurm says 4",
                    "MASTER_ADDR=gpu01 is a node of the job this step does not run on (the step's first node "
                    "gpu02 is used)"]
    assert "enroot's PyTorch hook" in foreign_env.warning(said)
    # the hook's fixed MASTER_PORT gives way too: two jobs on one node would share it
    fixed = srun_task(5, 1, 1, **hook, MASTER_PORT="29500")
    got = from_environ(fixed)
    assert got.master_port != 29500 and got.master_port == from_environ(env).master_port
    assert foreign_env.disagreements(fixed, got) == ["MASTER_PORT=29500 (set with them) gives way to the attempt's "
                                                     "own port"]
    # outside a step (torchrun alone, or a laptop) and under torchrun itself, the variables are torchrun's
    assert from_environ({**hook, "LOCAL_WORLD_SIZE": "4", "MASTER_PORT": "1"}).source == "torchrun"


def test_torchrun_alone_without_group_rank() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h",
           "MASTER_PORT": "1234"}
    got = from_environ(env)
    assert (got.node_rank, got.num_nodes, got.nodelist, got.job_id) == (1, 2, (), None)


def test_explicit_master_variables_win() -> None:
    got = from_environ(srun_task(0, 0, 0, MASTER_ADDR="10.0.0.7", MASTER_PORT="40000"))
    assert (got.master_addr, got.master_port) == ("10.0.0.7", 40000)


def test_array_job_ports_differ_per_element_and_agree_within_one() -> None:
    ports = set()
    for task in range(4):
        envs = [srun_task(r, r % 4, r // 4, SLURM_JOB_ID=str(800 + task), SLURM_ARRAY_JOB_ID="800",
                          SLURM_ARRAY_TASK_ID=str(task)) for r in range(8)]
        derived = {from_environ(e).master_port for e in envs}
        assert len(derived) == 1
        ports |= derived
        assert from_environ(envs[0]).array_task_id == task
    assert ports == {master_port(800, t) for t in range(4)} and len(ports) == 4


def test_restart_count() -> None:
    assert from_environ(srun_task(0, 0, 0, SLURM_RESTART_COUNT="3")).restart_count == 3


def test_single_process() -> None:
    assert from_environ({}) == DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", SINGLE_PROCESS_PORT)
    assert from_environ({"MASTER_PORT": "2222"}).master_port == 2222


ERRORS = [
    # (environment, variable named, words in the message)
    ({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_PROCID": "0"}, "SLURM_STEP_ID", "srun"),
    (srun_task(8, 0, 1), "SLURM_PROCID", "SLURM_PROCID=8 does not fit SLURM_STEP_NUM_TASKS=8"),
    (srun_task(0, 4, 0), "SLURM_LOCALID", "tasks on node 0=4"),
    (srun_task(0, 0, 2), "SLURM_NODEID", "number of nodes=2"),
    (srun_task(0, 0, 0, SLURM_LOCALID="x"), "SLURM_LOCALID", "an integer >= 0"),
    (srun_task(0, 0, 0, SLURM_STEP_NUM_TASKS="0"), "SLURM_STEP_NUM_TASKS", "an integer >= 1"),
    (srun_task(0, 0, 0, SLURM_PROCID="-1"), "SLURM_PROCID", "an integer >= 0"),
    (srun_task(0, 0, 0, SLURM_STEP_NODELIST="gpu[01-"), "SLURM_STEP_NODELIST", "never closed"),
    (srun_task(0, 0, 0, SLURM_STEP_NODELIST="gpu[01-03]"), "SLURM_STEP_NUM_NODES", "names 3 nodes"),
    (srun_task(0, 0, 0, SLURM_STEP_TASKS_PER_NODE="4(x3)"), "SLURM_STEP_TASKS_PER_NODE", "does not match"),
    (srun_task(0, 0, 0, SLURM_STEP_TASKS_PER_NODE="four"), "SLURM_STEP_TASKS_PER_NODE", "cannot read tasks per node"),
    (srun_task(0, 0, 0, MASTER_PORT="70000"), "MASTER_PORT", "1..65535"),
    (srun_task(0, 0, 0, MASTER_PORT="abc"), "MASTER_PORT", "an integer >= 1"),
    ({"MASTER_PORT": "99999999999999999999"}, "MASTER_PORT", "1..65535"),
    ({k: v for k, v in srun_task(0, 0, 0).items() if k != "SLURM_NODEID"}, "SLURM_NODEID", "is missing"),
    ({k: v for k, v in srun_task(0, 0, 0).items() if "TASKS_PER_NODE" not in k}, "SLURM_TASKS_PER_NODE",
     "is missing"),
    ({k: v for k, v in srun_task(0, 0, 0).items() if "NODELIST" not in k}, "SLURM_JOB_NODELIST", "no node list"),
    ({k: v for k, v in srun_task(0, 0, 0).items() if "JOB" not in k}, "MASTER_PORT", "rendezvous port"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK", "is missing"),
    ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "h"}, "RANK",
     "RANK=2 does not fit WORLD_SIZE=2"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h"},
     "LOCAL_WORLD_SIZE", "does not fit WORLD_SIZE=2"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, "MASTER_ADDR",
     "rendezvous address"),
]


@pytest.mark.parametrize(("env", "key", "words"), ERRORS)
def test_errors_name_the_variable_and_the_fix(env: dict[str, str], key: str | None, words: str) -> None:
    with pytest.raises(SlurmEnvError) as info:
        from_environ(env)
    assert info.value.key == key
    assert words in str(info.value) and "HINT:" in str(info.value)
    if key:
        assert key in str(info.value)


@pytest.mark.parametrize(("text", "expected"), [("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]),
                                                ("1,2,3", [1, 2, 3]), ("8(x1)", [8])])
def test_parse_tasks_per_node(text: str, expected: list[int]) -> None:
    assert parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "2(x)", "(x2)", "2x3", "2(x3", "a", "2,,1", "-1", "1(x9999999)"])
def test_parse_tasks_per_node_errors(text: str) -> None:
    with pytest.raises(SlurmEnvError, match="cannot read tasks per node"):
        parse_tasks_per_node(text)


@given(st.integers(0, 2**40), st.none() | st.integers(0, 100000))
def test_master_port_is_in_the_documented_range(job_id: int, task: int | None) -> None:
    port = master_port(job_id, task)
    assert MASTER_PORT_BASE <= port < MASTER_PORT_BASE + MASTER_PORT_SPAN < 32768  # below the ephemeral range
    assert port == master_port(job_id, task)


def test_nearby_jobs_never_share_a_port() -> None:
    assert len({master_port(j) for j in range(123_000, 123_000 + MASTER_PORT_SPAN)}) == MASTER_PORT_SPAN


def test_torch_env() -> None:
    env = from_environ(srun_task(6, 2, 1))
    assert torch_env(env) == {"MASTER_ADDR": "gpu01", "MASTER_PORT": str(master_port(777)), "RANK": "6",
                              "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 10**7), st.integers(0, 5))
def test_simulated_job_derives_a_consistent_layout(nodes: int, tasks: int, job_id: int, restarts: int) -> None:
    envs = [from_environ(e) for e in simulated_environ(nodes, tasks, job_id=job_id, restart_count=restarts)]
    assert [e.rank for e in envs] == list(range(nodes * tasks))
    assert [e.local_rank for e in envs] == list(range(tasks)) * nodes
    assert [e.node_rank for e in envs] == [n for n in range(nodes) for _ in range(tasks)]
    assert {(e.master_addr, e.master_port, e.restart_count, e.source) for e in envs} == {
        ("node0", master_port(job_id), restarts, "slurm")}


SLURM_NAMES = ["SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
               "SLURM_STEP_NUM_TASKS", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_JOB_NUM_NODES",
               "SLURM_TASKS_PER_NODE", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT",
               "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"]
values = st.one_of(st.integers(-3, 20).map(str), st.sampled_from(["n[1-2]", "2(x2)", "n1", "", "x", "1(x", "[",
                                                                   "99999999999999999999"]), st.text(max_size=8))


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.sampled_from(SLURM_NAMES), values, max_size=12))
def test_random_environments_raise_only_slurm_env_error(env: dict[str, str]) -> None:
    try:
        got = from_environ(env)
    except SlurmEnvError as err:
        assert str(err)
        return
    assert 0 <= got.rank < got.world_size and 0 <= got.local_rank < got.local_world_size
    assert 0 <= got.node_rank < got.num_nodes and 1 <= got.master_port <= 65535


def test_a_task_with_no_rank_variables_in_a_run_of_four_is_refused_naming_the_cleared_environment(
        tmp_path: Path) -> None:
    """--cleanenv (or env -i) leaves a task no Slurm variable: alone it is rank 0 of 1. A run asking for 2 x 2
    refuses it before the run dir is touched; a run of one rank, and a node range that allows one, do not."""
    import subprocess
    import sys

    from hpc_ddp.core.foreign_env import launched_alone

    alone = from_environ({"PATH": "/usr/bin"})
    why = launched_alone(alone, 2, 2)
    assert why is not None and "slurm.nodes=2 x slurm.tasks_per_node=2 = 4 ranks" in why and "--cleanenv" in why
    assert launched_alone(alone, 1, 1) is None and launched_alone(alone, "1-4", 1) is None
    step = simulated_environ(2, 2, job_id=7)[3]
    assert launched_alone(from_environ(step), 2, 2) is None
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"name: r\nrun_dir: {run_dir}\ntrain: {{task: 'tests.tasks:Faulty', "
                                         "max_steps: 10}\nslurm: {nodes: 2, tasks_per_node: 2}\n")
    # task 3 of a 2 x 2 step, launched as a site's srun line would: through the (stand-in) apptainer with
    # --cleanenv, which passes no host variable; PYTHONPATH reaches the task the way Apptainer documents
    # (APPTAINERENV_), the step's SLURM_* variables do not
    fake_apptainer(tmp_path / "container")
    runtime = tmp_path / "container" / "container-bin" / "apptainer"
    env = {**step, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "APPTAINERENV_PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([str(runtime), "exec", "--cleanenv", FAKE_IMAGE, sys.executable, "-m", "hpc_ddp.worker",
                           "--config", str(run_dir / "config.yaml")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "found no rank variables" in proc.stderr and "HINT:" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # nothing written in the run dir
