"""``python -m hpc_ddp.supervise``: the batch shell runs the training steps and heals a failed one in the job.

Slurm hands a job to one batch shell that outlives every step. This is that shell's
program (the last line of both sbatch templates; submitit's teardown after its own
first step). It starts ``srun`` on the nodes that train (the job's nodes less
``slurm.spare_nodes``) and, when the step ends:

1. settles it (:mod:`hpc_ddp.settle`): the attempt is in the ledger whatever killed it;
2. when it failed in a way another try may fix (a rank killed, a crash, a hang, a lost
   node) and ``slurm.max_restarts_in_job`` allows, asks Slurm what the job holds now,
   probes those nodes, leaves out the suspects (:mod:`hpc_ddp.heal`) and starts a new step
   on the chosen nodes with a fresh rendezvous port: the workers resume from the last
   committed snapshot, with a spare in a lost node's place (bit-exact) or on fewer nodes;
3. otherwise takes the requeue path, as settle alone would: requeue under ``slurm.max_failures``,
   or not.

A deterministic error (exit 2), a stop (time-out, preemption, cancel) and a finished run
are never restarted here. The shell takes a SIGTERM (cancel, preemption) as "start no
new step". Needs the job submitted with ``--no-kill`` (both templates and submit do so),
or Slurm ends the whole job when a node fails. No torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp import heal
from hpc_ddp.batching import node_counts
from hpc_ddp.config import RunConfig, load_config
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.helptext import add_version, for_help
from hpc_ddp.hostlist import compress_hostlist, expand_hostlist
from hpc_ddp.preemption import attempt_key, caps, job_spec, read_attempts, requeue
from hpc_ddp.settle import last_known, pick_config, settle
from hpc_ddp.slurm_env import HEALED_VAR, IN_JOB_VAR, rendezvous_endpoint

PROBE_TIMEOUT_S = 20.0  # a node whose slurmd is gone must not eat the retry
EPILOG = """\
examples (the last line of a batch script; the srun line is the step it supervises):
  exec python -m hpc_ddp.supervise runs/mlp/config.yaml -- \\
      srun --kill-on-bad-exit=1 python -m hpc_ddp.worker --config runs/mlp/config.yaml
  python -m hpc_ddp.supervise --exit-code $? runs/mlp/config.yaml -- srun ...   # the first step already ran
