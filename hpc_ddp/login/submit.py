"""``python -m hpc_ddp.submit CONFIG.yaml [key=value ...]``: run a config as a Slurm job.

Submits through submitit (nodes x tasks_per_node tasks, each running the
worker) after preflight checks; ``--local`` rehearses the job on this machine
(nodes x tasks_per_node gloo processes with the Slurm variables srun would set);
``--dry-run`` shows the sbatch script and what every rank would derive;
``--multirun`` submits a job array, one run per combination. Login-node safe:
nothing here imports torch or runs the task's code.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import NoReturn

from hpc_ddp.core.config import RunConfig, save_config
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.login.dry_run import dry_run, healing_line
from hpc_ddp.login.resolve import found_from, resolve_all, resume_command
from hpc_ddp.login.sbatch import LAUNCHERS, render
from hpc_ddp.rundir import layout

# what only a submit, an --emit-sbatch or a --local run needs is imported where it runs: --dry-run
# (benchmark B1) does without the run dir's guards, the rehearsal, submitit's executor

EPILOG = """\
examples:
  python -m hpc_ddp.submit examples/mlp.yaml slurm.partition=gpu slurm.gpus_per_node=4 \\
      slurm.tasks_per_node=4
  python -m hpc_ddp.submit examples/mlp.yaml --resume           # continue a stopped run, new job
  python -m hpc_ddp.submit runs/mlp --resume train.max_steps=200
                                        # the run dir stands in for the YAML
  python -m hpc_ddp.submit examples/mlp.yaml slurm.nodes=1-2 train.global_batch_size=256
                                        # 1 or 2 nodes
  python -m hpc_ddp.submit examples/mlp.yaml --emit-sbatch job.sbatch && sbatch job.sbatch
  python -m hpc_ddp.submit examples/mlp.yaml --emit-sbatch job.sbatch --launcher torchrun
                                        # torchrun per node
  python -m hpc_ddp.submit examples/mlp.yaml --multirun train.lr=0.1,0.01 train.seed=1,2
                                        # 4-run job array
  python -m hpc_ddp.submit examples/mlp.yaml --local            # 2 nodes x 2 tasks on this machine
  python -m hpc_ddp.submit examples/mlp.yaml --local slurm.nodes=1 train.max_steps=20
  python -m hpc_ddp.submit examples/mlp.yaml --dry-run slurm.nodes=4 slurm.tasks_per_node=8
  python -m hpc_ddp.submit --profile mycluster examples/mlp.yaml user.eval_every=100
                                        # cluster keys, own keys
  python -m hpc_ddp.submit examples/mlp.yaml --local --preempt-at 7,19 --timeout-at 31
                                        # stops, requeues, resumes
  python -m hpc_ddp.submit examples/mlp.yaml --local slurm.spare_nodes=1 --fail-at 30
                                        # a node lost, healed
  python -m hpc_ddp.submit examples/mlp.yaml --local --freeze-at 30:0 dist.liveness_s=5
                                        # a node frozen, found
  python -m hpc_ddp.submit examples/mlp.yaml --local --resume slurm.nodes=1 \\
      train.global_batch_size=128
                                        # continue a 2 x 2 rehearsal on 1 node, same global batch

