"""``python -m hpc_ddp.slurm_local {start,stop,status,env,preempt-signal}``: the throw-away cluster's CLI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.slurm_local.conf import PREEMPT_SIGNALS, ClusterSpec
from hpc_ddp.slurm_local.daemons import APT_PACKAGES, is_up, missing_pieces, set_preempt_signal, start, stop

EPILOG = f"""\
examples:
  apt-get install -y --no-install-recommends {APT_PACKAGES}
  python -m hpc_ddp.slurm_local start --nodes 2
  eval "$(python -m hpc_ddp.slurm_local env)"     # point sbatch/srun/squeue at it
  srun -N2 --ntasks-per-node=2 hostname
  python -m hpc_ddp.slurm_local preempt-signal term   # a running cluster preempts as most clusters do
  python -m hpc_ddp.slurm_local stop

Partitions: debug (default, preemptable, GraceTime 10 s) and high (preempts debug). A preempted job
gets its own --signal (our warning signal; --preempt-signal user, the default) or SIGTERM, then SIGKILL
after the grace time (term: Slurm's default and most clusters'): `start --preempt-signal term`, or
`preempt-signal term|user` to switch a running cluster for every job on it (scontrol reconfigure).
Start wipes the state directory: job ids begin at 1 against an empty accounting DB.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.slurm_local", description=__doc__,
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["start", "stop", "status", "env", "preempt-signal"],
                        help="start the cluster (a running one is kept as it is), stop it, say whether it is up, "
                        "print its SLURM_CONF export, or switch how a running cluster preempts")
    parser.add_argument("mode", nargs="?", choices=PREEMPT_SIGNALS,
                        help="with preempt-signal: user (a preempted job gets its --signal) or term (SIGTERM)")
    parser.add_argument("--root", type=Path, default=ClusterSpec.root,
                        help="state directory: config, pid files, logs (default %(default)s)")
    parser.add_argument("--nodes", type=int, default=ClusterSpec.nodes, help="slurmd nodes (default %(default)s)")
    parser.add_argument("--cpus-per-node", type=int, default=ClusterSpec.cpus_per_node,
                        help="CPUs each node declares (default %(default)s)")
    parser.add_argument("--preempt-signal", choices=PREEMPT_SIGNALS, default=ClusterSpec.preempt_signal,
                        help="how a preempted job is told: its --signal (user) or SIGTERM (term); default %(default)s")
    parser.add_argument("--no-accounting", action="store_true",
                        help="skip MariaDB + slurmdbd (faster start; sacct will not work)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1 or args.cpus_per_node < 1:
        print("error: --nodes and --cpus-per-node must be >= 1", file=sys.stderr)
        return 2
    spec = ClusterSpec(root=args.root, nodes=args.nodes, cpus_per_node=args.cpus_per_node,
                       accounting=not args.no_accounting, preempt_signal=args.preempt_signal)
    try:
        if args.command == "start":
            began = start(spec)
            print(f"{'started' if began else 'already running'}: {spec.nodes} nodes, "
                  f"SLURM_CONF={spec.conf_path}")
        elif args.command == "stop":
            print(f"stopped {len(stop(spec))} daemons")
        elif args.command == "preempt-signal":
            mode = args.mode or args.preempt_signal
            set_preempt_signal(spec, mode)
            print(f"preempted jobs now get {'their --signal' if mode == 'user' else 'SIGTERM, then SIGKILL after GraceTime'}")
        elif args.command == "env":
            print(f"export SLURM_CONF={spec.conf_path}")
        else:
            up = is_up(spec)
            print(f"{'up' if up else 'down'}: SLURM_CONF={spec.conf_path}")
            missing = missing_pieces(spec)
            if missing:
                print(f"missing: {', '.join(missing)}")
            return 0 if up else 1
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
