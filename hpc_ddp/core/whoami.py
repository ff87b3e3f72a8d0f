"""``python -m hpc_ddp.whoami``: what this process (or every rank of a simulated job) derives.

The first thing to run when ranks do not meet: under ``srun`` each task prints
its rank, node, and rendezvous address and port, and whether that address
resolves on this node. ``--simulate 2x2`` shows all ranks of a 2-node x
2-task job without any cluster. Like the worker, this is an entry point, so it
reads ``os.environ``. No torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import sys
from collections.abc import Mapping

from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.slurm_env import DistEnv, from_environ, rendezvous_endpoint, simulated_environ

EPILOG = """\
examples:
  python -m hpc_ddp.whoami --simulate 2x2          # every rank of a 2-node x 2-task job
  srun -N2 --ntasks-per-node=2 python -m hpc_ddp.whoami
  srun -N2 --ntasks-per-node=2 python -m hpc_ddp.whoami --json   # one JSON object per task
  python -m hpc_ddp.whoami --endpoint              # HOST:PORT for torchrun's c10d (batch scripts)
"""
COLUMNS = ("rank", "local_rank", "node_rank", "local_world_size", "world_size", "master_addr",
           "master_port")


def resolve(host: str) -> str | None:
    """The first IPv4/IPv6 address of ``host``, or None when it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (OSError, UnicodeError):
        return None


def describe(env: DistEnv, node: str) -> str:
    """One line a human reads in a job log."""
    job = f"job {env.job_id}" if env.job_id is not None else "no job"
    return (f"rank {env.rank}/{env.world_size} local {env.local_rank}/{env.local_world_size} "
            f"node {env.node_rank}/{env.num_nodes} ({node}) master "
            f"{env.master_addr}:{env.master_port} "
            f"source={env.source} {job} restart={env.restart_count}")


def table(envs: list[DistEnv], nodes: list[str]) -> str:
    rows = [COLUMNS + ("node",)] + [tuple(str(getattr(e, c)) for c in COLUMNS) + (n,)
                                    for e, n in zip(envs, nodes)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _simulate(shape: str, job_id: int) -> int:
    match = re.fullmatch(r"(\d+)x(\d+)", shape)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        print(f"error: --simulate takes NODESxTASKS with both >= 1, e.g. 2x4; found {shape!r}",
              file=sys.stderr)
        return 2
    environs = simulated_environ(int(match.group(1)), int(match.group(2)), job_id=job_id)
    envs = [from_environ(e) for e in environs]
    first = environs[0]
    print(f"simulated Slurm job {job_id}: SLURM_JOB_NODELIST={first['SLURM_JOB_NODELIST']} "
          f"SLURM_TASKS_PER_NODE={first['SLURM_TASKS_PER_NODE']} "
          f"SLURM_NTASKS={first['SLURM_NTASKS']}")
    print(table(envs, [e["SLURMD_NODENAME"] for e in environs]))
    return 0


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.whoami", description=for_help(__doc__),
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    parser.add_argument("--simulate", metavar="NODESxTASKS",
                        help="show every rank of a simulated job, e.g. 2x2")
    parser.add_argument("--job-id", type=int, default=4242,
                        help="job id of the simulated job (default 4242)")
    parser.add_argument("--json", action="store_true", help="print this process's result as one "
                                                            "JSON object")
    parser.add_argument("--endpoint", action="store_true",
                        help="print only the job's rendezvous HOST:PORT (works in the batch shell "
                             "too)")
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    try:
        if args.simulate:
            return _simulate(args.simulate, args.job_id)
        if args.endpoint:
            host, port = rendezvous_endpoint(environ)
            print(f"{host}:{port}")
            return 0
        env = from_environ(environ)
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
    address = resolve(env.master_addr)
    if args.json:
        print(json.dumps({**dataclasses.asdict(env), "node": node,
                          "master_addr_resolved": address}))
    else:
        print(describe(env, node))
    if address is None:
        print(f"error: MASTER_ADDR {env.master_addr!r} does not resolve on {node}.\n"
              f"HINT: add it to /etc/hosts or DNS, or export MASTER_ADDR=<IP of the first node>",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
