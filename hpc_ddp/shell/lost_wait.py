"""When the batch shell stops waiting for srun: the survivors are done, and what is left of the
step sits on nodes they declared lost.

srun cannot end a step whose tasks sit on a node that does not answer (frozen, hung in its kernel,
cut off): it waits until slurmctld marks the node down, ``SlurmdTimeout`` later (300 s by default;
on the local cluster, at 60 s, srun ended 73 s after a frozen node's last beat). Long before that
the survivors declared the node lost (``dist.liveness_s``), wrote what they hold and exited. So once
srun has reported every task outside the declared nodes as ended, and the declaration of this
attempt (read by name, with the attempt's token) names the nodes whose tasks are left (or Slurm
already finds them not answering: a node cut off from slurmctld, which may still reach the run dir
and beat there, so that nobody declares it; ``NOT_RESPONDING`` comes after a missed ping, long
before ``SlurmdTimeout``), the shell
gives srun :data:`GRACE_S` to end on its own, then ends it (SIGKILL to the srun client: the tasks it
still waits for cannot be reached anyway) and settles and heals at once. The stale step stays in
Slurm's books until the node is marked down; the next step starts beside it on other nodes (every
step has ``--overlap``), and the attempt's commit claim is sealed at the settle (the fence against
a node that wakes up later).

Nothing here decides on a listing or a ``stat``: srun's own lines say which tasks ended, the
declaration is opened by name. Tasks that end with exit code 0 leave no srun line, so a step whose
survivors ended cleanly is never cut short: the shell then waits for srun, as before.

Two places run it: :func:`hpc_ddp.shell.steps.run_srun`, for the steps the batch shell starts, and
``python -m hpc_ddp.supervise --watch`` in the background of a submitit job's batch script, for the
job's first step, whose srun is submitit's. No torch.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

# how long srun may still end the step by itself once only declared nodes are left
GRACE_S = 3.0
POLL_S = 1.0
_ENDED = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? (?P<ids>[\d,\-]+): ")


def task_ids(text: str) -> set[int]:
    """srun's task list (``0-2,5``) as ids."""
    ids: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            ids.update(range(int(first), int(last or first) + 1))
    return ids


def ended_tasks(srun_lines: Iterable[str]) -> dict[str, set[int]]:
    """node -> the ids of its tasks that srun reported ended (``srun: error: n2: tasks 0-2: Exited
    with exit code 1``, ``... task 3: Killed``)."""
    ended: dict[str, set[int]] = {}
    for line in srun_lines:
        match = _ENDED.match(line)
        if match:
            ended.setdefault(match.group("node"), set()).update(task_ids(match.group("ids")))
    return ended


def left_on_lost(nodes: Sequence[str], tasks_per_node: int, ended: Mapping[str, set[int]],
                 lost: Mapping[str, str]) -> list[str]:
    """The nodes srun still waits for, when every one of them was declared lost and every other
    node's tasks all ended; [] otherwise (srun may still end by itself, or a node that nobody
    declared still runs)."""
    waiting = [n for n in nodes if len(ended.get(n, ())) < tasks_per_node]
    if not waiting or any(n not in lost for n in waiting):
        return []
    return waiting


