"""Shared pieces: medians of interleaved repeats, and timing a command."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Sequence


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


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
