"""A pytest plugin that writes each test's CPU time, its processes' included, beside its wall time.

Why: the suite on 2 cores is bound by CPU, and almost all of it is spent in the processes a test
starts (a rank's `import torch` and torch._dynamo are ~1.8 s of its ~2.1 s), which pytest's
--durations cannot see. The CPU comes from the cpuacct cgroup the session runs in (cgroup v1, as
on this project's machines), so killed processes count too. Put the session in a cgroup of its own
first, or the figures include whatever else the machine runs:

    mkdir -p /sys/fs/cgroup/cpuacct/suite
    sh -c 'echo $$ > /sys/fs/cgroup/cpuacct/suite/tasks; exec env PYTHONPATH=dev \
        .venv/bin/python -m pytest -p pytest_cpu --ignore=tests/cluster -m "not cluster"'

Each line of ``$HPC_DDP_CPU_OUT`` (default runs/test-cpu.tsv): CPU seconds, wall seconds, test id.
Sum it by file with ``sort -rn runs/test-cpu.tsv | head``. Measured with it on 2026-12-03 (issue 56):
the rest 1582 CPU-s in 1475 s, the cluster's session 920 CPU-s in 1467 s, side by side.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _usage_file() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            found = Path(f"/sys/fs/cgroup/cpuacct{path}/cpuacct.usage")
            return found if found.exists() else None
    return None


_USAGE = _usage_file()
_OUT = Path(os.environ.get("HPC_DDP_CPU_OUT", "runs/test-cpu.tsv"))
_start: dict[str, float] = {}


def _cpu_s() -> float:
    return int(_USAGE.read_text()) / 1e9 if _USAGE else time.process_time()


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _start["cpu"], _start["wall"] = _cpu_s(), time.monotonic()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    cpu, wall = _cpu_s() - _start["cpu"], time.monotonic() - _start["wall"]
    _OUT.parent.mkdir(parents=True, exist_ok=True)
    with _OUT.open("a") as out:
        out.write(f"{cpu:.2f}\t{wall:.2f}\t{nodeid}\n")