Arguments ending in .yaml/.yml are config files (merged in order, over the cluster profile that
--profile or HPC_DDP_PROFILE names; the run is named by the last file unless one sets name);
KEY=VALUE arguments override them (see docs/config.md for every key; your own settings go under
user.*, e.g. user.eval_every=100). The resolved config is written to RUN_DIR/config.yaml; with
--multirun each combination gets RUN_DIR/<label>, e.g. runs/mlp/lr=0.1,seed=1. With --resume the
run's own RUN_DIR/config.yaml is the base: only the KEY=VALUE given with --resume change it. Also
installed as the console script `hpc-ddp-submit`.
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with the override to type for an sbatch or torchrun flag given as ours
    (``--nodes=2``)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        from hpc_ddp.core.config.hints import flag_hint

        if message.startswith("unrecognized arguments:"):
            args, hints = message.split(":", 1)[1].split(), []
            for arg, after in zip(args, args[1:] + [""]):
                spaced = "=" not in arg and after and not after.startswith("-") and "=" not in after
                hint = flag_hint(f"{arg}={after}" if spaced else arg)  # -t 2:00:00 as -t=2:00:00
                hints += [hint.replace(f"{arg}={after} ->", f"{arg} {after} ->")] if hint else []
            if hints:
                message += ("\nHINT: hpc_ddp takes Slurm's settings as config keys, not sbatch "
                            "flags: "
                            + "; ".join(hints) + " (docs/config.md; any other sbatch option: "
                            "slurm.sbatch_extra.OPTION=VALUE)")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m hpc_ddp.submit", description=for_help(__doc__), epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    parser.add_argument("items", nargs="+", metavar="CONFIG.yaml | KEY=VALUE",
                        help="config files, then overrides such as train.lr=0.01")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="rehearse the job on this machine with "
                                                           "gloo")
    mode.add_argument("--dry-run", action="store_true",
                      help="show every rank's derived environment; run nothing")
    mode.add_argument("--emit-sbatch", type=Path, metavar="PATH",
                      help="write a standalone sbatch script for this config (from "
                           "slurm/ddp.sbatch, or "
                      "slurm/ddp_torchrun.sbatch with --launcher torchrun); submit it yourself "
                      "with `sbatch PATH`")
    parser.add_argument("--launcher", choices=sorted(LAUNCHERS), default="srun",
                        help="with --emit-sbatch: srun starts every worker (default), or one "
                             "torchrun per node")
    parser.add_argument("--multirun", action="store_true",
                        help="KEY=V1,V2 overrides sweep: one job array, one run dir per "
                             "combination")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in RUN_DIR from its newest snapshot (a new job; "
                             "with --local, a "
                        "new rehearsal), with the run's own config.yaml and only the KEY=VALUE "
                        "given now on top; "
                        "CONFIG may be the run dir")
    parser.add_argument("--profile", metavar="NAME",
                        help="merge the cluster profile NAME "
                             "(~/.config/hpc_ddp/profiles/NAME.yaml, under "
                        "$XDG_CONFIG_HOME if set) under the config files and overrides; default: "
                        "$HPC_DDP_PROFILE; "
                        "'none': no profile (python -m hpc_ddp.profiles list shows them)")
    parser.add_argument("--no-preflight", action="store_true",
                        help="submit without the login-node checks (Slurm commands, partition, run "
                             "dir, "
                        "geometry, task module)")
    _add_rehearsal_flags(parser)
    return parser


def _add_rehearsal_flags(parser: argparse.ArgumentParser) -> None:
    """``--local``'s faults: the stops and failures a rehearsal plays on this machine (a job on the
    cluster gets its own from Slurm)."""
    parser.add_argument("--preempt-at", type=_steps, default=[], metavar="STEPS",
                        help="with --local: preempt (SIGTERM every rank) after these steps, e.g. "
                             "7,19 (0: before the "
                        "first step)")
    parser.add_argument("--timeout-at", type=_steps, default=[], metavar="STEPS",
                        help="with --local: send the time-out warning signal after these steps, "
                             "e.g. 31")
    parser.add_argument("--fail-at", type=_fail_at, default=[], metavar="STEP[:NODE],...",
                        help="with --local: lose a simulated node (SIGKILL its ranks right after "
                             "their step STEP), e.g. 30, "
                        "30:0 or 30,60 (NODE: its index among the training nodes, from 0; default "
                        "the last). The rehearsal "
                        "heals as the batch shell would: a spare takes its place "
                        "(slurm.spare_nodes), or the run "
                        "goes on with fewer nodes (a slurm.nodes range); else the requeue path "
                        "(slurm.max_failures)")
    parser.add_argument("--freeze-at", type=_fail_at, default=[], metavar="STEP[:NODE],...",
                        help="with --local: freeze a simulated node (SIGSTOP its ranks) after "
                             "STEP, as --fail-at "
                        "names it; nothing closes, so the rank watching it declares it lost after "
                        "dist.liveness_s "
                        "and the step ends (exit 6), healed like --fail-at")


