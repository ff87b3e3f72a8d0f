"""The real local Slurm cluster's fixtures, beside the tests that use it: the session's cluster (started
once, stopped after), node faults put back after each test, SIGTERM preemption for one test, and a local
rehearsal in the background as a job's reference. Tests elsewhere never need them: every test that
does is in this folder (tests/conftest.py marks them ``cluster``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from hpc_ddp.slurm_local import APT_PACKAGES, ClusterSpec, missing_pieces, running_spec, set_preempt_signal, start, stop
from tests.conftest import unavailable
from tests.helpers import MLP_300


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


class Rehearsal:
    """An uninterrupted local rehearsal (``python -m hpc_ddp.submit OPTIONS --local``) started in the background,
    so that it uses this machine's CPUs while a test's cluster jobs idle (a liveness or watchdog wait, a requeue,
    a slowed step). Its output goes to a file beside the run dir: a pipe nobody reads could fill and stall it."""

    def __init__(self, run_dir: Path, options: tuple[str, ...], env: Mapping[str, str] | None) -> None:
        self.run_dir, self.log = run_dir, run_dir.parent / f"{run_dir.name}.rehearsal.log"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *options, "--local",
                                          f"run_dir={run_dir}"], cwd=Path(__file__).resolve().parents[2],
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


@pytest.fixture(scope="session")
def mlp_300_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Rehearsal]]:
    """``mlp_300_reference()``: the :data:`tests.helpers.MLP_300` rehearsal, started by the first test that asks
    (beside its cluster jobs) and shared by the session's others; ``.done()`` waits for it."""
    started: list[Rehearsal] = []

    def get() -> Rehearsal:
        if not started:
            started.append(Rehearsal(tmp_path_factory.mktemp("mlp-300") / "reference", MLP_300, None))
        return started[0]

    yield get
    for each in started:
        each.end()
