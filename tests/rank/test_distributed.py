"""Backend and device decisions (the NCCL path, without a GPU), and real gloo collectives."""

from __future__ import annotations

import multiprocessing

import pytest

from hpc_ddp.core.config import DistConfig
from hpc_ddp.rank.group.distributed import DistributedError, choose_backend, device_index
from hpc_ddp.core.slurm_env import DistEnv, from_environ
from tests.helpers import spawn_ranks


@pytest.mark.parametrize(("requested", "cuda", "expected"), [("auto", True, "nccl"), ("auto", False, "gloo"),
                                                             ("gloo", True, "gloo"), ("nccl", True, "nccl")])
def test_choose_backend(requested: str, cuda: bool, expected: str) -> None:
    assert choose_backend(requested, cuda) == expected


def test_nccl_without_cuda_says_what_to_do() -> None:
    with pytest.raises(DistributedError, match="dist.backend=auto") as info:
        choose_backend("nccl", False)
    assert info.value.key == "dist.backend"


def env(local_rank: int, local_world_size: int) -> DistEnv:
    return DistEnv(rank=local_rank, local_rank=local_rank, world_size=local_world_size,
                   local_world_size=local_world_size, node_rank=0, num_nodes=1, master_addr="h", master_port=1)


@pytest.mark.parametrize(("local_rank", "tasks", "gpus", "expected"), [
    (3, 4, 4, 3),  # every task sees all GPUs of the node: bind by local rank
    (3, 4, 1, 0),  # Slurm bound one GPU per task (--gpus-per-task / gpu-bind)
    (1, 2, 8, 1),
])
def test_device_index(local_rank: int, tasks: int, gpus: int, expected: int) -> None:
    assert device_index(env(local_rank, tasks), gpus) == expected


def test_more_tasks_than_gpus_is_a_geometry_error() -> None:
    with pytest.raises(DistributedError, match="tasks_per_node equal to slurm.gpus_per_node"):
        device_index(env(0, 4), 2)


def _timeout_s(group: object) -> float:
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # type: ignore[attr-defined]


def _rank_main(environ: dict[str, str], results: "multiprocessing.Queue[tuple[int, float, bool, bool, float, float]]") -> None:
    import os

    os.environ.update(environ)
    from hpc_ddp.rank.group import control
    from hpc_ddp.rank.group.distributed import all_mean, any_rank, init_process_group, teardown

    dist_env = from_environ(environ)
    device = init_process_group(dist_env, DistConfig(backend="gloo", timeout_s=30))
    assert init_process_group(dist_env, DistConfig(backend="gloo", timeout_s=30)) == device  # idempotent
    mean = all_mean(float(dist_env.rank), device)
    # the control group and its subgroups time out with the training group (2 x 30 + 30 s), not new_group's 30 minutes
    node = control.subgroup([dist_env.rank - dist_env.local_rank, dist_env.rank - dist_env.local_rank + 1])
    results.put((dist_env.rank, mean, any_rank(dist_env.rank == 2, device), any_rank(False, device),
                 _timeout_s(control.group()), _timeout_s(node)))
    teardown()
    teardown()


def test_real_gloo_collectives_across_four_processes() -> None:
    got = spawn_ranks(_rank_main, 2, 2, timeout=120)
    assert got == [(r, 1.5, True, False, 90.0, 90.0) for r in range(4)]


def test_failure_envs_reason_for_mode_1_is_what_torch_says_mode_1_does() -> None:
    """torch's docs: 0 no handling, 1 abort the communicator and tear the process down, 2 abort only, 3 (the
    default since 2.2) tear down without the abort. The docstring said 3 let a wedged communicator hold the
    process until the walltime: 3 ends the process too; what 1 buys over 0 is that a hung collective ends."""
    from hpc_ddp.rank.group.distributed import failure_env

    doc = " ".join((failure_env.__doc__ or "").split())
    assert "aborts the communicator and ends the process, so a hung NCCL collective ends its rank" in doc
    assert "instead of blocking it forever, as with 0 (no handling)" in doc
    assert "default since 2.2 is 3, which ends the process too but skips the abort" in doc
    assert "can then hold the process" not in doc