def _steps(text: str) -> list[int]:
    try:
        steps = sorted(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        message = f"expected step numbers like 7,19; found {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if any(s < 0 for s in steps):
        raise argparse.ArgumentTypeError("steps are >= 0 (0: after start-up, before the first "
                                         f"step); found {text!r}")
    return steps


def _fail_at(text: str) -> list[tuple[int, int | None]]:
    from hpc_ddp.rehearsal.local_heal import parse_fail_at

    try:
        return parse_fail_at(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_preflight(cfg: RunConfig, slurm: bool = True) -> None:
    """Print the warnings; raise with every error when there is one."""
    from hpc_ddp.login.preflight import preflight

    findings = preflight(cfg, slurm=slurm)
    for finding in findings:
        if finding.level in ("warning", "note"):
            print(finding, file=sys.stderr)
    errors = [f for f in findings if f.level == "error"]
    if slurm and not errors:
        from hpc_ddp.core.requeue_policy import requeue_path

        print(f"preflight: {requeue_path(cfg.slurm)}", file=sys.stderr)
    if errors:
        raise HpcDdpError("preflight found problems; nothing was submitted (--no-preflight skips "
                          "the checks)\n"
                          + "\n".join(map(str, errors)), key=errors[0].key)


def emit_sbatch(cfg: RunConfig, path: Path, launcher: str) -> int:
    from hpc_ddp.login.guards import check_free
    from hpc_ddp.rundir import node_local

    check_free(cfg, resume=True, earlier=False)  # a live run's config is never rewritten
    config_path = save_config(cfg, layout.config(cfg.run_dir))
    node_local.run_secret(cfg.run_dir)  # before any rank: it names the run's node-local folders
    # Slurm does not create --output's dir
    layout.slurm_logs(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    # where train.task's module was found: the job runs there, wherever sbatch is called
    workdir = os.getcwd()
    path.write_text(render(cfg, str(config_path), python=sys.executable, launcher=launcher,
                           workdir=workdir))
    # executable, but never more open than the umask lets a new file be
    path.chmod(0o777 & ~current_umask())
    print(f"wrote {path} ({launcher} launcher) for run {cfg.name} (config {config_path}); "
          f"submit it from any directory with: sbatch {shlex.quote(str(path))}\n"
          f"  the job runs in {workdir} (its WORKDIR line), {found_from(cfg)}\n"
          f"  {healing_line(cfg.slurm)}")
    return 0


def current_umask() -> int:
    """This process's umask (set back at once: the CLI is one thread)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _usage_error(args: argparse.Namespace) -> str | None:
    if (args.preempt_at or args.timeout_at or args.fail_at or args.freeze_at) and not args.local:
        return ("--preempt-at, --timeout-at and --fail-at go with --local, as does --freeze-at. "
                "HINT: they rehearse "
                "stops and failures on this machine; add --local (a job on the cluster gets its "
                "stops from Slurm)")
    if args.launcher != "srun" and not args.emit_sbatch:
        return "--launcher goes with --emit-sbatch (submit and --local start one worker per task)"
    if args.multirun and args.emit_sbatch:
        return ("--multirun submits a job array; --emit-sbatch writes one script for one run (drop "
                "one of them)")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options may come between overrides
    if args.profile is not None:
        # the key the run records; --resume's command keeps it
        args.items.append(f"profile={args.profile}")
    problem = _usage_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfgs = resolve_all(args.items, args.multirun, args.resume)
        if args.dry_run:
            return dry_run(cfgs, checks=not args.no_preflight)
        if args.local:
            from hpc_ddp.core.extras import require_extras
            from hpc_ddp.login.rehearse import check_program, run_local

            # the Slurm path checks these in preflight; every point before any rehearsal starts
            for cfg in cfgs:
                require_extras(cfg.metrics)
                if not args.no_preflight:
                    # train.script's file: a missing one failed every rank with exit 2
                    check_program(cfg)
            again = resume_command(args.items, args.multirun)
            codes = [run_local(cfg, args.preempt_at, args.timeout_at, args.resume, again,
                               args.fail_at, args.freeze_at)
                     for cfg in cfgs]
            return next((code for code in codes if code), 0)
        if not args.no_preflight:
            check_preflight(cfgs[0], slurm=not args.emit_sbatch)
        if args.emit_sbatch:
            return emit_sbatch(cfgs[0], args.emit_sbatch, args.launcher)
        from hpc_ddp.login.queue import submit_slurm

        return submit_slurm(cfgs, args.resume)
    except HpcDdpError as err:
        from hpc_ddp.core.codes import EXIT_LOCKED
        from hpc_ddp.rundir.runlock import RunLockedError

        print(f"error: {err}", file=sys.stderr)
        return EXIT_LOCKED if isinstance(err, RunLockedError) else 2


if __name__ == "__main__":
    sys.exit(main())
