"""Sick nodes kept out (issue 60, ``slurm.health``): before the first step of every attempt, each
node's first rank measures what a sick node is slow at, every rank hears every node's figures, and
a node far below the other nodes' median is named and, with ``action: replace``, left out.

What is measured (``checks``): ``quick``: writing 8 MB to the run dir, fsynced, and reading it back
past the page cache; the same on node-local storage (``$TMPDIR``, where compile caches go); a
matmul on the rank's device (no RNG is touched: exact resume holds); on a GPU, a memory test
(:mod:`hpc_ddp.rank.attempt.health_memory`, 256 MB, 1 GB in ``full``); ``full``: 64 MB each, and
each node's link to the next node over the training backend (16 MB each way). A node's link figure
is the better of its two links (in from the node before, out to the next): a bad NIC makes both of
a node's links slow and names that node, not its neighbours; with two nodes there is one pair of
links, and a slow one names neither.

Every figure is judged against the median of the *other* nodes' (:func:`judge`, pure): under
``below`` x that median (0.3 by default) the node is sick. The figures, the time the check took and
the sick nodes go into rank 0's ledger line (``health``) and log; ``status`` shows them. Every rank
computes the same verdict from the same figures, so leaving a node out needs no agreement: with
``replace`` (and a spare or a ``slurm.nodes`` range) every rank takes the first boundary as the
stop for a slow node (:mod:`hpc_ddp.rank.attempt.slow_stop`: one step trained, a snapshot, the
batch shell goes on without the node, a hard suspect). Off by default: fsync and link figures on a
shared file server or network vary several-fold between runs (docs/faults.md, the health check).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpc_ddp.core.batching import replace_problem
from hpc_ddp.rank.attempt.health_memory import memory_figure
from hpc_ddp.rank.group import control
from hpc_ddp.rundir import layout, node_local

if TYPE_CHECKING:
    from hpc_ddp.rank.attempt.context import Attempt
    from hpc_ddp.rank.loop.run import Run

log = logging.getLogger("hpc_ddp.health")
SIZES = {"quick": 8 << 20, "full": 64 << 20}
LINK_BYTES = 16 << 20
CHUNK = 1 << 20
MATMUL_S = 0.2
# what each figure is, for the messages; matmul in GFLOP/s, the rest in MB/s
WHAT = {"run_dir_write": "writing the run dir", "run_dir_read": "reading the run dir",
        "local_write": "writing node-local storage", "local_read": "reading node-local storage",
        "matmul": "a matmul", "link": "its links to the next and the previous node",
        "memory": "its GPU memory written and read back"}


def disk(path: Path, size: int, rounds: int = 4,
         clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """MB/s writing ``size`` bytes to the new file ``path`` (created exclusively, never through a
    link, fsynced) and reading them back past the page cache, the best of ``rounds`` rounds of a
    part each: a moment's interference only lowers a figure, and one low round must not name a
    healthy node (a CI run's 8 MB in one go varied 2.4 x between two healthy nodes)."""
    part = max(1, size // CHUNK // rounds)
    best_write = best_read = 0.0
    for _ in range(rounds):
        wrote, read = _disk_round(path, part, clock)
        best_write, best_read = max(best_write, wrote), max(best_read, read)
    return best_write, best_read


def _disk_round(path: Path, chunks: int, clock: Callable[[], float]) -> tuple[float, float]:
    block = os.urandom(CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        start = clock()
        for _ in range(chunks):
            os.write(fd, block)
        os.fsync(fd)
        wrote = clock() - start
        fd2 = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.posix_fadvise(fd2, 0, 0, os.POSIX_FADV_DONTNEED)
            start = clock()
            while os.read(fd2, CHUNK):
                pass
            read = clock() - start
        finally:
            os.close(fd2)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    megabytes = chunks * CHUNK / 1e6
    return megabytes / max(wrote, 1e-6), megabytes / max(read, 1e-6)


def matmul_gflops(device: torch.device, seconds: float = MATMUL_S, rounds: int = 4) -> float:
    """A square matmul's rate on ``device``, the best of ``rounds`` rounds over about ``seconds``
    (constant inputs: no random stream is touched)."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.full((n, n), 0.01, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, a)
    sync()
    best = 0.0
    for _ in range(rounds):
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / rounds:
            for _ in range(4):
                torch.mm(a, a)
            done += 4
            sync()  # the check waits for the device on purpose: it times it
        best = max(best, 2 * n ** 3 * done / (time.perf_counter() - start) / 1e9)
    return best


def link_in(node: int, nodes: int, local: int, device: torch.device) -> float:
    """MB/s of 16 MB received from the node before while 16 MB go to the next (first ranks only;
    ranks are numbered node by node). One batch of the two (on NCCL, a send and a receive issued
    one after the other on each side would wait for each other)."""
    out = torch.zeros(LINK_BYTES // 4, device=device)
    got = torch.empty_like(out)
    ops = [dist.P2POp(dist.irecv, got, ((node - 1) % nodes) * local),
           dist.P2POp(dist.isend, out, ((node + 1) % nodes) * local)]
    start = time.perf_counter()
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the check times the device on purpose
    return LINK_BYTES / 1e6 / max(time.perf_counter() - start, 1e-6)


def measure(checks: str, run_dir: Path, local_dir: Path, node: int,
            device: torch.device) -> dict[str, float]:
    """This node's figures (its first rank)."""
    size = SIZES[checks]
    figures: dict[str, float] = {}
    # by node: a rehearsal's nodes share this machine's $TMPDIR
    for where, path in (("run_dir", layout.health_probe(run_dir, node)),
                        ("local", local_dir / f"probe-node-{node}")):
        try:
            # a probe an attempt killed mid-write left: its exclusive create would fail each time
            # and the node measure 0 there for good (unlink never follows a link)
            path.unlink(missing_ok=True)
            figures[f"{where}_write"], figures[f"{where}_read"] = disk(path, size)
        except OSError as err:  # a node that cannot write there is as sick as can be
            log.warning("node %d's health check could not write %s: %s", node, path, err)
            figures[f"{where}_write"] = figures[f"{where}_read"] = 0.0
    figures["matmul"] = matmul_gflops(device)
    if device.type == "cuda":
        figures["memory"] = memory_figure(device, checks, node)
    return figures


def judge(figures: Mapping[int, Mapping[str, float]],
          below: float) -> dict[int, tuple[float, str]]:
    """The sick nodes: each with its worst figure over the other nodes' median, and why. Pure."""
    sick: dict[int, tuple[float, str]] = {}
    for node, mine in sorted(figures.items()):
        reasons, worst = [], 1.0
        for name, value in mine.items():
            others = [f[name] for n, f in figures.items() if n != node and name in f]
            median = statistics.median(others) if others else 0.0
            if median > 0 and value < below * median:
                unit = "GFLOP/s" if name == "matmul" else "MB/s"
                reasons.append(f"{WHAT.get(name, name)} at {_num(value)} {unit} against the other "
                               f"nodes' median of {_num(median)}")
                worst = min(worst, value / median)
        if reasons:
            sick[node] = (round(worst, 3), "; ".join(reasons))
    return sick


def _num(value: float) -> str:
    """Three significant digits, never an exponent."""
    return f"{value:.3g}" if abs(value) < 999.5 else f"{value:.0f}"


def with_links(figures: dict[int, dict[str, float]], links: Mapping[int, float]) -> None:
    """Each node's link figure: the better of the link in (measured by it) and the link out
    (measured by the next node)."""
    nodes = len(figures)
    for node in figures:
        pair = [links[n] for n in (node, (node + 1) % nodes) if n in links]
        if pair:
            figures[node]["link"] = max(pair)


def check(attempt: Attempt, run: Run, device: torch.device) -> None:
    """Collective, before the first step (``slurm.health.checks`` not off, two nodes or more):
    measure, hear every node's figures, name the sick ones; with ``replace``, every rank stops at
    the first boundary to leave them out."""
    cfg, env = attempt.cfg.slurm.health, attempt.env
    if cfg.checks == "off" or attempt.wrapped or env.num_nodes < 2:
        return
    start = time.monotonic()
    mine: tuple[int, dict[str, float] | None, float | None] = (env.node_rank, None, None)
    if env.local_rank == 0:
        folder = node_local.ensure(node_local.run_folder(
            attempt.run_dir, Path(attempt.environ.get("TMPDIR") or "/tmp"), suffix="-health"))
        try:
            figures = measure(cfg.checks, attempt.run_dir, folder, env.node_rank, device)
        finally:
            with contextlib.suppress(OSError):  # another rehearsed node's probe is in it still
                folder.rmdir()
        link = (link_in(env.node_rank, env.num_nodes, env.local_world_size, device)
                if cfg.checks == "full" else None)
        mine = (env.node_rank, figures, link)
    hosts = [env.nodelist[n] if n < len(env.nodelist) else f"node {n}"
             for n in range(env.num_nodes)]
    heard, sick, again = control.to_main_and_back(
        mine, lambda gathered: _verdict(gathered, cfg.below, hosts, attempt.attempts))
    _say(attempt, run, heard, sick, again, hosts, round(time.monotonic() - start, 2))


def _verdict(gathered: list[Any], below: float, hosts: list[str],
             attempts: list[dict[str, Any]]) -> tuple[dict[int, dict[str, float]],
                                                     dict[int, tuple[float, str]], str]:
    """Rank 0's, sent to every rank: the figures, the sick nodes, and why they are kept though
    ``replace`` asks ("": they are not). The attempt before asked to leave these very nodes out and
    here they are again: nothing could take their place (no spare left, a requeue to the same
    nodes), and asking once more would end every attempt after one step, for ever (a newcomer's
    rehearsal with every node sick requeued 44 times)."""
    figures = {node: dict(f) for node, f, _link in gathered if f is not None}
    with_links(figures, {node: link for node, _f, link in gathered if link is not None})
    sick = judge(figures, below)
    last = attempts[-1] if attempts else {}
    asked = set(last.get("replace") or []) if last.get("reason") == "slow" and isinstance(
        last.get("health"), dict) else set()
    named = {hosts[n] for n in sick}
    again = ("the attempt before stopped to leave it out, and it is here again: nothing could take "
             "its place" if named and named <= asked else "")
    return figures, sick, again


def _say(attempt: Attempt, run: Run, heard: Mapping[int, Mapping[str, float]],
         sick: Mapping[int, tuple[float, str]], again: str, hosts: list[str],
         took: float) -> None:
    """The verdict in rank 0's log and ledger line; with ``replace``, the stop on every rank."""
    cfg, env = attempt.cfg.slurm, attempt.env
    kept = ("" if not sick else "slurm.health.action=warn" if cfg.health.action == "warn" else
            replace_problem(cfg) or again)
    if env.is_main:
        attempt.record["health"] = {
            "checks": cfg.health.checks, "seconds": took,
            "nodes": {hosts[n]: {k: round(v, 1) for k, v in f.items()} for n, f in heard.items()},
            "sick": {hosts[n]: why for n, (_x, why) in sick.items()},
            **({"kept": kept} if kept else {})}
        log.info("health check (%s, %.1fs): %s", cfg.health.checks, took, "; ".join(
            f"{hosts[n]} " + ", ".join(f"{k} {_num(v)}" for k, v in f.items())
            for n, f in sorted(heard.items())))
        for node, (_x, why) in sorted(sick.items()):
            log.warning("node %d (%s) failed its health check: %s; %s", node, hosts[node], why,
                        f"kept: {kept}" if kept else "every rank stops at the first boundary to "
                        "leave it out")
    if not sick or kept:  # kept: warn, nothing to go on with, or asked before
        return
    run.pace.agreed = True  # every rank heard the same figures: the first boundary is the stop
    run.pace.leave_out = [hosts[node] for node in sorted(sick)]  # rank 0's ledger line names them
