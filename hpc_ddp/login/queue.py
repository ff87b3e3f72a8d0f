"""``submit``'s Slurm path: the run handed to Slurm through submitit (one job, or a job array with
one element per sweep point), job.json written in each run dir, and where to watch it printed.

Apart from :mod:`hpc_ddp.login.submit` (the command line and what each mode does): this is the one
login module that imports submitit's executor and the job's entry point (:mod:`hpc_ddp.worker`,
pickled by that stable path; its code runs in the job), both only when a job is submitted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpc_ddp.core.batching import slurm_nodes
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.login.dry_run import log_folder, run_dir_words, shape
from hpc_ddp.login.guards import check_free, write_config, write_job
from hpc_ddp.login.sbatch import submitit_parameters, submitit_python


def submit_slurm(cfgs: list[RunConfig], resume: bool) -> int:
    """One job (or a job array, one element per config) through submitit; job.json in each run
    dir."""
    import submitit

    from hpc_ddp.login.finished import done_step, put_back
    from hpc_ddp.worker import job_main

    for cfg in cfgs:
        check_free(cfg, resume)
    # set aside by write_config on --resume
    finished = {one.run_dir: done_step(Path(one.run_dir)) for one in cfgs}
    paths = [str(write_config(cfg, resume)) for cfg in cfgs]
    cfg, array = cfgs[0], len(cfgs) > 1
    folder = log_folder(cfg, len(cfgs) if array else None)
    workdir = os.getcwd()  # the job runs here (sbatch's default); a container mounts it
    executor = submitit.SlurmExecutor(folder=folder,
                                      python=submitit_python(cfg, sys.executable, workdir, array))
    executor.update_parameters(**submitit_parameters(cfg, paths, sys.executable, workdir))
    try:
        jobs = executor.map_array(job_main,
                                  paths) if array else [executor.submit(job_main, paths[0])]
    except submitit.core.utils.FailedJobError as err:  # sbatch said no: nothing is queued
        for run_dir, kept in finished.items():
            if kept is not None:
                put_back(Path(run_dir), kept)
        lines = [line for line in str(err).splitlines() if line.strip()][:6]
        raise HpcDdpError(explain("sbatch refused the job, so nothing was queued:\n  "
                                  + "\n  ".join(lines),
                                  hint="fix what Slurm says above (partition, account, time limit, "
                                       "a cluster "
                                  "this machine can reach); to rehearse on this machine instead, "
                                  "add --local"),
                          key="slurm") from None
    for job, one in zip(jobs, cfgs):
        write_job(Path(one.run_dir), {"job_id": job.job_id, "logs": str(folder)})
    _say_submitted(cfgs, [job.job_id for job in jobs], folder)
    return 0


def _say_submitted(cfgs: list[RunConfig], job_ids: list[str], folder: Path) -> None:
    """What was queued, and per run where its run dir and logs are and how to watch it."""
    cfg, array = cfgs[0], len(cfgs) > 1
    first = job_ids[0].split("_")[0]
    what = f"job array {first} ({len(job_ids)} runs)" if array else f"job {first}"
    print(f"submitted {what}: {cfg.name}, "
          f"{shape(slurm_nodes(cfg.slurm.nodes), cfg.slurm.tasks_per_node)}")
    for job_id, one in zip(job_ids, cfgs):
        err, out = (folder / f"{job_id}_0_log.{kind}" for kind in ("err", "out"))
        print(f"{'  [' + job_id + ']' if array else ''}\n  "
              f"{run_dir_words(one).replace('run dir', 'run dir ', 1)}\n  logs     {folder}: "
              f"two per rank R, {job_id}_R_log.err (hpc_ddp's lines, your logging, tracebacks) "
              "and "
              f"{job_id}_R_log.out (what the program prints)\n  watch    python -m "
              f"hpc_ddp.status {one.run_dir}"
              f"\n  tail     tail -f {err} {out}")
    print(f"  cancel   scancel {first}")
