"""The local rehearsal's batch shell: heal a failed attempt in-process, as ``hpc_ddp.supervise``
does on Slurm.

The rehearsal simulates the job's nodes (``slurm.nodes`` plus ``slurm.spare_nodes``, named
node0, node1, ...). ``--fail-at STEP[:NODE]`` kills every rank of one simulated node once rank
0 has finished STEP: the node is lost, as if Slurm had taken it away. After a failed step
this module makes the same choice as on the cluster (:func:`hpc_ddp.shell.heal.plan`): a spare in
the lost node's place, a retry, fewer nodes within a ``slurm.nodes`` range, or the requeue
path. No torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp.shell import heal
from hpc_ddp.core.batching import node_counts
from hpc_ddp.rundir.ledger import attempt_key, crash_marker
from hpc_ddp.shell.shell_rules import heal_failure_of, lost_nodes, raised_first
from hpc_ddp.core.timeline import TIMELINE_VAR, encode_shell
from hpc_ddp.rundir.snapshot.steps import refuses_resize
from hpc_ddp.core.slurm_env import HEALED_VAR, IN_JOB_VAR


def parse_fail_at(text: str) -> list[tuple[int, int | None]]:
    """``"30"`` -> [(30, None)] (the last training node), ``"30:0,50:1"`` -> [(30, 0), (50, 1)]."""
    events: list[tuple[int, int | None]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        step, _, node = item.partition(":")
        if not step.isdigit() or (node and not node.isdigit()):
            raise ValueError(f"expected STEP or STEP:NODE (e.g. 30 or 30:1); found {item!r}")
        events.append((int(step), int(node) if node else None))
    return sorted(events, key=lambda e: e[0])


@dataclass
class LocalHealer:
    """The simulated job: what it holds, which nodes train, and the in-job restarts so far."""

    held: list[str]
    training: list[str]
    tasks_per_node: int
    memory: heal.Healer
    index: int = 0  # the in-job restart of the step that runs now
    lost: dict[str, str] = field(default_factory=dict)  # nodes killed by --fail-at, and why
    allocation: list[str] = field(default_factory=list)  # what a (requeued) job is granted
    width: int = 0  # how many of them train at first
    run_dir: Path | None = None  # where the ranks' liveness markers and the snapshots are

    @classmethod
    def for_config(cls, config_path: Path, nodes: int) -> LocalHealer:
        from hpc_ddp.core.config import load_config

        cfg = load_config([config_path])
        slurm = cfg.slurm
        held = [f"node{i}" for i in range(nodes + slurm.spare_nodes)]
        return cls(held, held[:nodes], slurm.tasks_per_node, heal.Healer(slurm.max_restarts_in_job,
                                                                         node_counts(slurm.nodes)),
                   allocation=list(held), width=nodes, run_dir=Path(cfg.run_dir))

    def environ(self) -> dict[str, str]:
        """What the step's ranks get beside the simulated Slurm variables."""
        if not self.index:
            return {}
        return {IN_JOB_VAR: str(self.index),
                HEALED_VAR: json.dumps(self.memory.healed or {}, sort_keys=True)}

    def node_of(self, rank: int) -> str:
        return self.training[min(len(self.training) - 1, rank // max(1, self.tasks_per_node))]

    def kill(self, node_index: int | None,
             marks: tuple[Path, int, int] | None = None) -> tuple[str, list[int]]:
        """The node --fail-at kills (its index in the training nodes; None: the last one) and its
        ranks. ``marks`` (run dir, job id, requeue count): note each killed rank's crash, as a dying
        rank's worker would, so the workers left do not take the launcher's SIGTERM for a stop
        signal."""
        node, ranks = self.victims(node_index)
        self.lost[node] = "its ranks were killed (--fail-at): the node is lost"
        # one note for the node, as the liveness declaration is (a reader takes
        if marks is not None and ranks:
            # the first note it finds, rank by rank: script_outcome._marked)
            run_dir, job_id, restart = marks
            path = crash_marker(run_dir, job_id, restart, self.index, ranks[0])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{node} was lost (--fail-at): rank(s) {', '.join(map(str, ranks))} "
                            "were killed\n")
        return node, ranks

    def victims(self, node_index: int | None) -> tuple[str, list[int]]:
        """The training node a --fail-at names (its index; None: the last one) and its ranks."""
        index = len(self.training) - 1 if node_index is None else min(node_index,
                                                                      len(self.training) - 1)
        return self.training[index], list(range(index * self.tasks_per_node,
                                                (index + 1) * self.tasks_per_node))

    def fail_at_problem(self, fail_at: Sequence[tuple[int, int | None]]) -> str | None:
        """Why a --fail-at names a node the rehearsal does not train on (None: it is fine)."""
        for step, node in fail_at:
            if node is not None and node >= len(self.training):
                return (f"--fail-at {step}:{node} names training node {node}, but the rehearsal "
                        "trains on "
                        f"{len(self.training)} node(s), numbered 0..{len(self.training) - 1} "
                        "(spares are not "
                        f"training nodes). HINT: --fail-at {step}:{len(self.training) - 1}, or "
                        f"--fail-at {step} "
                        "for the last one")
        return None

    def heal(self, record: Mapping[str, Any], failed_ranks: Sequence[int],
             point: int | None) -> str | None:
        """As :meth:`hpc_ddp.shell.supervisor.Supervisor.heal`, with the rehearsal's facts
        (``point``: how far the run got, :func:`hpc_ddp.shell.last_known.last_known`)."""
        hard = {**heal.replaced(record), **self.lost}
        per_node = heal.ranks_per_node(record, self.training, self.tasks_per_node)
        if self.run_dir is not None:
            job_id, restart, in_job = attempt_key(record)
            for node, why in lost_nodes(self.run_dir, job_id, restart, in_job, self.training,
                                        per_node).items():
                hard.setdefault(node, why)
                self.lost.setdefault(node, why)
        # the rank that raised, as its offer says, else the first to exit (a bystander, often)
        first = raised_first(self.run_dir, attempt_key(record), self.training,
                             per_node) if self.run_dir is not None else {}
        soft = first or {self.node_of(r): f"rank {r} failed first there" for r in failed_ranks[:1]}
        soft = {n: w for n, w in soft.items() if n not in hard}
        soft |= {n: w for n, w in heal.stuck_nodes(record.get("stuck_ranks") or [], self.training,
                                                     per_node).items() if n not in hard}
        self.held = [n for n in self.held if n not in self.lost]
        return self.memory.decide(record, self.index, self.held, self.training, hard, soft, point,
                                  no_resize=None if self.run_dir is None
                                  else refuses_resize(self.run_dir))

    def advance(self) -> bool:
        """Move to the planned step; False when there is none (the requeue path, or done)."""
        if not self.memory.next_nodes:
            return False
        self.training, self.memory.next_nodes, self.index = (self.memory.next_nodes, [],
                                                              self.index + 1)
        self.lost = {}
        return True

    def requeued(self) -> None:
        """A requeued job starts over with a whole allocation (Slurm grants the nodes anew)."""
        self.index, self.lost = 0, {}
        self.memory = heal.Healer(self.memory.cap, self.memory.counts)
        self.held = list(self.allocation)
        self.training = self.held[:self.width]


def timeline_environ(run_dir: Path, healing: tuple[int | None, int, int] | None,
                     ended: float | None,
                     started: float) -> dict[str, str]:
    """The batch shell's part of the next step's timeline (:mod:`hpc_ddp.core.timeline`), as the
    supervisor gives it: after a failed step (``healing``: its key), the failure's instant, when the
    launcher saw the step end (``ended``) and when it starts the next (``started``); after a
    requeue, the last two only."""
    failure = heal_failure_of(run_dir, healing, ended) if healing is not None else None
    return {TIMELINE_VAR: encode_shell(failure, detected=ended, launched=started)}
