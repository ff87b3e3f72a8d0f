"""What the batch shell knows of its job and asks Slurm: the job's nodes now (``scontrol``), which
of them answer (one probe step on the plan's nodes), the walltime left, the stop signal, the caps;
and the plan for the next step from :mod:`hpc_ddp.shell.heal`'s rules. The loop that uses it is
:func:`hpc_ddp.shell.supervise.supervise`. Every Slurm command goes through a runner (a seam for
tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.shell import heal
from hpc_ddp.shell import shell_rules as rules
from hpc_ddp.core.batching import node_counts
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.container import probe_tail
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.hostlist import compress_hostlist, expand_hostlist
from hpc_ddp.core.slurm_jobs import job_end_time, job_spec, job_state
from hpc_ddp.core.stopping import signal_number
from hpc_ddp.core.timeline import TIMELINE_VAR, encode_shell
from hpc_ddp.shell.last_known import last_known
from hpc_ddp.core.slurm_env import HEALED_VAR, IN_JOB_VAR
from hpc_ddp.rundir import node_local
from hpc_ddp.rundir.snapshot.steps import refuses_resize
from hpc_ddp.shell import lost_wait
from hpc_ddp.shell.steps import Srun, Step, Until, run_srun


PROBE_TIMEOUT_S = 20.0  # a node whose slurmd is gone must not eat the retry


class Supervisor:
    """The steps of one job (an attempt, in Slurm's sense) and the decisions between them."""

    def __init__(self, cfg: RunConfig, environ: Mapping[str, str], command: Sequence[str], *,
                 runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
                 srun: Srun | None = None, clock: Callable[[], float] = time.time,
                 workdir: str | None = None) -> None:
        self.cfg, self.environ, self.command = cfg, environ, list(command)
        # the job's directory: a container mounts it (probes too)
        self.workdir = workdir or os.getcwd()
        self.runner, self.clock = runner, clock
        self.until: Until | None = None  # when to stop waiting for the running step's srun
        self.srun: Srun = srun or (lambda argv, env, warn_in: run_srun(
            argv, env, warn_in, signal_number(cfg.slurm.signal), self.until))
        self.run_dir = Path(cfg.run_dir)
        self.job = environ.get("SLURM_JOB_ID", "")
        self.job_id = int(self.job) if self.job.isdigit() else None
        self.restart = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self.tasks_per_node = int(environ.get("SLURM_NTASKS_PER_NODE", "")
                                  or cfg.slurm.tasks_per_node)
        self.counts = node_counts(cfg.slurm.nodes)
        self.healer = heal.Healer(cfg.slurm.max_restarts_in_job, self.counts)
        self.stopping = False
        self.batch_host = ""
        self.end: float | None = None  # the job's end (squeue), asked once per decision
        # this batch shell's start: when Slurm started (or restarted) the job
        self.began = round(clock(), 3)

    def command_problem(self) -> str:
        """Why the supervised command cannot be run as a step (checked before the first decision, so
        an unexpected command costs the healing, never the ledger line or the requeue)."""
        if not self.command or Path(self.command[0]).name != "srun":
            return (f"hpc_ddp.supervise runs an srun command; found {self.command[:1]!r}. HINT: "
                    "put the step after '--': -- srun --kill-on-bad-exit=1 ...")
        return ""

    def held(self) -> list[str]:
        """What the job holds now (scontrol; the batch shell's SLURM_JOB_NODELIST is a fallback,
        stale after a node was removed from the job). Notes the batch host on the way."""
        text = self.scontrol("show", "job", self.job)
        self.batch_host = rules.batch_host(text, self.environ)
        nodes = heal.job_nodes(text) if text else []
        return nodes or expand_hostlist(self.environ.get("SLURM_JOB_NODELIST", ""))

    def avoid(self) -> list[str]:
        """With spares the batch host is the last node to train on: a step there that loses its node
        loses the supervisor too (no line, no heal). Without spares it trains like the others."""
        return [self.batch_host] if self.cfg.slurm.spare_nodes and self.batch_host else []

    def first_nodes(self) -> list[str]:
        """The first step trains on the job's nodes less the spares (at most the range's maximum);
        the batch host is one of the spares."""
        held = self.held()
        want = max(self.counts[0], min(len(held) - self.cfg.slurm.spare_nodes, self.counts[-1]))
        return heal.prefer(held, [], want, self.avoid())

    def first_step_nodes(self) -> list[str]:
        """Where submitit's step ran (:func:`hpc_ddp.shell.shell_rules.submitit_step_nodes`); else
        accounting's record of step 0 (it can lag the step by seconds), else the first nodes."""
        try:
            nodes = rules.submitit_step_nodes(self.environ, self.cfg.slurm)
        except HpcDdpError:
            nodes = []
        return nodes or self._accounted_step_nodes() or self.first_nodes()

    def _accounted_step_nodes(self) -> list[str]:
        try:
            proc = self.runner(["sacct", "-n", "-P", "-j", f"{self.job}.0", "-o", "NodeList"],
                               capture_output=True, text=True, timeout=30)
            text = (proc.stdout.strip().splitlines()[0]
                    if proc.returncode == 0 and proc.stdout.strip() else "")
            return expand_hostlist(text) if text and text not in ("None assigned", "(null)") else []
        except (OSError, subprocess.SubprocessError, HpcDdpError):
            return []

    def scontrol(self, *args: str) -> str:
        try:
            proc = self.runner(["scontrol", *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        return proc.stdout if proc.returncode == 0 else ""

    def not_answering(self, nodes: Sequence[str]) -> dict[str, str]:
        """The nodes Slurm finds not answering (:func:`hpc_ddp.shell.lost_wait.not_answering`)."""
        return lost_wait.not_answering(self.scontrol("show", "node", "-o",
                                                     compress_hostlist(nodes)))

    def probe(self, nodes: Sequence[str]) -> bool:
        """One short step on these nodes: do their slurmds start a task at all, in the job's
        container, within the timeout? A probe that times out is cancelled (killing srun does not
        end its step at slurmctld, which would hold the nodes)."""
        name = f"hpc_ddp-probe-{uuid.uuid4().hex[:8]}"
        argv = ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
                f"--nodelist={','.join(nodes)}", "--time=1", "--kill-on-bad-exit=1",
                f"--job-name={name}",
                *probe_tail(self.cfg.slurm, [self.cfg.run_dir, self.workdir], self.workdir)]
        try:
            return self.runner(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                               env=self._env_without_step_shape()).returncode == 0
        except subprocess.TimeoutExpired:
            self._cancel_step(name)
            return False
        except (OSError, subprocess.SubprocessError):
            return False

    def _cancel_step(self, name: str) -> None:
        """scancel this job's step named ``name`` (a probe that timed out), if slurmctld still lists
        it."""
        try:
            listed = self.runner(["squeue", "--steps", f"--jobs={self.job_id}", "--noheader",
                                  "--format=%i %j"], capture_output=True, text=True, timeout=30)
            for line in listed.stdout.splitlines() if listed.returncode == 0 else []:
                step, _, step_name = line.strip().partition(" ")
                if step_name.strip() == name:
                    self.runner(["scancel", step], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass

    def suspects(self, step: Step, record: Mapping[str, Any]) -> tuple[list[str], dict[str, str],
                                                                       dict[str, str]]:
        """What the job holds, and the hard and soft suspects (see :mod:`hpc_ddp.shell.heal`),
        before any probe."""
        held = self.held()
        hard = {n: "the job no longer holds it (Slurm removed it)" for n in step.nodes
                if n not in held}
        states = heal.node_states(self.scontrol("show", "node", "-o",
                                                 compress_hostlist(held))) if held else {}
        hard |= {n: f"Slurm says State={s}" for n, s in states.items() if n in held
                 and heal.bad_state(s)}
        per_node = heal.ranks_per_node(record, step.nodes, self.tasks_per_node)
        lost = rules.lost_nodes(self.run_dir, self.job_id, self.restart, step.index, step.nodes,
                                per_node)
        hard |= {n: why for n, why in lost.items() if n not in hard}
        replaced = heal.replaced(record)  # every rank stopped for it: srun's lines name no culprit
        hard |= {n: why for n, why in replaced.items() if n not in hard}
        stuck = heal.stuck_nodes(record.get("stuck_ranks") or [], step.nodes, per_node)
        # srun names the first task to exit; after a hang or a loss that is the rank that saw it and
        # ended the step on purpose (the watchdog's recorder, the lost rank's watcher), not the
        # culprit
        told = stuck or lost or record.get("lost_ranks") or replaced
        # whom srun saw exit first is a bystander when the rank that raised wrote its node's share
        named = {} if told else (rules.raised_first(self.run_dir, (self.job_id, self.restart,
                                                                     step.index),
                                                    step.nodes, per_node)
                                 or heal.culprits(step.srun_lines))
        soft = {n: why for n, why in named.items() if n not in hard}
        soft |= {n: why for n, why in stuck.items() if n not in hard}
        return held, hard, soft

    def probed(self, held: Sequence[str], training: Sequence[str], hard: dict[str, str],
               soft: Mapping[str, str]) -> None:
        """Probe only the nodes the plan would use: one step across them all; when it fails, halves
        of them (:func:`hpc_ddp.shell.heal.bisect_silent`), and the silent ones become hard
        suspects before the plan is made again (three rounds at most). At 512 nodes that is one step
        creation at slurmctld in the common case, not 512, and about 2 x log2(512) = 18 for one
        silent node, in 9 rounds, not 32 rounds of 16."""
        soft_now = {n: w for n, w in soft.items() if n not in self.healer.failed_before}
        strikes = {n: w for n, w in soft.items() if n in self.healer.failed_before}
        for _ in range(3):
            trial = heal.plan(held, training, hard={**hard, **strikes}, soft=soft_now,
                              counts=self.counts,
                              avoid=self.avoid())
            if not trial.nodes or self.probe(trial.nodes):
                return
            silent = {n: f"no answer to a probe step within {PROBE_TIMEOUT_S:g} s"
                      for n in heal.bisect_silent(list(trial.nodes), self.probe)}
            if not silent:
                return
            hard |= silent

    def heal(self, step: Step, record: Mapping[str, Any]) -> str | None:
        """Called by settle for a failure: the next step's plan as a sentence, or None (requeue
        path)."""
        if self.stopping:
            self.healer.why_not = "a stop signal reached the batch shell"
            return None
        point = last_known(self.run_dir)["last_step"]
        held, hard, soft = self.suspects(step, record)
        self.probed(held, step.nodes, hard, soft)
        late = "a stop signal reached the batch shell" if self.stopping else self._walltime()
        if late:  # checked after the probes too: they may take PROBE_TIMEOUT_S
            self.healer.why_not = late
            return None
        return self.healer.decide(record, step.index, held, step.nodes, hard, soft, point,
                                  avoid=self.avoid(),
                                  no_resize=refuses_resize(self.run_dir))

    def _walltime(self) -> str:
        self.end = job_end_time(job_spec(self.environ), self.runner) if self.job else None
        return rules.walltime_problem(self.end, self.clock(), self.cfg.slurm.signal_delay_s,
                                      state=lambda: job_state(job_spec(self.environ), self.runner))

    def step_argv(self, nodes: Sequence[str]) -> list[str]:
        """The supervised command with the step's shape put right after ``srun``."""
        problem = self.command_problem()
        if problem:
            raise HpcDdpError(problem, key="command")
        n = len(nodes)
        shape = [f"--nodes={n}", f"--ntasks={n * self.tasks_per_node}",
                 f"--ntasks-per-node={self.tasks_per_node}", f"--nodelist={','.join(nodes)}"]
        return [self.command[0], *shape, *self.command[1:]]

    def step_environ(self, index: int, healed: Mapping[str, Any] | None) -> dict[str, str]:
        # the run's secret read once for the step's ranks, not once by each (rundir/secret_env.py)
        env = {**self._env_without_step_shape(), **node_local.handed_secret(self.run_dir)}
        if index:
            env[IN_JOB_VAR] = str(index)
            port = self._port(index)
            # the failed step's store may still hold the port you chose: the next one
            if port is not None:
                env["MASTER_PORT"] = str(port)
            env[HEALED_VAR] = json.dumps(healed or {}, sort_keys=True)
        return env

    def _port(self, index: int) -> int | None:
        """A restarted step's rendezvous port where the user chose one (MASTER_PORT,
        dist.master_port): moved on by the restart's number. None otherwise: each attempt's ranks
        draw their own unguessable ports from the run's secret and the attempt
        (:mod:`hpc_ddp.core.store_ports`), which differ from the failed step's."""
        given = self.environ.get("MASTER_PORT") or (None if self.cfg.dist.master_port is None
                                                     else str(self.cfg.dist.master_port))
        if given is None:
            return None
        base = int(given)
        return base + index if base + index <= 65535 else base - index

    def _env_without_step_shape(self) -> dict[str, str]:
        """The batch shell's environment without the job-wide counts srun would read as this step's
        shape."""
        drop = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                "SLURM_TASKS_PER_NODE",
                "SLURM_NTASKS_PER_NODE", HEALED_VAR, IN_JOB_VAR, TIMELINE_VAR)
        return {k: v for k, v in self.environ.items() if k not in drop}

    def run_step(self, nodes: list[str], index: int, healed: dict[str, Any] | None = None,
                 after: Step | None = None) -> Step:
        """Run a step on ``nodes``; ``after``: the failed step it heals (its times go to the new
        step's ranks for the heal's timeline, :mod:`hpc_ddp.core.timeline`)."""
        start = round(self.clock(), 3)
        argv, env = self.step_argv(nodes), self.step_environ(index, healed)
        env[TIMELINE_VAR] = times = self.timeline(after, start)
        rules.note_step(self.run_dir, self.job_id, self.restart, index, compress_hostlist(nodes),
                        start)
        warn_in = rules.warning_due_in(self.end, start, self.clock(), self.cfg.slurm.signal_delay_s)
        self.until = lost_wait.until_lost(self.run_dir, (self.job_id, self.restart, index), nodes,
                                          self.tasks_per_node, self.cfg.slurm.tasks_per_node,
                                          self.not_answering)
        code, lines = self.srun(argv, env, warn_in)
        return Step(nodes, index, code, lines, start, healed, ended=round(self.clock(), 3),
                    times=times)

    def timeline(self, after: Step | None, start: float) -> str:
        """The batch shell's times for the step's timeline: after a failed step, the failure's
        instant, when this shell saw it end and this start; a job's first step, when this shell
        began (a requeue's ranks find the failure, the stopped attempt's end, in the ledger)."""
        if after is None:
            return encode_shell(detected=self.began, launched=start)
        failure = rules.heal_failure_of(self.run_dir, (self.job_id, self.restart, after.index),
                                        after.ended)
        return encode_shell(failure, detected=after.ended, launched=start)
