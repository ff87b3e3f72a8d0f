"""Healing inside the allocation: which nodes run the next step after a failed one (pure: no Slurm,
no torch).

The batch shell's supervisor (:mod:`hpc_ddp.supervise`) gathers the facts: what the job
holds now (``scontrol show job``: ``SLURM_JOB_NODELIST`` goes stale once Slurm removes a
node from a ``--no-kill`` job), the nodes' states, the node that srun named when the step
failed, the ranks the watchdog named stuck, a probe of each node. This module turns them
into a decision that tests can table: a list of nodes for the next step, or requeue.

Suspects come in two strengths. A *hard* suspect (Slurm says down or drained, the job no
longer holds it, it failed the probe, or it failed two steps in a row) is never used
again. A *soft* one (one of its ranks died once, or hung) is replaced when a spare or
a smaller world is at hand, and otherwise tried once more: the same world size on the
same nodes is still a bit-exact resume, and a one-off crash is often not the node's fault.

Preference, from best to worst: the same number of nodes without any suspect (a spare
takes a lost node's place: bit-exact); the same number keeping soft suspects (a retry);
fewer nodes, at least ``slurm.nodes``' minimum (an elastic resume with the same global
batch); requeue.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.core.hostlist import compress_hostlist, expand_hostlist

# scontrol's State= flags that make a node unusable for the next step (State=IDLE+DRAIN, DOWN*,
# ...).
BAD_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER", "REBOOT", "MAINT")
_TASK_FAILED = re.compile(r"srun: error: (?P<node>[^\s:]+): tasks? [\d,\-]+: (?P<what>.+)$")
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (?P<node>[^\s:]+)")


@dataclass(frozen=True)
class Plan:
    """What the next step runs on (``nodes``), or why there is none (``nodes`` empty: requeue)."""

    nodes: list[str]
    excluded: dict[str, str] = field(default_factory=dict)  # node -> why it is left out
    how: str = ""  # "replaced", "retried", "shrunk" or "requeue"
    why: str = ""

    @property
    def heals(self) -> bool:
        return bool(self.nodes)


def job_nodes(show_job: str) -> list[str]:
    """The nodes ``scontrol show job`` says the job holds now (its ``NodeList=``), expanded."""
    match = re.search(r"(?:^|\s)NodeList=(\S+)", show_job)
    if match is None or match.group(1) in ("(null)", "None"):
        return []
    return expand_hostlist(match.group(1))


def node_states(show_node: str) -> dict[str, str]:
    """``scontrol show node -o`` (one node per line) -> {node: State=...}."""
    states = {}
    for line in show_node.splitlines():
        name, state = re.search(r"NodeName=(\S+)", line), re.search(r"\bState=(\S+)", line)
        if name and state:
            states[name.group(1)] = state.group(1)
    return states


def bad_state(state: str) -> bool:
    """Whether a node in this scontrol State (e.g. IDLE+DRAIN, DOWN*, MIXED) must not run a step."""
    flags = state.upper().replace("*", "+NOT_RESPONDING").split("+")
    return any(flag.startswith(bad) for flag in flags for bad in BAD_STATES)


def culprits(srun_lines: Iterable[str]) -> dict[str, str]:
    """The nodes srun blamed for a failed step: every lost node, or else the node of the task that
    died first.

    With ``--kill-on-bad-exit`` srun ends the other tasks itself once one fails, and reports
    them too; what it reports after its "Terminating StepId" line is a consequence, not a
    cause. Before it, a task killed by a signal (SIGKILL from the OOM killer, a segfault) is
    preferred over one that exited with a code: the peers of a killed rank exit with an
    error of their own (a reset connection) within milliseconds, and may be reported first.
    """
    found: dict[str, str] = {}
    died: list[tuple[str, str]] = []
    terminating = False
    for line in srun_lines:
        lost = _NODE_FAILURE.search(line)
        if lost:
            found[lost.group("node")] = "node failure (srun)"
            continue
        if "Terminating StepId" in line or "Force Terminated" in line or "Job step aborted" in line:
            terminating = True
        task = _TASK_FAILED.search(line.strip())
        if task and not terminating:
            died.append((task.group("node"), task.group("what").strip()))
    if died and not found:  # a lost node's peers are killed because of it: they are not to blame
        node, what = next(((n, w) for n, w in died if not w.startswith("Exited with exit code")),
                          died[0])
        found.setdefault(node, f"a task died first there ({what})")
    return found


def failed_at_same_point(previous: int | None, now: int | None) -> str:
    """Why not to heal again when two steps in a row failed with the run at the same point (the same
    last logged step or snapshot): a bug that fails there every time would use every in-job restart
    the same way. ``previous`` is -1 before the first failure. Empty when healing may go on."""
    if previous == -1 or previous != now:
        return ""
    where = "before its first step" if now is None else f"at step {now}"
    return (f"the step failed twice in a row with the run {where}: a retry in the job would most "
            "likely fail the "
            "same way")


# why a node is a suspect after a hang: the watchdog named one of its ranks
STUCK_WHY = "was stuck (watchdog)"
# a node left out only for a hang may well be innocent: a spare does not cure a hang in the code
HANG_NOT_NODE = ("; every node left out was only where a rank hung, and a hang in the program "
                 "repeats on any node (its stack in that rank's log says where it waited), so a "
                 "spare helps only if the node was at fault")


def replaced(record: Mapping[str, Any]) -> dict[str, str]:
    """The nodes a ``slow`` line asks to leave out (``replace``: rank 0 named them slow, with
    ``slurm.straggler.action: replace``, or sick before the first step, ``slurm.health``), each with
    why: hard suspects, never used again in the job."""
    slow = record.get("slow_nodes") if isinstance(record.get("slow_nodes"), dict) else {}
    why = {host: f"named slow (busy {(named or {}).get('x')} x the other nodes' median per step)"
           for host, named in slow.items() if isinstance(named, dict)}
    health = record.get("health") if isinstance(record.get("health"), dict) else {}
    sick = health.get("sick") if isinstance(health.get("sick"), dict) else {}
    why.update({host: f"failed its health check ({reason})" for host, reason in sick.items()
                if isinstance(reason, str)})
    hosts = record.get("replace") if record.get("reason") == "slow" else None
    return {host: why.get(host, "named slow") for host in hosts or [] if isinstance(host, str)}


def stuck_nodes(stuck_ranks: Sequence[int], nodes: Sequence[str],
                ranks_per_node: int) -> dict[str, str]:
    """The nodes of the ranks the watchdog named stuck (rank // ranks per node in the step's node
    order).

    ``ranks_per_node`` counts the workers' global ranks on a node, which is not srun's tasks per
    node under the torchrun template (one torchrun task per node, ``nproc_per_node`` ranks each):
    take it from the ledger line (:func:`ranks_per_node`)."""
    named = {}
    for rank in stuck_ranks:
        index = rank // max(1, ranks_per_node)
        if 0 <= index < len(nodes):
            named[nodes[index]] = f"rank {rank} {STUCK_WHY}"
    return named


def ranks_per_node(record: Mapping[str, Any], nodes: Sequence[str], fallback: int) -> int:
    """How many worker ranks ran on each node of the step: the ledger line's world size over its
    nodes (what the workers saw), else ``fallback`` (srun's tasks per node, right for the srun
    launchers)."""
    world = record.get("world_size")
    if isinstance(world, int) and world > 0 and nodes and world % len(nodes) == 0:
        return world // len(nodes)
    return fallback


def plan(held: Sequence[str], training: Sequence[str], *, hard: Mapping[str, str],
         soft: Mapping[str, str],
         counts: range, avoid: Collection[str] = ()) -> Plan:
    """The nodes of the next step. ``held``: what the job holds now, in order; ``training``: the
    failed step's nodes; ``hard``/``soft``: suspects with why; ``counts``: the node counts the run
    may train on; ``avoid``: nodes used only when nothing else is left (the batch host: a step that
    trains there takes the supervisor down with it when the node is lost)."""
    want = min(len(training), counts[-1])
    usable = [n for n in held if n not in hard]
    clean = [n for n in usable if n not in soft]
    # a node Slurm took away is still named
    known = [*held, *(n for n in training if n not in held)]
    excluded = {n: hard[n] if n in hard else soft[n] for n in known if n in hard or n in soft}
    if len(clean) >= want:
        nodes = prefer(clean, training, want, avoid)
        how = "replaced" if set(nodes) != set(training) else "retried"
        return Plan(nodes, {n: w for n, w in excluded.items() if n not in nodes}, how,
                    f"{want} healthy nodes"
                    + (" (a spare took a suspect's place)" if how == "replaced" else ""))
    if len(usable) >= want:
        nodes = prefer(usable, training, want, avoid)
        kept = [n for n in nodes if n in soft]
        return Plan(nodes, {n: w for n, w in excluded.items() if n not in nodes},
                    "replaced" if set(nodes) != set(training) else "retried",
                    f"no other spare: {', '.join(kept)} failed once and still answers, so it is "
                    "tried once more")
    if len(clean) >= counts[0]:
        nodes = prefer(clean, training, len(clean), avoid)
        return Plan(nodes, excluded, "shrunk", f"{len(nodes)} healthy nodes of {want}: slurm.nodes "
                                               "allows "
                    f"{counts[0]}-{counts[-1]}, same global batch")
    spare = "" if len(held) > len(training) else (  # the job held no spare: say how to hold one
        "; no spare node was held: slurm.spare_nodes=1 holds one that takes a lost node's place in "
        "the job"
        + (f" (or slurm.nodes={max(1, want - 1)}-{want} goes on with fewer)" if len(counts) == 1
           and want > 1 else ""))
    return Plan([], excluded, "requeue", f"{len(clean)} healthy node(s) left, {counts[0]} "
                                         f"needed{spare}")


def prefer(candidates: Sequence[str], training: Sequence[str], want: int,
           avoid: Collection[str] = ()) -> list[str]:
    """``want`` of the candidates: the failed step's own nodes first (their page cache holds the
    snapshot), then the others in the job's order, the ``avoid`` ones last; returned in the job's
    order (srun numbers nodes that way)."""
    # stable: the job's order within
    ranked = sorted(candidates, key=lambda n: (n in avoid, n not in training))
    chosen = set(ranked[:want])
    return [n for n in candidates if n in chosen]


@dataclass
class Healer:
    """What one job's healer remembers between its steps, and its decision after a failed one; used
    by the batch shell (:mod:`hpc_ddp.supervise`) and the local rehearsal
    (:mod:`hpc_ddp.rehearsal.local_heal`) alike."""

    cap: int  # slurm.max_restarts_in_job
    counts: range  # the node counts slurm.nodes allows
    # the nodes blamed for the previous failed step
    failed_before: set[str] = field(default_factory=set)
    # how far the run had got at the previous failed step (-1: none yet)
    last_failure: int | None = -1
    next_nodes: list[str] = field(default_factory=list)
    healed: dict[str, Any] | None = None  # for the next step's ledger line
    why_not: str = ""  # why the last failure was not healed in the job
    # every hard suspect of the job's steps so far: never trained on again in the job
    left_out: dict[str, str] = field(default_factory=dict)

    def decide(self, record: Mapping[str, Any], index: int, held: Sequence[str],
               training: Sequence[str],
               hard: dict[str, str], soft: dict[str, str], point: int | None, *,
               avoid: Collection[str] = (),
               no_resize: str | None = None) -> str | None:
        """After step ``index`` on ``training`` failed: a sentence on the next step (its nodes in
        ``next_nodes``), or None with ``why_not`` (the requeue path). ``point``: how far the run
        got; ``avoid``: see :func:`plan`; ``no_resize``: why the run's state cannot change its world
        size (then the next step has the same number of nodes, or there is none)."""
        self.healed, self.next_nodes = None, []
        if index >= self.cap:
            self.why_not = f"slurm.max_restarts_in_job={self.cap} in-job restarts used"
            return None
        again, self.last_failure = failed_at_same_point(self.last_failure, point), point
        # a node Slurm or a probe found bad is hardware, not a bug that fails every time
        if again and not hard:
            self.why_not = again
            return None
        for node in list(soft):
            if node in self.failed_before:
                hard[node] = f"{soft.pop(node)}, the second step in a row"
        fresh = dict(hard)
        for node, why in self.left_out.items():  # a replaced slow or sick node is held still
            hard.setdefault(node, f"{why} (an earlier step)")
        self.left_out.update(fresh)
        counts = range(len(training), len(training) + 1) if no_resize else self.counts
        chosen = plan(held, training, hard=hard, soft=soft, counts=counts, avoid=avoid)
        self.failed_before = set(soft) | set(hard)
        left_out = "; ".join(f"{n}: {why}" for n, why in chosen.excluded.items())
        if not chosen.heals:
            self.why_not = chosen.why + (f" ({left_out})" if left_out else "") + (
                f"; fewer nodes are no option: {no_resize}" if no_resize and len(self.counts) > 1
                else "") + (HANG_NOT_NODE if chosen.excluded and all(
                    STUCK_WHY in w for w in chosen.excluded.values()) else "")
            return None
        self.next_nodes = chosen.nodes
        self.healed = {"after": record.get("reason"), "how": chosen.how,
                       "excluded": chosen.excluded, "nodes_before": compress_hostlist(training)}
        return (f"{chosen.how}: restarting inside the job on {compress_hostlist(chosen.nodes)} "
                "(in-job restart "
                f"{index + 1} of {self.cap}){'; left out ' + left_out if left_out else ''}")


def bisect_silent(nodes: list[str], probe: Callable[[Sequence[str]], bool],
                  workers: int = 16) -> list[str]:
    """The nodes that fail a probe, when one probe across all of them failed: each failing group is
    probed in halves, the halves of a round at once (up to ``workers`` steps), until single nodes. k
    silent nodes among n cost about 2 k log2(n) probes in log2(n) rounds, each round at most
    PROBE_TIMEOUT_S."""
    silent: list[str] = []
    groups = [nodes[:len(nodes) // 2], nodes[len(nodes) // 2:]] if len(nodes) > 1 else [nodes]
    while groups:
        groups = [g for g in groups if g]
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(groups)))) as pool:
            answers = list(pool.map(probe, groups))
        failing = [g for g, ok in zip(groups, answers) if not ok]
        silent += [g[0] for g in failing if len(g) == 1]
        groups = [half for g in failing if len(g) > 1
                  for half in (g[:len(g) // 2], g[len(g) // 2:])]
    return sorted(silent, key=nodes.index)
