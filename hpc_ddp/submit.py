"""``python -m hpc_ddp.submit CONFIG.yaml [key=value ...]``: run a config as a Slurm job.

Submits through submitit (nodes x tasks_per_node tasks, each running the
worker); ``--local`` rehearses the job on this machine (nodes x tasks_per_node
gloo processes with the Slurm variables srun would set); ``--dry-run`` shows
what every rank would derive. Login-node safe: nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpc_ddp.config import RunConfig, load_config, save_config
from hpc_ddp.errors import HpcDdpError, explain
from hpc_ddp.slurm_env import from_environ, simulated_environ

EPILOG = """\
examples:
  python -m hpc_ddp.submit examples/mlp.yaml slurm.partition=gpu slurm.gpus_per_node=4 slurm.tasks_per_node=4
  python -m hpc_ddp.submit examples/mlp.yaml --resume                     # continue a stopped run, new job
  python -m hpc_ddp.submit examples/mlp.yaml --emit-sbatch job.sbatch && sbatch job.sbatch
  python -m hpc_ddp.submit examples/mlp.yaml --local                      # 2 nodes x 2 tasks on this machine
  python -m hpc_ddp.submit examples/mlp.yaml --local slurm.nodes=1 train.max_steps=20
  python -m hpc_ddp.submit examples/mlp.yaml --dry-run slurm.nodes=4 slurm.tasks_per_node=8
  python -m hpc_ddp.submit examples/mlp.yaml --local --preempt-at 7,19 --timeout-at 31   # stops, requeues, resumes

Arguments ending in .yaml/.yml are config files (merged in order); KEY=VALUE arguments override them
(see docs/config.md for every key). The resolved config is written to RUN_DIR/config.yaml.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.submit", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="+", metavar="CONFIG.yaml | KEY=VALUE",
                        help="config files, then overrides such as train.lr=0.01")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="rehearse the job on this machine with gloo")
    mode.add_argument("--dry-run", action="store_true", help="show every rank's derived environment; run nothing")
    mode.add_argument("--emit-sbatch", type=Path, metavar="PATH",
                      help="write a standalone sbatch script for this config (from slurm/ddp.sbatch); submit "
                      "it yourself with `sbatch PATH`")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in RUN_DIR from its newest snapshot (a new job)")
    parser.add_argument("--preempt-at", type=_steps, default=[], metavar="STEPS",
                        help="with --local: preempt (SIGTERM every rank) after these steps, e.g. 7,19")
    parser.add_argument("--timeout-at", type=_steps, default=[], metavar="STEPS",
                        help="with --local: send the time-out warning signal after these steps, e.g. 31")
    return parser


def _steps(text: str) -> list[int]:
    try:
        steps = sorted(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers like 7,19; found {text!r}") from None
    if any(s < 1 for s in steps):
        raise argparse.ArgumentTypeError(f"steps start at 1; found {text!r}")
    return steps


def split_items(items: list[str]) -> tuple[list[str], list[str]]:
    """Config files (``*.yaml``/``*.yml``) and ``key=value`` overrides, each in the given order."""
    paths = [i for i in items if i.endswith((".yaml", ".yml")) and "=" not in i]
    return paths, [i for i in items if i not in paths]


def resolve(items: list[str]) -> RunConfig:
    paths, overrides = split_items(items)
    cfg = load_config(paths, overrides)
    cfg.run_dir = str(Path(cfg.run_dir).expanduser().resolve())  # workers may start elsewhere
    return cfg


def dry_run(cfg: RunConfig) -> int:
    from hpc_ddp.whoami import table

    environs = simulated_environ(cfg.slurm.nodes, cfg.slurm.tasks_per_node, job_id=4242)
    print(f"run {cfg.name}: {cfg.slurm.nodes} nodes x {cfg.slurm.tasks_per_node} tasks, run dir {cfg.run_dir}")
    print("every rank as Slurm job 4242 would derive it (nodes named node0..; the port follows the job id):")
    print(table([from_environ(e) for e in environs], [e["SLURMD_NODENAME"] for e in environs]))
    return 0


def run_local(cfg: RunConfig, preempt_at: list[int], timeout_at: list[int]) -> int:
    from hpc_ddp.local import rehearse
    from hpc_ddp.preemption import signal_number

    run_dir = Path(cfg.run_dir)
    config_path = save_config(cfg, run_dir / "config.yaml")
    print(f"rehearsing {cfg.name} as {cfg.slurm.nodes} nodes x {cfg.slurm.tasks_per_node} tasks on this machine; "
          f"run dir {run_dir}", flush=True)
    code = rehearse(config_path, run_dir, cfg.slurm.nodes, cfg.slurm.tasks_per_node, job_id=int(time.time()) % 10**6,
                    preempt_at=preempt_at, timeout_at=timeout_at, warning_signal=signal_number(cfg.slurm.signal))
    print(f"{'finished' if code == 0 else 'FAILED'}: metrics in {run_dir / 'metrics.jsonl'}, "
          f"logs in {run_dir / 'logs'}", flush=True)
    return code


def _live_job(run_dir: Path) -> str | None:
    """The job recorded in RUN_DIR/job.json if Slurm still has it pending or running."""
    try:
        job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not shutil.which("squeue"):
        return None
    proc = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True)
    state = proc.stdout.strip()
    return f"{job_id} ({state})" if proc.returncode == 0 and state else None


