"""A rank's start on a real cluster (issue 46): its CPU and GPU binding checked and logged once per node, gloo and
NCCL never on loopback across nodes, NCCL's network read from its own lines into the ledger and status, and the
Slurm behaviour preflight plans for. Pure tables with fakes through the seams; one real two-process gloo group
on the interface the plan picks."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.core import binding, nccl_net, netplan
from hpc_ddp.core.config import load_config
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.login.preflight.slurm_version import cpus_behaviour, planned_for, slurm_version
from hpc_ddp.login.status import render
from hpc_ddp.rank.attempt import placement
from hpc_ddp.rank.group import nccl_report

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data" / "nccl_net_lines.txt"


# --- NCCL's network, from lines quoted in public issues ----------------------------------------------------------

def _cases() -> list[Any]:
    cases = []
    for block in DATA.read_text().split("\n=== ")[1:]:
        name, source, expect, *lines = block.strip("\n").split("\n")
        assert source.startswith("source: https://github.com/") and expect.startswith("expect: ")
        pairs = dict(item.split("=", 1) for item in expect.removeprefix("expect: ").split("; "))
        cases.append(pytest.param("\n".join(lines), pairs, id=name))
    return cases


@pytest.mark.parametrize(("text", "expected"), _cases())
def test_nccl_lines_from_public_issues_say_which_network_was_chosen(text: str, expected: dict[str, str]) -> None:
    found = nccl_net.parse(text)
    assert found is not None
    assert {key: str(found.get(key)) for key in expected} == expected


def test_lines_without_a_network_choice_say_nothing() -> None:
    assert nccl_net.parse("") is None
    assert nccl_net.parse("host:1:1 [0] NCCL INFO cudaDriverVersion 12040\nNCCL version 2.21.5+cuda12.4") is None


def test_capture_asks_nccl_for_its_lines_only_where_the_user_set_no_nccl_debug() -> None:
    assert nccl_net.capture_env({}, "/tmp/x.%h.%p") == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                                                       "NCCL_DEBUG_FILE": "/tmp/x.%h.%p"}
    assert nccl_net.capture_env({"NCCL_DEBUG": "WARN"}, "/tmp/x") == {}
    assert nccl_net.capture_env({"NCCL_DEBUG_FILE": "/somewhere"}, "/tmp/x") == {}


def test_sockets_beside_infiniband_devices_are_warned_about() -> None:
    sockets = nccl_net.parse("h:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n"
                             "h:1:1 [0] NCCL INFO Using network Socket")
    assert sockets is not None
    said = nccl_net.warning(sockets, ["mlx5_0", "mlx5_1"])
    assert said and "TCP sockets" in said and "mlx5_0, mlx5_1" in said and "NCCL_IB_DISABLE" in said
    assert nccl_net.warning(sockets, []) is None  # no InfiniBand here: sockets are all there is
    infiniband = nccl_net.parse("h:1:1 [0] NCCL INFO Using network IB")
    assert infiniband is not None and nccl_net.warning(infiniband, ["mlx5_0"]) is None


def _env(rank: int = 0, local_rank: int = 0, local_world_size: int = 1, num_nodes: int = 2,
         master_addr: str = "n1", node_rank: int = 0) -> DistEnv:
    return DistEnv(rank=rank, local_rank=local_rank, world_size=local_world_size * num_nodes,
                   local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes,
                   master_addr=master_addr, master_port=29500, job_id=7, source="slurm")


def test_rank_0_reads_its_own_nccl_file_and_the_warning_goes_into_the_finding(tmp_path: Path) -> None:
    target: dict[str, str] = {}
    prefix = nccl_report.prepare(target, _env(), folder=str(tmp_path))
    assert prefix is not None and target["NCCL_DEBUG_FILE"] == f"{prefix}.%h.%p" and target["NCCL_DEBUG"] == "INFO"
    assert nccl_report.prepare({}, _env(rank=1), folder=str(tmp_path)) is None  # rank 0 alone records it
    written = Path(f"{prefix}.{socket.gethostname()}.{os.getpid()}")  # as NCCL names it: %h, %p
    written.write_text(next(p.values[0] for p in _cases() if p.id == "ib-fell-back-to-sockets"))
    (tmp_path / "ib" / "mlx5_0").mkdir(parents=True)
    found = nccl_report.collect(prefix, ib_class=tmp_path / "ib")
    assert found is nccl_report.FOUND and found is not None and found["kind"] == "socket"
    assert "TCP sockets" in found["warning"] and not written.exists()  # read once, then removed


def test_a_gpu_scripts_child_writes_the_lines_its_worker_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.script: the script's own NCCL (hpc_ddp.session() or not) writes the file; rank 0's worker reads it."""
    from types import SimpleNamespace

    from hpc_ddp.rank.script.wrapper import _nccl_capture

    monkeypatch.setattr(nccl_report.tempfile, "gettempdir", lambda: str(tmp_path))
    gpus = _cfg(tmp_path, "slurm.gpus_per_node=4", "slurm.tasks_per_node=4")
    child: dict[str, str] = {}
    prefix = _nccl_capture(SimpleNamespace(cfg=gpus, env=_env()), child)
    assert prefix is not None and child["NCCL_DEBUG_FILE"] == f"{prefix}.%h.%p"
    assert _nccl_capture(SimpleNamespace(cfg=_cfg(tmp_path), env=_env()), {}) is None  # a CPU script
    assert _nccl_capture(SimpleNamespace(cfg=gpus, env=_env(num_nodes=1)), {}) is None  # no network between nodes
    told = _cfg(tmp_path, "slurm.gpus_per_node=4", "dist.nccl_env={NCCL_DEBUG: WARN}")
    assert _nccl_capture(SimpleNamespace(cfg=told, env=_env()), {}) is None  # the user's own NCCL_DEBUG stands
    Path(f"{prefix}.gpu7.4242").write_text("h:4242:1 [0] NCCL INFO Using network IB")  # the child's pid
    found = nccl_report.collect(prefix, ib_class=tmp_path / "none", pid=None)
    assert found is not None and found["network"] == "IB" and "warning" not in found


