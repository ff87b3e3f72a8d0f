"""``python -m hpc_ddp.supervise``: the batch shell runs the training steps and heals a failed one
in the job.

Slurm hands a job to one batch shell that outlives every step. This is that shell's
program (the last line of both sbatch templates; submitit's teardown after its own
first step). It starts ``srun`` on the nodes that train (the job's nodes less
``slurm.spare_nodes``) and, when the step ends:

1. settles it (:mod:`hpc_ddp.shell.settle`): the attempt is in the ledger whatever killed it;
2. when it failed in a way another try may fix (a rank killed, a crash, a hang, a lost
   node) and ``slurm.max_restarts_in_job`` allows, asks Slurm what the job holds now,
   probes those nodes, leaves out the suspects (:mod:`hpc_ddp.shell.heal`) and starts a new step
   on the chosen nodes with a fresh rendezvous port: the workers resume from the last
   committed snapshot, with a spare in a lost node's place (bit-exact) or on fewer nodes;
3. otherwise takes the requeue path, as settle alone would: requeue under ``slurm.max_failures``,
   or not.

A step that waits only for nodes its survivors declared lost or Slurm flags NOT_RESPONDING
(a frozen or cut-off node: srun would wait for Slurm to mark it down) is ended there and
healed at once (hpc_ddp.shell.lost_wait; --watch does it beside submitit's first step).

A deterministic error (exit 2), a stop (time-out, preemption, cancel) and a finished run
are never restarted here. The shell takes a SIGTERM (cancel, preemption) as "start no
new step". Needs the job submitted with ``--no-kill`` (both templates and submit do so),
or Slurm ends the whole job when a node fails. No torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpc_ddp.shell import heal, lost_wait
from hpc_ddp.shell.supervisor import Supervisor
from hpc_ddp.rundir import layout, losses
from hpc_ddp.shell import shell_rules as rules
from hpc_ddp.core.config import load_config
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.core.hostlist import compress_hostlist, expand_hostlist
from hpc_ddp.rundir.ledger import attempt_key, caps, read_attempts
from hpc_ddp.core.slurm_jobs import job_fields, job_spec, start_time
from hpc_ddp.shell.chain import batch_shell_requeue
from hpc_ddp.core.stopping import term_reason
from hpc_ddp.shell.settle import pick_config, settle
from hpc_ddp.shell.steps import Step, srun_lines_before

EPILOG = """\
examples (the last line of a batch script; the srun line is the step it supervises):
  exec python -m hpc_ddp.supervise runs/mlp/config.yaml -- \\
      srun --kill-on-bad-exit=1 python -m hpc_ddp.worker --config runs/mlp/config.yaml
  # the first step already ran:
  python -m hpc_ddp.supervise --exit-code $? runs/mlp/config.yaml -- srun ...
