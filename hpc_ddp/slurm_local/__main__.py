"""``python -m hpc_ddp.slurm_local {start,stop,status,env,preempt-signal,fault}``: the throw-away
cluster's CLI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.slurm_local import faults, isolation
from hpc_ddp.slurm_local.conf import PREEMPT_SIGNALS, ClusterSpec
from hpc_ddp.slurm_local.daemons import (APT_PACKAGES, is_up, missing_pieces, running_spec,
                                         set_preempt_signal, start,
                                         stop)
from hpc_ddp.slurm_local.machines import PIECES

EPILOG = f"""\
examples:
  apt-get install -y --no-install-recommends {APT_PACKAGES}
  python -m hpc_ddp.slurm_local start              # 3 nodes; --nodes N for more or fewer
  eval "$(python -m hpc_ddp.slurm_local env)"     # point sbatch/srun/squeue at it
  srun -N3 hostname                                # n1 n2 n3: each node is a machine of its own
  python -m hpc_ddp.slurm_local fault n2 freeze    # a node fault (each ACTION: see ARG above)
  python -m hpc_ddp.slurm_local status             # each node's Slurm state and faults
  python -m hpc_ddp.slurm_local fault n2 normal
  python -m hpc_ddp.slurm_local preempt-signal term   # a running cluster preempts as most do
  python -m hpc_ddp.slurm_local stop

Partitions: debug (default, preemptable, GraceTime 10 s) and high (preempts debug). A preempted job
gets its own --signal (our warning signal; --preempt-signal user, the default) or SIGTERM, then
SIGKILL after the grace time (term: Slurm's default and most clusters'):
`start --preempt-signal term`, or `preempt-signal term|user` to switch a running cluster for every
job on it (scontrol reconfigure). Start wipes the state directory: job ids begin at 1 against an
empty accounting DB.