def test_status_shows_the_network_of_the_newest_nccl_attempt() -> None:
    net = {"network": "Socket", "kind": "socket", "devices": "[0]eth0:10.0.0.1<0>", "warning": "NCCL uses TCP ..."}
    info = {"run_dir": "r", "job_id": 1, "state": "RUNNING", "progress": {}, "done": None, "newest_snapshot": None,
            "attempts": [{"job_id": 1, "restart_count": 0, "reason": "preemption",
                          "nccl_net": {"network": "IB", "kind": "ib"}},
                         {"job_id": 1, "restart_count": 1, "reason": "finished", "nccl_net": net}]}
    out = render(info)
    assert "network NCCL Socket ([0]eth0:10.0.0.1<0>) between nodes (attempt #1)" in out
    assert "WARNING: NCCL uses TCP" in out


# --- binding: CPUs and GPUs ---------------------------------------------------------------------------------------

def _view(cpus: range | list[int], machine: int = 64, gpus: int | None = None, cuda: str | None = None) -> binding.View:
    return binding.View(rank=3, local_rank=1, host="gpu7", cpus=tuple(cpus), machine_cpus=machine,
                        visible_gpus=gpus, cuda_visible=cuda)


def test_a_rank_bound_below_cpus_per_task_is_refused_with_what_slurm_gave_and_the_fix() -> None:
    with pytest.raises(binding.BindingError) as refused:
        binding.check_cpus(_view([5]), 8, {"SLURM_CPUS_PER_TASK": "8"})
    text = str(refused.value)
    assert refused.value.key == "slurm.cpus_per_task" and not refused.value.retry_may_help
    for words in ("rank 3 (local rank 1) on gpu7 may run on 1 CPU(s)", "slurm.cpus_per_task=8",
                  "SLURM_CPUS_PER_TASK=8", "srun --cpus-per-task=8", "SRUN_CPUS_PER_TASK=8", "Slurm 22.05"):
        assert words in text, text
    assert binding.check_cpus(_view(range(8)), 8, {}) is None


def test_an_unbound_rank_on_a_machine_with_fewer_cpus_than_asked_is_warned_not_refused() -> None:
    """The test cluster's slurmd declares 4 CPUs on a 2-core machine and binds nothing (task/none)."""
    said = binding.check_cpus(_view([0, 1], machine=2), 3, {"SLURM_CPUS_PER_TASK": "3"})
    assert said and "gpu7 has 2 CPU(s) in all and slurm.cpus_per_task=3" in said


@pytest.mark.parametrize(("gpus", "tasks", "local_size", "seen", "ok"), [
    (4, 4, 4, 4, True),  # every GPU of the node visible: the local rank's
    (4, 4, 4, 1, True),  # --gpu-bind / --gpus-per-task=1: its own, device 0
    (4, 4, 4, 0, False),  # none
    (4, 4, 4, 2, False),  # neither its own nor all
    (8, 4, 4, 2, False),  # a share of 2 that device_index cannot pick from
    (8, 4, 4, 8, True),
    (4, 1, 1, 1, False),  # one task for 4 GPUs bound to 1
    (4, 1, 1, 4, True),
    (0, 2, 2, 0, True),  # a CPU run: nothing to check
])
def test_a_gpu_view_matches_when_the_rank_can_pick_its_own_gpu(gpus: int, tasks: int, local_size: int, seen: int,
                                                               ok: bool) -> None:
    view = _view(range(8), gpus=seen, cuda=",".join(map(str, range(seen))))
    if ok:
        binding.check_gpus(view, gpus, tasks, local_size)
        return
    with pytest.raises(binding.BindingError, match="slurm.gpus_per_node") as refused:
        binding.check_gpus(view, gpus, tasks, local_size)
    assert "--gpu-bind" in str(refused.value) and "CUDA_VISIBLE_DEVICES" in str(refused.value)