"""


@dataclass
class Step:
    """One step of the job: the nodes it ran on, how it ended and what srun said."""

    nodes: list[str]
    index: int = 0  # the in-job restart it is (0: the job's first step)
    code: int = 0
    srun_lines: list[str] = field(default_factory=list)
    start: float | None = None  # when the batch shell started it (None: submitit's own step)


def run_srun(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[int, list[str]]:
    """Run a step; srun's stderr is relayed line by line (it names the failed task's node) and kept."""
    proc = subprocess.Popen(list(argv), env=dict(environ), stderr=subprocess.PIPE, text=True, errors="replace")
    lines: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.startswith("srun:"):
            lines.append(line.rstrip("\n"))
    return proc.wait(), lines


class Supervisor:
    """The steps of one job (one attempt of the run, in Slurm's sense) and the decisions between them."""

    def __init__(self, cfg: RunConfig, environ: Mapping[str, str], command: Sequence[str], *,
                 runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
                 srun: Callable[[Sequence[str], Mapping[str, str]], tuple[int, list[str]]] = run_srun) -> None:
        self.cfg, self.environ, self.command = cfg, environ, list(command)
        self.runner, self.srun = runner, srun
        self.job = environ.get("SLURM_JOB_ID", "")
        self.job_id = int(self.job) if self.job.isdigit() else None
        self.restart = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self.tasks_per_node = int(environ.get("SLURM_NTASKS_PER_NODE", "") or cfg.slurm.tasks_per_node)
        self.counts = node_counts(cfg.slurm.nodes)
        self.healer = heal.Healer(cfg.slurm.max_restarts_in_job, self.counts)
        self.stopping = False

    def held(self) -> list[str]:
        """What the job holds now (scontrol; the batch shell's SLURM_JOB_NODELIST is a fallback, stale after
        a node was removed from the job)."""
        text = self._scontrol("show", "job", self.job)
        nodes = heal.job_nodes(text) if text else []
        return nodes or expand_hostlist(self.environ.get("SLURM_JOB_NODELIST", ""))

    def first_nodes(self) -> list[str]:
        """The first step trains on the job's nodes less the spares (at most the range's maximum)."""
        held = self.held()
        want = max(self.counts[0], min(len(held) - self.cfg.slurm.spare_nodes, self.counts[-1]))
        return held[:want]

    def first_step_nodes(self) -> list[str]:
        """Where the step submitit ran (``srun --nodes=N`` lets Slurm choose): accounting's record of step 0,
        else the first nodes the job holds."""
        try:
            proc = self.runner(["sacct", "-n", "-P", "-j", f"{self.job}.0", "-o", "NodeList"], capture_output=True,
                               text=True, timeout=30)
            text = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
            nodes = expand_hostlist(text) if text and text not in ("None assigned", "(null)") else []
        except (OSError, subprocess.SubprocessError, HpcDdpError):
            nodes = []
        return nodes or self.first_nodes()

    def _scontrol(self, *args: str) -> str:
        try:
            proc = self.runner(["scontrol", *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        return proc.stdout if proc.returncode == 0 else ""

    def probe(self, node: str) -> bool:
        """A short step on the node alone: does its slurmd start a task at all, within the timeout?"""
        argv = ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", f"--nodelist={node}", "--time=1",
                "--kill-on-bad-exit=1", "true"]
        try:
            return self.runner(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                               env=self._env_without_step_shape()).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    def suspects(self, step: Step, record: Mapping[str, Any]) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """What the job holds, and the hard and soft suspects (see :mod:`hpc_ddp.heal`)."""
        held = self.held()
        hard = {n: "the job no longer holds it (Slurm removed it)" for n in step.nodes if n not in held}
        states = heal.node_states(self._scontrol("show", "node", "-o", compress_hostlist(held))) if held else {}
        hard |= {n: f"Slurm says State={s}" for n, s in states.items() if n in held and heal.bad_state(s)}
        soft = heal.culprits(step.srun_lines)
        soft |= heal.stuck_nodes(record.get("stuck_ranks") or [], step.nodes, self.tasks_per_node)
        to_probe = [n for n in held if n not in hard]
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(to_probe)))) as pool:
            answers = dict(zip(to_probe, pool.map(self.probe, to_probe)))
        hard |= {n: f"no answer to a probe step within {PROBE_TIMEOUT_S:g} s" for n, ok in answers.items() if not ok}
        return held, hard, soft

    def heal(self, step: Step, record: Mapping[str, Any]) -> str | None:
        """Called by settle for a failure: the next step's plan as a sentence, or None (requeue path)."""
        if self.stopping:
            self.healer.why_not = "a stop signal reached the batch shell"
            return None
        point = last_known(Path(self.cfg.run_dir))["last_step"]
        held, hard, soft = self.suspects(step, record)
        return self.healer.decide(record, step.index, held, step.nodes, hard, soft, point)

    def step_argv(self, nodes: Sequence[str]) -> list[str]:
        """The supervised command with the step's shape put right after ``srun``."""
        if not self.command or Path(self.command[0]).name != "srun":
            raise HpcDdpError(f"hpc_ddp.supervise runs an srun command; found {self.command[:1]!r}",
                              key="command", hint="put the step after '--': -- srun --kill-on-bad-exit=1 ...")
        n = len(nodes)
        shape = [f"--nodes={n}", f"--ntasks={n * self.tasks_per_node}",
                 f"--ntasks-per-node={self.tasks_per_node}", f"--nodelist={','.join(nodes)}"]
        return [self.command[0], *shape, *self.command[1:]]

    def step_environ(self, index: int) -> dict[str, str]:
        env = self._env_without_step_shape()
        if index:
            env[IN_JOB_VAR] = str(index)
            env["MASTER_PORT"] = str(self._port(index))  # the failed step's store may still hold its port
            env[HEALED_VAR] = json.dumps(self.healer.healed or {}, sort_keys=True)
        return env

    def _port(self, index: int) -> int:
        """The first step's port (the workers' rule: MASTER_PORT, else dist.master_port, else from the job
        id), moved on by the in-job restart's number."""
        given = {} if self.cfg.dist.master_port is None else {"MASTER_PORT": str(self.cfg.dist.master_port)}
        _, base = rendezvous_endpoint({**given, **self.environ})
        return base + index if base + index <= 65535 else base - index

    def _env_without_step_shape(self) -> dict[str, str]:
        """The batch shell's environment without the job-wide counts srun would read as this step's shape."""
        drop = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_TASKS_PER_NODE",
                "SLURM_NTASKS_PER_NODE", HEALED_VAR, IN_JOB_VAR)
        return {k: v for k, v in self.environ.items() if k not in drop}

    def run_step(self, nodes: list[str], index: int) -> Step:
        start = round(time.time(), 3)
        code, lines = self.srun(self.step_argv(nodes), self.step_environ(index))
        return Step(nodes, index, code, lines, start)