def test_failure_env_ends_nccl_failures_fast_and_keeps_the_users_choices() -> None:
    from hpc_ddp.rank.group.distributed import failure_env

    prefix = "/runs/x/errors/job-1-restart-0-collectives-rank-"
    ours = failure_env({}, prefix)
    assert ours["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # abort the communicator and end the process
    assert ours["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(ours["TORCH_FR_BUFFER_SIZE"]) > 0
    assert ours["TORCH_FR_DUMP_TEMP_FILE"] == prefix and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in ours  # deprecated
    older = failure_env({}, prefix, new_names=False)  # a torch before the TORCH_FR_* names
    assert older["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == prefix and int(older["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    users = failure_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, None)
    assert users == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # the user's choices under either name; no run dir given


def test_the_flight_summary_names_the_collective_waited_in_and_who_never_reached_it() -> None:
    from hpc_ddp.rundir.flight import summarize

    def dump(last: int, name: str) -> dict:
        return {"pg_status": {"0": {"last_enqueued_collective": str(last)}, "1": {"last_enqueued_collective": "4"}},
                "entries": [{"pg_id": 0, "collective_seq_id": last, "profiling_name": name, "is_p2p": False}]}

    lines = summarize({0: dump(52, "nccl:all_reduce"), 1: dump(51, "nccl:all_reduce"), 2: dump(52, "nccl:all_reduce")})
    assert lines == ["process group 0: ranks 0,2 wait in collective #52 (nccl:all_reduce); ranks 1 never reached "
                     "it (last: #51)"]  # group 1 is alike on every rank: not named
    assert summarize({0: dump(3, "x"), 1: dump(3, "x")}) == []


def test_the_flight_summary_names_the_first_collective_the_ranks_issued_differently() -> None:
    """An eval forward of the DDP model on rank 0 alone: its buffer broadcast meets the others' all_reduce."""
    from hpc_ddp.rundir.flight import summarize

    def dump(*ops: tuple[int, str, list]) -> dict:
        return {"pg_status": {"0": {"last_enqueued_collective": str(ops[-1][0])}},
                "entries": [{"pg_id": 0, "collective_seq_id": seq, "profiling_name": name, "input_sizes": sizes}
                            for seq, name, sizes in ops]}
    same = (52, "gloo:all_reduce", [[641]])
    lines = summarize({0: dump(same, (53, "gloo:broadcast", [[64]]), (54, "gloo:broadcast", [[1]])),
                       1: dump(same, (53, "gloo:all_reduce", [[3]]), (54, "gloo:broadcast", [[32]]),
                               (55, "gloo:broadcast", [[32]]))})
    assert lines == ["process group 0: the ranks issued different collectives at #53: ranks 0 gloo:broadcast of "
                     "[64]; ranks 1 gloo:all_reduce of [3] (a branch only some ranks take, e.g. a forward of the "
                     "DDP model on rank 0 alone: docs/troubleshooting.md)"]


def test_a_flight_dump_merges_the_nccl_recorder_with_the_gloo_one() -> None:
    """torch 2.11 keeps NCCL's entries (CUDA events) and gloo's in two recorders: on an H100 a dump of one held
    only the control group's gloo entries, and the training group's NCCL all_reduce was missing."""
    from hpc_ddp.rundir.flight import merged

    gloo = {"version": "2.10", "pg_status": {"1": {"last_enqueued_collective": "9"}},
            "entries": [{"pg_id": 1, "profiling_name": "gloo:all_reduce", "time_created_ns": 20}]}
    nccl = {"version": "2.10", "nccl_version": "2.28.9", "pg_status": {"0": {"last_enqueued_collective": "7"}},
            "entries": [{"pg_id": 0, "profiling_name": "nccl:all_reduce", "time_created_ns": 10}]}
    record = merged([gloo, nccl])
    assert [e["profiling_name"] for e in record["entries"]] == ["nccl:all_reduce", "gloo:all_reduce"]
    assert set(record["pg_status"]) == {"0", "1"} and record["nccl_version"] == "2.28.9"
    assert merged([]) == {"entries": []}


def test_a_scatter_or_gather_whose_root_alone_has_inputs_is_no_branch_of_the_program() -> None:
    """A newcomer's hang at 2x2: status said "the ranks issued different collectives at #4: ranks 0 gloo:scatter of
    [2, 16]; ranks 1 gloo:scatter of nothing" for hpc_ddp's own scatter (the root's inputs are the only ones). The
    name alone is compared for a scatter, a gather and an all_to_all; an all_reduce still compares sizes."""
    from hpc_ddp.rundir.flight import summarize

    def dump(*ops: tuple[int, str, list]) -> dict:
        return {"pg_status": {"1": {"last_enqueued_collective": str(ops[-1][0])}},
                "entries": [{"pg_id": 1, "collective_seq_id": seq, "profiling_name": name, "input_sizes": sizes}
                            for seq, name, sizes in ops]}
    lines = summarize({0: dump((4, "gloo:scatter", [[2, 16]]), (5, "gloo:gather", [[3]])),
                       1: dump((4, "gloo:scatter", []), (5, "gloo:gather", [[3]]))})
    assert lines == []
    lines = summarize({0: dump((4, "gloo:reduce_scatter", [[8]])), 1: dump((4, "gloo:reduce_scatter", [[4]]))})
    assert lines and "different collectives at #4" in lines[0]


def test_the_flight_summary_tells_two_nodes_groups_of_one_id_apart() -> None:
    """Issue 57: hpc_ddp's per-node groups have the same pg_id on their own ranks (node 0's group on ranks 0-1,
    node 1's on ranks 2-3: each rank's second group); their entries carry the group's name. Each node's group
    issuing its own collective is no mismatch; a real one within a node's group is named with that group."""
    from hpc_ddp.rundir.flight import groups, summarize

    def dump(name: str, *ops: tuple[int, str]) -> dict:
        return {"pg_status": {"1": {"last_enqueued_collective": str(ops[-1][0])}},
                "entries": [{"pg_id": 1, "process_group": [name, "undefined"], "collective_seq_id": seq,
                             "profiling_name": op, "input_sizes": [[4]], "is_p2p": False} for seq, op in ops]}
    node0, node1 = (3, "gloo:all_gather"), (3, "gloo:broadcast")
    dumps = {0: dump("1", node0), 1: dump("1", node0), 2: dump("2", node1), 3: dump("2", node1)}
    assert groups(dumps) == {"1": {0: "1", 1: "1"}, "2": {2: "1", 3: "1"}}
    assert summarize(dumps) == []  # before: "the ranks issued different collectives at #3"
    dumps[3] = dump("2", (3, "gloo:all_reduce"))
    assert summarize(dumps) == ["process group 2: the ranks issued different collectives at #3: ranks 2 "
                                "gloo:broadcast of [4]; ranks 3 gloo:all_reduce of [4] (a branch only some ranks "
                                "take, e.g. a forward of the DDP model on rank 0 alone: docs/troubleshooting.md)"]