def test_cpu_lists_read_as_taskset_prints_them() -> None:
    assert binding.cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11" and binding.cpu_list([]) == "none"


def _cfg(tmp_path: Path, *overrides: str) -> Any:
    return load_config([ROOT / "examples" / "mlp.yaml"], [f"run_dir={tmp_path / 'run'}", *overrides])


def _seams(cpus: set[int], machine: int = 16, **more: Any) -> placement.Seams:
    return placement.Seams(affinity=lambda: cpus, machine_cpus=lambda: machine, visible_gpus=lambda: 1,
                           hostname=lambda: "gpu7", **more)


def test_the_rehearsal_is_never_refused_and_a_cluster_rank_is(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(tmp_path, "slurm.cpus_per_task=4")
    one_node = _env(num_nodes=1)
    with caplog.at_level(logging.INFO, logger="hpc_ddp.placement"):
        assert placement.check(cfg, one_node, {"HPC_DDP_LOCAL": "1"}, _seams({0})) == {}
    assert "binding on gpu7 (node 0 of 1): rank 0 (local 0): CPUs 0 (1) (rehearsal: not checked" in caplog.text
    with pytest.raises(binding.BindingError, match="slurm.cpus_per_task=4"):
        placement.check(cfg, one_node, {"SLURM_CPUS_PER_TASK": "4"}, _seams({0}))


def test_a_node_logs_every_rank_view_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank posts its view on node-local storage; the node's first rank logs them once (none in the run dir)."""
    monkeypatch.setattr(placement, "SUMMARY_WAIT_S", 5.0)
    monkeypatch.setattr(placement.beats, "run_folder", lambda run_dir, base=None: tmp_path / "shm")
    cfg = _cfg(tmp_path)
    placement.post_view(cfg, _env(rank=1, local_rank=1, local_world_size=2), _view([2, 3]))
    with caplog.at_level(logging.INFO, logger="hpc_ddp.placement"):
        placement.post_view(cfg, _env(local_world_size=2), _view([0, 1]))
        import threading

        for thread in [t for t in threading.enumerate() if t.name == "binding-line"]:
            thread.join()
    [line] = [r.getMessage() for r in caplog.records if r.name == "hpc_ddp.placement"]
    assert line.startswith("binding on gpu7 (node 0 of 2): ") and line.count("CPUs") == 2, line
    assert not (tmp_path / "run").exists()


# --- never loopback across nodes -------------------------------------------------------------------------------

def _routable() -> tuple[str, str] | None:
    """(interface, address) of this machine that is not loopback, if it has one."""
    for name, addrs in placement.interfaces().items():
        for addr in addrs:
            if ":" not in addr and not netplan.is_loopback(addr):
                return name, addr
    return None


def _looped_seams(master: str, **more: Any) -> placement.Seams:
    """The hostname resolves to 127.0.1.1 (a Debian image's /etc/hosts); MASTER_ADDR resolves to ``master``."""
    names = {"gpu7": ("127.0.1.1",), "n1": (master,)}
    return _seams({0}, resolve=lambda host: names.get(host, ()), **more)


def test_a_loopback_hostname_gets_the_interface_that_routes_to_master_addr(tmp_path: Path) -> None:
    """The route and the interface list are this machine's own (a fake list only where it has no other address)."""
    found = _routable()
    fake = {} if found else {"route_source": lambda addr: "10.1.2.3",
                             "interfaces": lambda: {"lo": ("127.0.0.1",), "ib0": ("10.1.2.3",)}}
    name, addr = found or ("ib0", "10.1.2.3")
    exports = placement.check(_cfg(tmp_path), _env(), {}, _looped_seams(addr, **fake))
    assert exports == {"GLOO_SOCKET_IFNAME": name}  # NCCL picks its own interfaces: not pinned (issue 57)
    assert placement.check(_cfg(tmp_path), _env(), {"GLOO_SOCKET_IFNAME": "eth9"}, _looped_seams(addr, **fake)) == {}
    named = _cfg(tmp_path, "dist.nccl_env={GLOO_SOCKET_IFNAME: eth9}")  # exported before init: the user's too
    assert placement.check(named, _env(), {}, _looped_seams(addr, **fake)) == {}


def test_nothing_changes_where_master_addr_is_loopback_or_the_job_has_one_node(tmp_path: Path) -> None:
    """The local test cluster: n1 -> 127.0.2.1, every node on this machine."""
    assert placement.check(_cfg(tmp_path), _env(), {}, _looped_seams("127.0.2.1")) == {}
    assert placement.check(_cfg(tmp_path), _env(num_nodes=1), {}, _looped_seams("10.0.0.1")) == {}


def test_a_loopback_hostname_with_no_route_but_loopback_is_refused_with_the_variables_to_set(tmp_path: Path) -> None:
    for route in (lambda addr: "127.0.0.1", lambda addr: None, lambda addr: "10.9.9.9"):  # last: on no interface
        seams = _looped_seams("10.0.0.1", route_source=route, interfaces=lambda: {"lo": ("127.0.0.1",)})
        with pytest.raises(netplan.NetworkError) as refused:
            placement.check(_cfg(tmp_path), _env(), {}, seams)
        text = str(refused.value)
        assert "GLOO_SOCKET_IFNAME" in text and "slurm.setup" in text
        assert "127.0.1.1" in text and "MASTER_ADDR=n1" in text and not refused.value.retry_may_help


def _gloo_on(environ: dict[str, str], queue: Any) -> None:
    """One rank of a real gloo group, started with what the plan exported."""
    import torch
    import torch.distributed as dist

    os.environ.update(environ)
    dist.init_process_group("gloo", rank=int(environ["RANK"]), world_size=2)
    total = torch.ones(1)
    dist.all_reduce(total)
    queue.put((int(environ["RANK"]), float(total.item()), os.environ["GLOO_SOCKET_IFNAME"]))
    dist.destroy_process_group()


def test_a_gloo_group_forms_on_the_interface_the_plan_picked(tmp_path: Path) -> None:
    found = _routable()
    if found is None:
        pytest.skip("this machine has no address but loopback to form a group on")
    name, addr = found
    exports = placement.check(_cfg(tmp_path), _env(), {}, _looped_seams(addr))
    import multiprocessing

    from hpc_ddp.rehearsal.local import free_port

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_gloo_on, args=({**exports, "MASTER_ADDR": addr, "MASTER_PORT": str(port),
                                                     "RANK": str(rank)}, queue)) for rank in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(120)
    assert [rank.exitcode for rank in ranks] == [0, 0]
    assert sorted(queue.get(timeout=10) for _ in ranks) == [(0, 2.0, name), (1, 2.0, name)]