def submit_slurm(cfg: RunConfig, resume: bool) -> int:
    import submitit

    from hpc_ddp.sbatch import submitit_parameters
    from hpc_ddp.worker import job_main

    run_dir = Path(cfg.run_dir)
    live = _live_job(run_dir)
    if live:
        raise HpcDdpError(explain(f"run {cfg.name} already has job {live} in {run_dir}",
                                  hint=f"wait for it, cancel it (scancel {live.split()[0]}), or start a new run "
                                  "with name=..."), key="name")
    earlier = (run_dir / "snapshots").exists() or (run_dir / "DONE.json").exists()
    if earlier and not resume:
        raise HpcDdpError(explain(f"{run_dir} holds an earlier run (snapshots or DONE.json)",
                                  hint="add --resume to continue it from its newest snapshot, or choose a new "
                                  "run with name=..."), key="run_dir")
    config_path = save_config(cfg, run_dir / "config.yaml")
    executor = submitit.SlurmExecutor(folder=run_dir / "slurm")
    executor.update_parameters(**submitit_parameters(cfg))
    job = executor.submit(job_main, str(config_path))
    (run_dir / "job.json").write_text(json.dumps({"job_id": job.job_id, "submitted": time.time()}) + "\n")
    log_path = run_dir / "slurm" / f"{job.job_id}_0_log.out"
    print(f"submitted job {job.job_id}: {cfg.name}, {cfg.slurm.nodes} nodes x {cfg.slurm.tasks_per_node} tasks\n"
          f"  run dir  {run_dir}\n  logs     {run_dir / 'slurm'} (rank 0: {log_path})\n"
          f"  watch    python -m hpc_ddp.status {run_dir}\n  tail     tail -f {log_path}\n"
          f"  cancel   scancel {job.job_id}")
    return 0


def emit_sbatch(cfg: RunConfig, path: Path) -> int:
    from hpc_ddp.sbatch import render

    config_path = save_config(cfg, Path(cfg.run_dir) / "config.yaml")
    (Path(cfg.run_dir) / "slurm").mkdir(parents=True, exist_ok=True)  # Slurm does not create --output's dir
    path.write_text(render(cfg, str(config_path), python=sys.executable))
    path.chmod(0o755)
    print(f"wrote {path} for run {cfg.name} (config {config_path}); submit it with: sbatch {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options may come between overrides
    try:
        cfg = resolve(args.items)
        if args.dry_run:
            return dry_run(cfg)
        if args.local:
            return run_local(cfg, args.preempt_at, args.timeout_at)
        if args.emit_sbatch:
            return emit_sbatch(cfg, args.emit_sbatch)
        if args.preempt_at or args.timeout_at:
            print("error: --preempt-at and --timeout-at go with --local", file=sys.stderr)
            return 2
        return submit_slurm(cfg, args.resume)
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
