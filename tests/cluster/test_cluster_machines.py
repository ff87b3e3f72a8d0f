"""The local cluster's nodes are machines of their own (issue 55, :mod:`hpc_ddp.slurm_local.machines`): each has
its own hostname, address, /tmp, /dev/shm and cached view of the shared root, and takes the faults a real node
takes (``python -m hpc_ddp.slurm_local fault NODE ACTION``). Where CI's machine can isolate a piece, a test here
fails rather than skips when the cluster did not (HPC_DDP_REQUIRE_SLURM=1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.slurm_local import ClusterSpec
from hpc_ddp.slurm_local.isolation import cgroup_pids, machine_of, probe
from tests.conftest import REQUIRE_SLURM
from tests.helpers import wait_until

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]


def srun(node: str, *argv: str, timeout: float = 60, check: bool = True) -> str:
    proc = subprocess.run(["srun", "-N1", "-w", node, *argv], capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc.stdout


def cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.slurm_local", *args], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture()
def machines(slurm_cluster: ClusterSpec) -> ClusterSpec:
    """The running cluster, every piece of a machine isolated where this machine can (else a skip naming why,
    or a failure where the real-Slurm tier is required and the machine could have)."""
    lacking = [piece for piece in ("network", "hostname", "filesystem", "cgroups")
               if piece not in slurm_cluster.isolated]
    if lacking:
        why = probe()
        if REQUIRE_SLURM and not all(piece in why for piece in lacking):
            pytest.fail(f"the local cluster did not isolate {lacking} though this machine can")
        pytest.skip(f"this machine cannot isolate {', '.join(f'{p} ({why.get(p)})' for p in lacking)}")
    return slurm_cluster


@pytest.fixture()
def node3(machines: ClusterSpec) -> Iterator[str]:
    """The last node, put back to normal after the test whatever fault it was left in."""
    yield machines.node_names[-1]
    cli("fault", machines.node_names[-1], "normal")


def test_each_node_has_its_own_name_address_tmp_and_shm(machines: ClusterSpec, tmp_path: Path) -> None:
    probe_py = ("import json, os, socket; print(json.dumps({'host': socket.gethostname(), "
                "'node': os.environ['SLURMD_NODENAME'], 'addr': socket.gethostbyname(socket.gethostname()), "
                "'n1': socket.gethostbyname('n1')}))")
    proc = subprocess.run(["srun", "-N3", "--ntasks-per-node=1", sys.executable, "-c", probe_py], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda s: s["node"])
    addrs = dict(zip(machines.node_names, machines.node_addrs))
    assert [s["host"] for s in seen] == [s["node"] for s in seen] == machines.node_names  # hostname = node name
    assert [s["addr"] for s in seen] == machines.node_addrs and not any(a.startswith("127.") for a in addrs.values())
    assert {s["n1"] for s in seen} == {addrs["n1"]}  # MASTER_ADDR's name resolves to the node, never loopback
    # /dev/shm and /tmp are each node's own
    mark = f"hpc_ddp-test-{time.time_ns()}"
    srun("n1", "touch", f"/dev/shm/{mark}", f"/tmp/{mark}")
    assert srun("n2", "sh", "-c", f"ls /dev/shm/{mark} /tmp/{mark} 2>/dev/null; true") == ""
    assert srun("n1", "ls", f"/dev/shm/{mark}", f"/tmp/{mark}").split() == [f"/dev/shm/{mark}", f"/tmp/{mark}"]
    assert not Path(f"/dev/shm/{mark}").exists() and not Path(f"/tmp/{mark}").exists()  # nor the login side's


def test_a_file_made_on_one_node_stays_absent_on_another_that_looked_it_up(machines: ClusterSpec,
                                                                           tmp_path: Path) -> None:
    """The shared root is each node's own cached view of one directory: n2 looked the name up while it was
    absent, n1 then made it, and n2 still finds nothing for at least 20 s (its negative entry, as an NFS
    client's); the login side and n1 see it at once, and n2 sees it once its cache expired. A lock n1 holds
    on a file of the shared root keeps n2 out until n1 lets it go."""
    assert machines.shared in tmp_path.parents, "the tests' run dirs live under the shared root"
    name = tmp_path / "made-on-n1"
    assert srun("n2", "sh", "-c", f"ls {name} 2>/dev/null; true") == ""
    looked = time.monotonic()
    srun("n1", "sh", "-c", f"echo from-n1 > {name}")
    assert name.read_text() == "from-n1\n" and srun("n1", "cat", str(name)) == "from-n1\n"
    # locks are the backing directory's, as NFSv4's: what n1 holds, n2 cannot take (inductor's builds rely on it)
    lock = tmp_path / "lock"
    lock.touch()
    holder = subprocess.Popen(["srun", "-N1", "-w", "n1", "flock", str(lock), "sh", "-c", "echo held; sleep 60"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert srun("n2", "sh", "-c", f"flock -n {lock} true; echo $?").strip() == "1", "n2 took n1's lock"
    finally:
        holder.terminate()
        holder.wait(30)
    assert srun("n2", "sh", "-c", f"flock -w 20 {lock} true; echo $?").strip() == "0"
    while time.monotonic() - looked < 20:
        assert srun("n2", "sh", "-c", f"cat {name} 2>/dev/null; true") == "", "n2 saw it before 20 s"
        time.sleep(2)
    assert wait_until(lambda: srun("n2", "sh", "-c", f"cat {name} 2>/dev/null; true") == "from-n1\n",
                      machines.cache_s + 15)


def _counter(node: str, path: Path) -> subprocess.Popen[bytes]:
    """A task on ``node`` that writes a growing count to ``path`` every 0.1 s (for an hour)."""
    return subprocess.Popen(["srun", "-N1", "-w", node, "bash", "-c",
                             f"i=0; while :; do i=$((i+1)); echo $i > {path}.new; mv {path}.new {path}; sleep 0.1; "
                             "done"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_a_frozen_node_stays_frozen_through_sigcont_and_a_partitioned_one_is_silent(
        machines: ClusterSpec, node3: str, tmp_path: Path) -> None:
    count = tmp_path / "count"
    task = _counter(node3, count)
    try:
        assert wait_until(lambda: _count(count) > 3, 30)
        assert "FROZEN" in cli("fault", node3, "freeze")
        frozen_at = _count(count)
        m = machine_of(machines, node3)
        for pid in cgroup_pids(m):
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.5)
        assert _count(count) == frozen_at  # SIGCONT does not thaw a frozen cgroup (SIGSTOP's would have)
        states = cli("status")
        assert f"{node3}" in states and "freezer=FROZEN" in states
        cli("fault", node3, "thaw")
        assert wait_until(lambda: _count(count) > frozen_at, 10)
        # partitioned: the node lives on (its count grows, in its view of the shared root), nothing reaches it
        # and no RST answers a connection: the connect times out, as to a node that lost its link
        assert "down" in cli("fault", node3, "partition")
        before = _count(count)
        assert wait_until(lambda: _count(count) > before, 10)
        connect = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 22), timeout=2)\n"
                   "except TimeoutError:\n    print('timeout')\nexcept OSError as err:\n    print(type(err).__name__)")
        addr = machines.node_addrs[machines.node_names.index(node3)]
        assert srun("n1", sys.executable, "-c", connect, addr).strip() == "timeout"
        cli("fault", node3, "reconnect")
        # reachable again (once the neighbour tables forgot the failed lookups): a closed port answers at once
        assert wait_until(lambda: srun("n1", sys.executable, "-c", connect, addr).strip() == "ConnectionRefusedError",
                          20)
    finally:
        task.kill()
        subprocess.run(["scancel", _job_of(node3)], capture_output=True)


def _job_of(node: str) -> str:
    jobs = subprocess.run(["squeue", "-h", "-w", node, "-o", "%A"], capture_output=True, text=True).stdout.split()
    return jobs[0] if jobs else "0"


def test_a_slow_node_gets_its_share_and_a_killed_node_boots_again(machines: ClusterSpec, node3: str) -> None:
    spin = ("import time\nn, end = 0, time.monotonic() + 1.0\nwhile time.monotonic() < end:\n    n += 1\nprint(n)")
    normal = int(srun(node3, sys.executable, "-c", spin))
    cli("fault", node3, "slow=0.05")
    slowed = int(srun(node3, sys.executable, "-c", spin))
    assert slowed < normal / 3, (slowed, normal)  # a tenth of a core against up to one: well under a third
    assert "killed" in cli("fault", node3, "kill")
    assert f"{node3} " in cli("status") and not cgroup_pids(machine_of(machines, node3))  # power off
    assert "booted" in cli("fault", node3, "normal")
    assert srun(node3, "hostname").strip() == node3


def _phase(node: str, phase: str, run_dir: Path) -> dict:
    return json.loads(srun(node, f"--chdir={ROOT}", sys.executable, "-m", "tests.tasks.nfs_scenario", phase,
                           str(run_dir), timeout=180).splitlines()[-1])


def test_the_nfs_seam_scenario_through_the_nodes_real_views(machines: ClusterSpec, tmp_path: Path) -> None:
    """tests/rundir/test_nfs_view.py's scenario, played by the real writers and readers on two nodes whose views of
    the run dir cache as NFS clients do (tests/nfs_client.py stays for the pure decisions): n2 looked at step
    22's directory and its absent manifest, n1 declared rank 4 (on n3) lost and committed step 22, and n2's
    batch shell and next rank 0 then decide within n2's cache time. Step 22 is found, kept and chosen, the
    blame stays on n3."""
    run_dir = tmp_path / "run"
    _phase("n2", "prepare", run_dir)
    before = _phase("n2", "look", run_dir)
    assert before["manifest_absent"] and before["errors"] == []
    _phase("n1", "commit", run_dir)
    decided = _phase("n2", "decide", run_dir)
    assert decided["host"] == "n2"
    # n2's view still lacks the manifest it looked up while absent (a FUSE view lists a directory afresh, where
    # an NFS client may serve a cached listing: tests/rundir/test_nfs_view.py plays that)
    assert not decided["manifest_seen_at_once"], decided
    assert decided["dropped"] == {} and decided["kept"], decided  # step 22 named in newest.json: never dropped
    assert decided["lost"] == {"4": "n3"} and decided["blamed"] == ["n3"], decided
    assert decided["found"] == [22, 10] and decided["chosen"] == 22, decided
    assert decided["waited_s"] <= machines.cache_s + 10, decided  # read again until the cached absence expired