def supervise(sup: Supervisor, first: Step | None, say: Callable[[str], None]) -> int:
    """Run steps until one ends without a failure to heal; returns the last step's exit code."""
    run_dir, spec, restart = Path(sup.cfg.run_dir), job_spec(sup.environ), sup.restart
    step = first or sup.run_step(sup.first_nodes(), 0)
    while True:
        sup.healer.why_not = ""
        outcome = settle(run_dir, job_id=sup.job_id, restart_count=restart, exit_code=step.code,
                         limits=caps(sup.cfg.slurm), requeue_job=(lambda: requeue(spec)) if spec else None,
                         in_job=step.index, heal=lambda record, s=step: sup.heal(s, record),
                         extra={"hosts": compress_hostlist(step.nodes),
                                **({"start": step.start} if step.start else {})})
        say(f"attempt {restart} of job {spec or '-'}, job step {step.index} on {compress_hostlist(step.nodes)}: "
            f"{outcome}" + (f" (not healed in the job: {sup.healer.why_not})" if sup.healer.why_not else ""))
        if not sup.healer.next_nodes:
            return step.code
        nodes, sup.healer.next_nodes = sup.healer.next_nodes, []
        step = sup.run_step(nodes, step.index + 1)


def srun_lines_before(stderr: Path, marker: str = "hpc_ddp.supervise:", tail_bytes: int = 1 << 16) -> list[str]:
    """srun's own lines in this shell's stderr file since the last supervise line: what srun said of the step
    submitit ran before handing over (its srun writes there; a requeued job appends to the same file)."""
    try:
        with open(stderr, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    last = max((i for i, line in enumerate(lines) if line.startswith(marker)), default=-1)
    return [line for line in lines[last + 1:] if line.startswith("srun:")]


def ran_on(sup: Supervisor) -> list[str]:
    """The nodes of the job's first step, from its ledger line (``hosts``), when its workers wrote one."""
    key = (sup.job_id, sup.restart, 0)
    lines = [a for a in read_attempts(Path(sup.cfg.run_dir)) if attempt_key(a) == key and a.get("hosts")]
    return expand_hostlist(lines[-1]["hosts"]) if lines else []


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.supervise", description=for_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                                     usage="%(prog)s [--exit-code N] CONFIG [CONFIG ...] -- srun [ARGS] PROGRAM\n"
                                     "({config} in the command is replaced by this array element's config)")
    add_version(parser)
    parser.add_argument("--exit-code", type=int, default=None, metavar="N",
                        help="the first step already ran (submitit's srun) and ended with this code")
    parser.add_argument("configs", nargs="+", help="the run's config.yaml (one per array element, in order)")
    ours, command = _split(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(ours)
    environ = os.environ if environ is None else environ
    say = lambda text: print(f"hpc_ddp.supervise: {text}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        config = pick_config(args.configs, environ)
        cfg = load_config([Path(config)])
        sup = Supervisor(cfg, environ, [part.replace("{config}", config) for part in command])
        _stop_on_term(sup)
        first = None
        if args.exit_code is not None:
            first = Step(ran_on(sup) or sup.first_step_nodes(), 0, args.exit_code,
                         srun_lines_before(Path("/proc/self/fd/2")))
        elif not command:
            parser.error("give the step to run after '--' (or --exit-code for one that already ran)")
        return supervise(sup, first, say)
    except HpcDdpError as err:
        say(f"error: {err}")
        return args.exit_code or 1


def _stop_on_term(sup: Supervisor) -> None:
    """A SIGTERM (cancel, preemption) to the batch shell: start no new step; the running one gets its own."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum: int, frame: object) -> None:
        sup.stopping = True
    signal.signal(signal.SIGTERM, on_term)


if __name__ == "__main__":
    sys.exit(main())
