"""``python -m hpc_ddp.worker --config RUN_DIR/config.yaml``: what every task of a job runs.

Started by srun (the sbatch templates), by the submitit callable, or by the
local simulation. The one place that reads ``os.environ``: it derives this
process's DistEnv, joins the process group, builds the task and the trainer,
trains, and exits 0 on success, 2 on a bad config or environment, 1 on any
other failure (with the traceback in the log, prefixed by the rank).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.config import load_config
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.slurm_env import DistEnv, from_environ

log = logging.getLogger("hpc_ddp.worker")
# torch warns on import when numpy is absent; hpc_ddp does not need numpy, so keep the logs clean
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def setup_logging(env: DistEnv) -> None:
    """Rank-prefixed lines; every rank logs warnings, rank 0 also progress."""
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING, force=True, stream=sys.stderr,
                        format=f"[rank {env.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def _threads(environ: Mapping[str, str]) -> None:
    """Use the task's CPUs, not every core of the node (OMP_NUM_THREADS wins when set)."""
    import torch

    cpus = environ.get("SLURM_CPUS_PER_TASK", "")
    if "OMP_NUM_THREADS" not in environ and cpus.isdigit() and int(cpus) > 0:
        torch.set_num_threads(int(cpus))


def run(config_path: Path, environ: Mapping[str, str]) -> dict[str, object]:
    """Train the run described by ``config_path`` as the rank ``environ`` says this is."""
    from hpc_ddp.distributed import process_group
    from hpc_ddp.task import load_task
    from hpc_ddp.trainer import Trainer

    cfg = load_config([config_path])
    env = from_environ(environ)
    setup_logging(env)
    _threads(environ)
    task = load_task(cfg.train.task)
    with process_group(env, cfg.dist) as device:
        return Trainer(task, cfg, env, device, Path(cfg.run_dir)).train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  srun python -m hpc_ddp.worker --config runs/mlp/config.yaml")
    parser.add_argument("--config", required=True, type=Path, help="the run's resolved config.yaml")
    args = parser.parse_args(argv)
    try:
        run(args.config, os.environ)
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception:
        log.exception("training failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
