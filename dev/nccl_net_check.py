"""Does the NCCL-network report work on a real GPU? World size 1, NCCL, one all_reduce, then what the parser found.

Run on a lent GPU machine, from the repository root (stdlib and torch only; no omegaconf needed):

    python3 dev/nccl_net_check.py            # prints NCCL's INIT/NET lines, then the finding as JSON

It goes the way rank 0 of a multi-node NCCL job goes (hpc_ddp.rank.group.nccl_report): NCCL_DEBUG,
NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE are exported only where the caller set no NCCL_DEBUG; the process group
starts; one all_reduce makes the communicator; the file NCCL wrote (PREFIX.HOST.PID) is read, parsed and
removed. NCCL initialises its network plugins even for a communicator of one rank, so "Using network ..." is
in the file. Exit 0 when the parser found a network, 1 when not, 2 without CUDA.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc_ddp.core.slurm_env import DistEnv  # noqa: E402
from hpc_ddp.rank.group import nccl_report  # noqa: E402


def main() -> int:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("no CUDA here: nothing to check", file=sys.stderr)
        return 2
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", master_port=29500, job_id=0)
    prefix = nccl_report.prepare(os.environ, env)
    print(f"NCCL_DEBUG={os.environ.get('NCCL_DEBUG')} NCCL_DEBUG_FILE={os.environ.get('NCCL_DEBUG_FILE')}")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    torch.cuda.synchronize()
    print(f"all_reduce: {total.item()}; NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
          f"/sys/class/infiniband: {nccl_report.ib_devices() or 'none'}")
    if prefix is not None:
        for path in Path(prefix).parent.glob(f"{Path(prefix).name}.*.{os.getpid()}"):
            lines = [line for line in path.read_text(errors="replace").splitlines()
                     if "NET" in line or "Using" in line or "version" in line]
            print(f"--- {path} ({len(lines)} INIT/NET lines of interest)\n" + "\n".join(lines[:40]))
    found = nccl_report.collect(prefix)
    print("found:", json.dumps(found, indent=1))
    dist.destroy_process_group()
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