# --- the Slurm behaviour preflight plans for ----------------------------------------------------------------------

@pytest.mark.parametrize(("text", "words"), [
    ("slurm 21.08.8-2", "Slurm 21.08: srun inherits --cpus-per-task"),
    ("slurm-wlm 22.05.8", "Slurm 22.05: srun does not inherit --cpus-per-task from the job (only through "
                          "SRUN_CPUS_PER_TASK); hpc_ddp passes --cpus-per-task=6 to every srun"),
    ("slurm 23.02.7", "Slurm 23.02: srun does not inherit"),
    ("slurm 24.05.1", "Slurm 24.05: srun reads SLURM_CPUS_PER_TASK again (since 23.11)"),
    ("", "Slurm's version is unknown"),
])
def test_preflight_says_which_srun_behaviour_it_planned_for(text: str, words: str) -> None:
    assert words in cpus_behaviour(slurm_version(text), 6, text)


def test_the_version_is_asked_of_srun_through_the_runner_seam() -> None:
    import subprocess

    asked: list[list[str]] = []

    def runner(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="slurm 22.05.8\n", stderr="")
    assert planned_for(2, runner).startswith("Slurm 22.05: srun does not inherit") and asked == [["srun", "--version"]]


def test_the_worker_exports_the_plan_for_gloo_nccl_and_a_scripts_child(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.rank.worker import placed

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "x")  # recorded as it was, so the export is undone after the test
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(placement, "check", lambda cfg, env, environ: {"GLOO_SOCKET_IFNAME": "ib0"})
    environ = {"SLURM_JOB_ID": "7"}
    assert placed(_cfg(tmp_path), _env(), environ) == {"SLURM_JOB_ID": "7", "GLOO_SOCKET_IFNAME": "ib0"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"  # gloo and NCCL read this process's environment
    monkeypatch.setattr(placement, "check", lambda cfg, env, environ: {})
    assert placed(_cfg(tmp_path), _env(), environ) is environ
