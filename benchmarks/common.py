"""Shared pieces: medians of interleaved repeats, and timing a command."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

# B2-GPU-PIPELINE's targets (benchmarks/gpu.py measures it, benchmarks/run.py shows it)
PIPELINE_TARGET = "sync >= 0.8 x dd (2 GB CUDA state); async snapshots every 50 steps >= 0.97 x raw"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles: the spread beside a median."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def per_round(samples: dict[str, list[float]], name: str, reference: str) -> tuple[float, list[float]]:
    """The median over rounds of ``name`` / ``reference`` from the same round, and those ratios' quartiles."""
    ratios = [a / b for a, b in zip(samples[name], samples[reference])]
    if len(ratios) < 2:
        return ratios[0], [round(ratios[0], 3)] * 2
    q1, q3 = quartiles(ratios)
    return median(ratios), [round(q1, 3), round(q3, 3)]


def interleaved(named: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run every measurement once per round, rounds ``repeats`` times; the machine's drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in named}
    for _ in range(repeats):
        for name, measure in named.items():
            samples[name].append(measure())
    return samples


def wall(cmd: Sequence[str], cwd: str | None = None) -> float:
    """Seconds one command takes from start to exit (it must succeed)."""
    start = time.perf_counter()
    subprocess.run(list(cmd), cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def wait_until(predicate: Callable[[], bool], timeout: float, every: float = 0.2) -> None:
    """Poll ``predicate`` until it holds; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark's run did not get there in time")
        time.sleep(every)


def second_node(job: str, env: Mapping[str, str]) -> str:
    """A job's second node on the local cluster: with a spare node its first training node (the batch host, its
    first, trains only when no spare is free)."""
    hosts = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True,
                           env=dict(env)).stdout.strip()
    return subprocess.run(["scontrol", "show", "hostnames", hosts], capture_output=True, text=True,
                          env=dict(env)).stdout.split()[1]


def cluster_env() -> tuple[dict[str, str] | None, str | None]:
    """The local test cluster, started unless it is up, and the environment that reaches it; or None and why
    not (the pieces this machine lacks)."""
    from hpc_ddp.slurm_local import ClusterSpec, missing_pieces, start

    spec = ClusterSpec()
    missing = missing_pieces(spec)
    if missing:
        return None, f"needs {', '.join(missing)} (bash dev/test.sh installs them)"
    start(spec)
    return {**os.environ, "SLURM_CONF": str(spec.conf_path)}, None