def watch(srun_lines: Callable[[], list[str]], lost: Callable[[], Mapping[str, str]],
          nodes: Callable[[], Sequence[str]], tasks_per_node: int, running: Callable[[], bool],
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> tuple[list[str], dict[str, str]] | None:
    """Poll while srun runs; the nodes it waits for and why they are lost, once only declared
    nodes were left for :data:`GRACE_S`; None when srun ended first. The declaration is read (and
    ``nodes`` asked) only once srun reported some task ended: before that, srun's lines in memory
    are all there is to look at."""
    since: float | None = None
    while running():
        ended = ended_tasks(srun_lines())
        declared = lost() if ended else {}
        left = left_on_lost(nodes(), tasks_per_node, ended, declared) if declared else []
        if not left:
            since = None
        elif since is None:
            since = clock()
        elif clock() - since >= GRACE_S:
            return left, {n: declared[n] for n in left}
        sleep(POLL_S)
    return None


def message(left: Sequence[str], why: Mapping[str, str]) -> str:
    """What the shell says as it stops waiting for srun."""
    named = "; ".join(f"{n}: {why[n]}" for n in left)
    return (f"srun still waits for {', '.join(left)} ({named}); every other task ended: the batch "
            "shell stops waiting (Slurm would end the step only once it marks the node down, "
            "SlurmdTimeout later) and settles the step now")


def not_answering(show_node: str) -> dict[str, str]:
    """The nodes ``scontrol show node -o`` says do not answer (``DOWN``, ``NOT_RESPONDING``), with
    why: a node cut off from slurmctld may still run (it may even reach the run dir,
    so nobody declares it), but srun cannot end its tasks either."""
    from hpc_ddp.shell.heal import node_states

    return {node: f"Slurm says State={state}" for node, state in node_states(show_node).items()
            if any(flag in state.upper() for flag in ("DOWN", "NOT_RESPONDING"))}


def until_lost(run_dir: Path, key: tuple[int | None, int, int], nodes: Sequence[str],
               tasks_per_node: int, ranks_per_node: int,
               slurm_says: Callable[[Sequence[str]], Mapping[str, str]] = lambda nodes: {}
               ) -> Callable[[Callable[[], list[str]], Callable[[], bool]], str | None]:
    """For :func:`hpc_ddp.shell.steps.run_srun`: the step ``key`` (job, restart, in-job restart)
    on ``nodes``, ``tasks_per_node`` srun tasks on each (one under the torchrun launcher) running
    ``ranks_per_node`` ranks; ``slurm_says``: the nodes Slurm finds not answering
    (:func:`not_answering` of ``scontrol show node``)."""
    def lost() -> dict[str, str]:
        return _lost(run_dir, key, list(nodes), ranks_per_node, slurm_says)

    def until(srun_lines: Callable[[], list[str]], running: Callable[[], bool]) -> str | None:
        found = watch(srun_lines, lost, lambda: nodes, tasks_per_node, running)
        return message(*found) if found else None
    return until


def watch_first_step(run_dir: Path, key: tuple[int | None, int, int], tasks_per_node: int,
                     ranks_per_node: int, step_nodes: Callable[[], list[str]],
                     say: Callable[[str], None],
                     slurm_says: Callable[[Sequence[str]], Mapping[str, str]] = lambda nodes: {},
                     shell_pid: int | None = None,
                     stderr: Path = Path("/proc/self/fd/2"), proc: Path = Path("/proc"),
                     appear_s: float = 600.0) -> bool:
    """``python -m hpc_ddp.supervise --watch``, started in the background of a submitit job's batch
    script just before submitit's srun: find that srun (a child of the batch shell named srun),
    read its lines from the shell's stderr file (from here on), and kill it once only nodes the
    survivors declared lost or Slurm finds not answering are left (:func:`watch`). ``step_nodes``
    says where the step runs (Slurm chose: ``scontrol show step``), asked once some task ended.
    True when it ended srun."""
    import os
    import signal

    shell_pid = os.getppid() if shell_pid is None else shell_pid
    try:
        start = stderr.stat().st_size if stderr.is_file() else None
    except OSError:
        start = None
    srun = _child_named(proc, shell_pid, "srun", appear_s) if start is not None else None
    if srun is None or start is None:
        return False  # no srun to watch, or its lines cannot be read back (not a file)
    seen, nodes = _Tail(stderr, start), []

    def where() -> list[str]:  # asked of Slurm once, when first needed
        nodes[:] = nodes or step_nodes()
        return nodes

    def lost() -> dict[str, str]:
        return _lost(run_dir, key, where(), ranks_per_node, slurm_says) if where() else {}

    def running() -> bool:
        return _parent_and_name(proc / str(srun) / "stat") == (shell_pid, "srun")

    ended = watch(seen.srun_lines, lost, where, tasks_per_node, running)
    if ended is None:
        return False
    say(message(*ended))
    try:
        os.kill(srun, signal.SIGKILL)
    except OSError:
        return False
    return True


def _lost(run_dir: Path, key: tuple[int | None, int, int], nodes: list[str], ranks_per_node: int,
          slurm_says: Callable[[Sequence[str]], Mapping[str, str]]) -> dict[str, str]:
    """The step's nodes that are gone for srun, with why: those Slurm finds not answering, and those
    the survivors declared lost (their word wins)."""
    from hpc_ddp.shell.shell_rules import lost_nodes

    return {**slurm_says(nodes), **lost_nodes(run_dir, *key, nodes, ranks_per_node)}


class _Tail:
    """srun's lines in a file that grows (the batch shell's stderr, where rank 0's own stderr goes
    too, for the whole job): each call reads only what was added since the last one."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path, self.offset, self.rest, self.lines = path, offset, b"", []

    def srun_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                added = f.read()
        except OSError:
            return list(self.lines)
        self.offset += len(added)
        *whole, self.rest = (self.rest + added).split(b"\n")
        self.lines += [line.decode(errors="replace") for line in whole
                       if line.startswith(b"srun:")]
        return list(self.lines)


def _parent_and_name(stat: Path) -> tuple[int, str] | None:
    """A process's parent pid and ``comm``, from its ``/proc/PID/stat``; None if it is gone."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    comm, _, rest = text.partition("(")[2].rpartition(")")
    fields = rest.split()
    return (int(fields[1]), comm) if len(fields) > 1 and fields[1].isdigit() else None


def _child_named(proc: Path, parent: int, name: str, within_s: float) -> int | None:
    """The pid of ``parent``'s child process named ``name`` (its ``comm``), waiting up to
    ``within_s`` for one to appear; None if there is none."""
    deadline = time.monotonic() + within_s
    while True:
        for stat in proc.glob("[0-9]*/stat"):
            if _parent_and_name(stat) == (parent, name):
                return int(stat.parent.name)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