Each node is a machine of its own where this machine allows (root, namespaces, bindfs, cgroup v1):
its own network namespace and address (10.77.0.K; the login side is 10.77.0.254), hostname, /tmp and
/dev/shm, its own cached view of the shared root --shared (default /var/tmp/hpc_ddp-shared: put run
dirs there) and its own freezer and cpu cgroups. `status` says what could not be isolated and why;
--one-machine turns it all off (every node on this machine's loopback, /tmp and /dev/shm, as
before). See docs/slurm-local.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.slurm_local", description=__doc__,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["start", "stop", "status", "env", "preempt-signal",
                                            "fault"],
                        help="start the cluster (a running one is kept as it is), stop it, say "
                             "whether it is up "
                        "and how each node stands, print its SLURM_CONF export, switch how a "
                        "running cluster "
                        "preempts, or play a node fault")
    parser.add_argument("args", nargs="*", metavar="ARG",
                        help=f"preempt-signal: {'|'.join(PREEMPT_SIGNALS)} (a preempted job gets "
                             "its --signal, or "
                        f"SIGTERM); fault: NODE ACTION, ACTION one of {'|'.join(faults.ACTIONS)}")
    parser.add_argument("--root", type=Path, default=ClusterSpec.root,
                        help="state directory: config, pid files, logs (default %(default)s)")
    parser.add_argument("--nodes", type=int, default=ClusterSpec.nodes,
                        help="slurmd nodes (default %(default)s)")
    parser.add_argument("--cpus-per-node", type=int, default=ClusterSpec.cpus_per_node,
                        help="CPUs each node declares (default %(default)s)")
    parser.add_argument("--preempt-signal", choices=PREEMPT_SIGNALS,
                        default=ClusterSpec.preempt_signal,
                        help="how a preempted job is told: its --signal (user) or SIGTERM (term); "
                             "default %(default)s")
    parser.add_argument("--no-accounting", action="store_true",
                        help="skip MariaDB + slurmdbd (faster start; sacct will not work)")
    parser.add_argument("--one-machine", action="store_true",
                        help="do not make each node a machine of its own: shared network "
                             "(loopback), hostname, "
                        "/tmp, /dev/shm and a coherent filesystem")
    parser.add_argument("--shared", type=Path, default=ClusterSpec.shared,
                        help="the shared root every node sees through its own cached view; put run "
                             "dirs here "
                        "(default %(default)s)")
    parser.add_argument("--cache-s", type=int, default=ClusterSpec.cache_s,
                        help="how long a node caches names of the shared root, present and missing "
                             "(attributes: fetched at "
                        "every open, as NFS does), "
                        "as an NFS client's acdirmax (default %(default)s; 0: a coherent view)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1 or args.cpus_per_node < 1 or args.cache_s < 0:
        print("error: --nodes and --cpus-per-node must be >= 1, --cache-s >= 0", file=sys.stderr)
        return 2
    wanted = {"preempt-signal": (0, 1), "fault": (2, 2)}.get(args.command, (0, 0))
    if not wanted[0] <= len(args.args) <= wanted[1]:
        usage = {"preempt-signal": "preempt-signal [user|term]",
                 "fault": "fault NODE ACTION (e.g. fault n2 freeze)"}
        print(f"error: {args.command} takes {usage.get(args.command, 'no arguments')}; "
              f"found {' '.join(args.args) or 'none'}", file=sys.stderr)
        return 2
    spec = ClusterSpec(root=args.root, nodes=args.nodes, cpus_per_node=args.cpus_per_node,
                       accounting=not args.no_accounting, preempt_signal=args.preempt_signal,
                       machines=not args.one_machine, shared=args.shared, cache_s=args.cache_s)
    try:
        if args.command == "start":
            began = start(spec)
            running = running_spec(spec)
            print(f"{'started' if began else 'already running'}: {running.nodes} nodes, "
                  f"SLURM_CONF={spec.conf_path}")
            _print_isolation(spec)
        elif args.command == "fault":
            running = running_spec(spec)
            if not is_up(running):
                print(f"error: the local cluster at {spec.root} is not running (start it first)",
                      file=sys.stderr)
                return 1
            print(faults.fault(running, args.args[0], args.args[1]))
        elif args.command == "stop":
            print(f"stopped {len(stop(spec))} daemons")
        elif args.command == "preempt-signal":
            mode = args.args[0] if args.args else args.preempt_signal
            if mode not in PREEMPT_SIGNALS:
                print(f"error: preempt-signal takes {' or '.join(PREEMPT_SIGNALS)}, not {mode!r}",
                      file=sys.stderr)
                return 2
            set_preempt_signal(spec, mode)
            told = "their --signal" if mode == "user" else "SIGTERM, then SIGKILL after GraceTime"
            print(f"preempted jobs now get {told}")
        elif args.command == "env":
            print(f"export SLURM_CONF={spec.conf_path}")
        else:
            up = is_up(spec)
            print(f"{'up' if up else 'down'}: SLURM_CONF={spec.conf_path}")
            missing = missing_pieces(spec)
            if missing:
                print(f"missing: {', '.join(missing)}")
            if up:
                _print_isolation(spec)
                for state in faults.states(running_spec(spec)):
                    print("  " + state.line())
            return 0 if up else 1
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _print_isolation(spec: ClusterSpec) -> None:
    """What each node has of its own, and why each piece it lacks could not be had."""
    record = isolation.read_record(spec)
    isolated = record.get("isolated", [])
    print(f"each node's own: {', '.join(isolated) or 'nothing (one machine)'}"
          + (f"; shared root {record.get('shared')} cached {record.get('cache_s')} s"
             if "filesystem" in isolated
             else ""))
    for piece in PIECES:
        if piece not in isolated and piece in record.get("missing", {}):
            print(f"  not isolated: {piece}: {record['missing'][piece]}")


if __name__ == "__main__":
    sys.exit(main())