"""


def supervise(sup: Supervisor, first: Step | None, say: Callable[[str], None]) -> int:
    """Run steps until one ends without a failure to heal; returns the last step's exit code.

    Whatever goes wrong in here after a step ended (a healer's bug, srun missing for the next step),
    the step's line is in the ledger and the requeue path runs: no failure that could be retried
    ends the job unrecorded."""
    step = first or sup.run_step(sup.first_nodes(), 0)
    while True:
        sup.healer.why_not = ""
        can_heal = not sup.command_problem()
        outcome = _settle(sup, step, heal=can_heal)
        say(f"attempt {sup.restart} of job {job_spec(sup.environ) or '-'}, job step {step.index} "
            "on "
            f"{compress_hostlist(step.nodes)}: {outcome}"
            + (f" (not healed in the job: {sup.healer.why_not})" if sup.healer.why_not else "")
            + ("" if can_heal else f" (not healed in the job: {sup.command_problem()})"))
        if not sup.healer.next_nodes:
            return 0 if chained(sup, step) else step.code
        nodes, healed, sup.healer.next_nodes = sup.healer.next_nodes, sup.healer.healed, []
        # a SIGTERM after the decision: start nothing; Slurm requeues a preempted job itself
        if sup.stopping:
            say("a stop signal reached the batch shell: the planned step is not started")
            return step.code
        try:
            step = sup.run_step(nodes, step.index + 1, healed, after=step)
        # the step could not start: take the requeue path for the last one
        except Exception as err:  # noqa: BLE001
            say(f"error: the next job step could not start ({type(err).__name__}: {err}); taking "
                "the requeue path")
            say(f"attempt {sup.restart}, job step {step.index}: {_settle(sup, step, heal=False)}")
            return step.code or 1


def _settle(sup: Supervisor, step: Step, *, heal: bool) -> str:
    spec = job_spec(sup.environ)
    return settle(sup.run_dir, job_id=sup.job_id, restart_count=sup.restart, exit_code=step.code,
                  limits=caps(sup.cfg.slurm),
                  requeue_job=batch_shell_requeue(sup.run_dir,
                                                  (sup.job_id, sup.restart, step.index), spec,
                                                  sup.environ, sup.runner) if spec else None,
                  in_job=step.index, heal=(lambda record: sup.heal(step, record)) if heal else None,
                  stop_reason=lambda: term_reason(job_fields(spec), sup.restart) or "preemption",
                  logs=lambda: job_logs(sup.run_dir, sup.job_id),
                  extra={"hosts": compress_hostlist(step.nodes), **_started(step, spec),
                         **({"healed": step.healed} if step.healed else {}),
                         **rules.shell_timeline(step.times, step.index),
                         **losses.ledger_fields(sup.run_dir, sup.job_id, sup.restart, step.index)})


def _started(step: Step, spec: str) -> dict[str, float]:
    """The step's start for its line: the batch shell's own step's, or (submitit's step, which
    started before this shell) the attempt's start as Slurm says; without one, status would leave
    its time out."""
    start = step.start if step.start else start_time(job_fields(spec)) if spec else None
    return {"start": round(start, 3)} if start else {}


def chained(sup: Supervisor, step: Step) -> bool:
    """Whether this step's stop submitted the run's next job (Slurm refuses requeue): the job then
    ended as planned, and says so with exit 0 (sacct shows COMPLETED, not FAILED, for a link of the
    chain)."""
    key = (sup.job_id, sup.restart, step.index)
    return any(a.get("next_job") for a in read_attempts(sup.run_dir) if attempt_key(a) == key)


def job_logs(run_dir: Path, job_id: int | None) -> list[Path]:
    """The job's output files in the run dir's Slurm log folder (submitit's ``JOB_0_log.err``, a
    template's ``JOB.out``): written through this node's srun, so this node's listing of them is
    current."""
    folder = layout.slurm_logs(run_dir)
    found = {*folder.glob(f"{job_id}_*"),
             *folder.glob(f"{job_id}.*")} if job_id is not None else set()
    return sorted(path for path in found if path.suffix in (".err", ".out"))


def ran_on(sup: Supervisor) -> list[str]:
    """The nodes of the job's first step, from its ledger line (``hosts``), when its workers wrote
    one: a step that lost a node wrote none, and then they come from the step's shape
    (:meth:`Supervisor.first_step_nodes`)."""
    key = (sup.job_id, sup.restart, 0)
    lines = [a for a in read_attempts(Path(sup.cfg.run_dir)) if attempt_key(a) == key
             and a.get("hosts")]
    return expand_hostlist(lines[-1]["hosts"]) if lines else []


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.supervise",
                                     description=for_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EPILOG,
                                     usage="%(prog)s [--exit-code N] CONFIG [CONFIG ...] -- srun "
                                           "[ARGS] PROGRAM\n"
                                     "({config} in the command is replaced by this array element's "
                                     "config)")
    add_version(parser)
    parser.add_argument("--exit-code", type=int, default=None, metavar="N",
                        help="the first step already ran (submitit's srun) and ended with this "
                             "code")
    parser.add_argument("--watch", action="store_true",
                        help="in the background of a submitit job's batch script, before its srun: "
                             "end that srun once only nodes the survivors declared lost (or Slurm "
                             "flags NOT_RESPONDING) are left "
                             "(hpc_ddp.shell.lost_wait), so the job heals without waiting for "
                             "Slurm to mark them down")
    parser.add_argument("configs", nargs="+", help="the run's config.yaml (one per array element, "
                                                   "in order)")
    ours, command = _split(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(ours)
    environ = os.environ if environ is None else environ
    say = lambda text: print(f"hpc_ddp.supervise: {text}", file=sys.stderr,
                             flush=True)  # noqa: E731
    try:
        config = pick_config(args.configs, environ)
        cfg = load_config([Path(config)])
    except HpcDdpError as err:
        say(f"error: {err}")
        return args.exit_code or 1
    sup = Supervisor(cfg, environ, [part.replace("{config}", config) for part in command])
    if args.watch:
        return _watch(sup)
    _stop_on_term(sup)
    if args.exit_code is None and not command:
        parser.error("give the step to run after '--' (or --exit-code for one that already ran)")
    if sup.command_problem():
        say(f"error: {sup.command_problem()}")
    try:
        lost = rules.settle_lost_step(sup.run_dir, sup.job_id, sup.restart, time.time())
        if lost:
            say(f"job step {lost.get('in_job', 0)} of attempt {lost['restart_count']} of job "
                f"{lost['job_id']} on "
                f"{lost.get('hosts')} left no ledger line: recorded as lost")
        first = None
        if args.exit_code is not None:
            first = Step(ran_on(sup) or sup.first_step_nodes(), 0, args.exit_code,
                         srun_lines_before(Path("/proc/self/fd/2")), ended=sup.began)
        return supervise(sup, first, say)
    # the last resort: the step's line and the requeue path, whatever broke
    except Exception as err:  # noqa: BLE001
        say(f"error: {type(err).__name__}: {err}")
        if args.exit_code is not None:
            say(f"job step 0: {_settle(sup, Step([], 0, args.exit_code), heal=False)}")
        return args.exit_code or 1


def _watch(sup: Supervisor) -> int:
    """``--watch``: beside submitit's srun of the job's first step, end it once only lost nodes are
    left (:func:`hpc_ddp.shell.lost_wait.watch_first_step`); the teardown line then settles it."""
    lost_wait.watch_first_step(
        sup.run_dir, (sup.job_id, sup.restart, 0), sup.tasks_per_node, sup.cfg.slurm.tasks_per_node,
        lambda: heal.job_nodes(sup.scontrol("show", "step", f"{sup.job}.0")),
        lambda text: print(f"hpc_ddp.supervise --watch: {text}", file=sys.stderr, flush=True),
        sup.not_answering)
    return 0


def _stop_on_term(sup: Supervisor) -> None:
    """A SIGTERM (cancel, preemption) to the batch shell: start no new step; the running one gets
    its own."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum: int, frame: object) -> None:
        sup.stopping = True
    signal.signal(signal.SIGTERM, on_term)


if __name__ == "__main__":
    sys.exit(main())
