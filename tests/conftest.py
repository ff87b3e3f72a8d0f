"""Shared fixtures: the real local Slurm cluster, and scontrol as the hostlist oracle.

Tests that need Slurm skip with the missing piece named; with
HPC_DDP_REQUIRE_SLURM=1 (set by dev/test.sh, hence CI) they fail instead, so CI
can never go green by skipping the real-Slurm tier.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from hypothesis import settings

from hpc_ddp.slurm_local import APT_PACKAGES, ClusterSpec, missing_pieces, running_spec, set_preempt_signal, start, stop

REQUIRE_SLURM = os.environ.get("HPC_DDP_REQUIRE_SLURM") == "1"
# The tests' run dirs live where the local cluster's nodes see them: the shared root, which each node sees
# through its own cached view (/tmp is each node's own). pytest reads this when it first makes a tmp_path.
if not os.environ.get("PYTEST_DEBUG_TEMPROOT"):
    try:
        if not ClusterSpec.shared.exists():
            ClusterSpec.shared.mkdir(parents=True)
            ClusterSpec.shared.chmod(0o1777)  # as slurm_local makes it: every user's runs, as /tmp
        if os.access(ClusterSpec.shared, os.W_OK | os.X_OK):
            os.environ["PYTEST_DEBUG_TEMPROOT"] = str(ClusterSpec.shared)
    except OSError:
        pass  # not root and no shared root yet: the cluster tests cannot run here anyway
# CI draws the same examples every run (a rare input found once must not make one CI run red and the next
# green); a developer's runs keep exploring new ones, and a failure prints the input to add as a case.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the real cluster is marked ``slurm`` and ``cluster`` (no test can forget it), so
    ``-m "not cluster"`` is a developer's loop without the cluster (``-m "not slurm"`` also leaves out the few
    that only ask ``scontrol``). The cluster's tests run last, after every test that need not wait for them."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) or "/tests/cluster/" in str(item.path):
            item.add_marker(pytest.mark.slurm)
            item.add_marker(pytest.mark.cluster)
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)  # stable: order kept otherwise


def unavailable(reason: str) -> None:
    """Skip with the reason, or fail where the real-Slurm tier is required."""
    if REQUIRE_SLURM:
        pytest.fail(f"{reason} (HPC_DDP_REQUIRE_SLURM=1: the real-Slurm tests must run here)")
    pytest.skip(reason)


INDUCTOR_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture(autouse=True)
def _no_compiler_cache_variable_leaks_into_later_jobs() -> Iterator[None]:
    """Inductor writes its default TORCHINDUCTOR_CACHE_DIR into os.environ the first time it compiles in a
    process. A test that compiles in the pytest process would hand it to every later test's rehearsal and
    Slurm job, which then keep it as the user's own (train.compile_cache's rule) and share /tmp's cache."""
    before = {name: os.environ.get(name) for name in INDUCTOR_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[ClusterSpec]:
    """A running local cluster (reused if one is up at the same root), SLURM_CONF pointing at it."""
    spec = ClusterSpec(root=Path(os.environ.get("HPC_DDP_SLURM_ROOT", str(ClusterSpec.root))))
    missing = missing_pieces(spec)
    if missing:
        unavailable(f"real Slurm tests need {', '.join(missing)} "
                    f"(apt-get install -y --no-install-recommends {APT_PACKAGES}, as root)")
    started = start(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(spec.conf_path))
        yield running_spec(spec)
    if started:
        stop(spec)


@pytest.fixture()
def node_faults(slurm_cluster: ClusterSpec) -> Iterator[ClusterSpec]:
    """A test that plays node faults (freeze, partition, slow, kill) leaves every node as it found it: a frozen
    node is killed first (its processes die without running again: they froze after the survivors declared
    them lost), then each is put back to normal (a killed one boots again)."""
    yield slurm_cluster
    from hpc_ddp.slurm_local import faults, isolation

    for state in faults.states(slurm_cluster):
        m = isolation.machine_of(slurm_cluster, state.name)
        if state.freezer not in ("THAWED", "n/a"):
            faults.fault(slurm_cluster, state.name, "kill")
        faults.normal(slurm_cluster, m)


@pytest.fixture()
def sigterm_preemption(slurm_cluster: ClusterSpec) -> Iterator[ClusterSpec]:
    """The cluster preempts as most clusters do, with SIGTERM and a grace time (not the job's --signal), for one
    test; then back to the warning signal."""
    set_preempt_signal(slurm_cluster, "term")
    try:
        yield slurm_cluster
    finally:
        set_preempt_signal(slurm_cluster, "user")


@pytest.fixture(scope="session")
def scontrol_hostnames(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[str] | None]:
    """``scontrol show hostnames TEXT`` (None when Slurm calls it invalid); needs only slurm-client."""
    if not shutil.which("scontrol"):
        unavailable("the scontrol oracle needs scontrol (apt-get install slurm-client)")
    conf = tmp_path_factory.mktemp("scontrol") / "slurm.conf"
    conf.write_text("ClusterName=oracle\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}

    def hostnames(text: str) -> list[str] | None:
        proc = subprocess.run(["scontrol", "show", "hostnames", text], env=env, capture_output=True, text=True,
                              timeout=30)
        if proc.returncode != 0 or "Invalid hostlist" in proc.stdout + proc.stderr:
            return None
        return proc.stdout.split()

    return hostnames


class Rehearsal:
    """An uninterrupted local rehearsal (``python -m hpc_ddp.submit OPTIONS --local``) started in the background,
    so that it uses this machine's CPUs while a test's cluster jobs idle (a liveness or watchdog wait, a requeue,
    a slowed step). Its output goes to a file beside the run dir: a pipe nobody reads could fill and stall it."""

    def __init__(self, run_dir: Path, options: tuple[str, ...], env: Mapping[str, str] | None) -> None:
        self.run_dir, self.log = run_dir, run_dir.parent / f"{run_dir.name}.rehearsal.log"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *options, "--local",
                                          f"run_dir={run_dir}"], cwd=Path(__file__).resolve().parent.parent,
                                         stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def done(self, timeout: float = 300) -> Path:
        """Wait for the run (at most ``timeout`` s): it exited 0; its run dir."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.end()
        assert self.proc.returncode == 0, self.log.read_text(errors="replace")[-3000:]
        return self.run_dir

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # the launcher; its ranks die with it (die_with_parent)
            self.proc.wait()


@pytest.fixture()
def rehearsal() -> Iterator[Callable[..., Rehearsal]]:
    """``rehearsal(run_dir, *options, env=None)`` starts :class:`Rehearsal`; one still running when the test ends
    (it failed first) is ended."""
    started: list[Rehearsal] = []

    def start(run_dir: Path, *options: str, env: Mapping[str, str] | None = None) -> Rehearsal:
        started.append(Rehearsal(run_dir, options, env))
        return started[-1]

    yield start
    for each in started:
        each.end()
