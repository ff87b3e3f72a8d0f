"""Shared fixtures: the shared root for tmp_path, the cluster marker, and scontrol as the hostlist oracle
(the real local Slurm cluster's fixtures are in tests/cluster/conftest.py, with its tests).

Tests that need Slurm skip with the missing piece named; with
HPC_DDP_REQUIRE_SLURM=1 (set by dev/test.sh, hence CI) they fail instead, so CI
can never go green by skipping the real-Slurm tier.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings

from hpc_ddp.slurm_local import ClusterSpec

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

