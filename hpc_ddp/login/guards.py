"""The run dir's guards before anything is submitted: the config written once (a resume may not
change it silently), no second job on a run dir a live job holds, a resume at a batch the world size
can keep, and a finished or earlier run not started over by accident.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpc_ddp.rundir.runlock import read_record
from hpc_ddp.rundir import layout, node_local
from hpc_ddp.core.batching import resume_batch_problem
from hpc_ddp.core.config import RunConfig, load_config, save_config
from hpc_ddp.core.config.diff import config_diff, describe_diff, flat_values
from hpc_ddp.core.errors import HpcDdpError, explain


def write_config(cfg: RunConfig, resume: bool) -> Path:
    """RUN_DIR/config.yaml; on --resume, first say which keys differ from the run's previous config,
    and after it start the run's requeue caps afresh (a ledger line:
    :func:`hpc_ddp.rundir.ledger.start_caps_afresh`)."""
    path = layout.config(cfg.run_dir)
    if resume and path.exists():
        try:
            diff = [d for d in config_diff(flat_values(load_config([path])), flat_values(cfg))
                    if d[0] != "run_dir"]
        except HpcDdpError:
            diff = []  # an unreadable old config: it is replaced, as before
        if diff:
            print(f"resuming with a changed config: {describe_diff(diff)}\n" + (
                "  (train.script is started again with these values; it goes on from its own "
                "checkpoint, if it "
                "saves one: hpc_ddp keeps no snapshot of a script's state)" if cfg.train.script else
                "  (the snapshot's optimizer state is kept; a changed learning rate takes effect, "
                "with the "
                "schedule continuing from the snapshot's step: docs/resume.md)"), flush=True)
    if resume:
        from hpc_ddp.login.finished import goes_on_from, set_aside

        kept = set_aside(Path(cfg.run_dir))
        if kept:
            print(f"the run had finished: its DONE.json is kept as {kept}; "
                  f"{goes_on_from(Path(cfg.run_dir), kept, cfg.train.script)}",
                  flush=True)
    saved = save_config(cfg, path)  # first: a run dir it cannot write is refused here, with the fix
    # made here, before any rank: names its node-local folders
    node_local.run_secret(Path(cfg.run_dir))
    if resume:
        from hpc_ddp.rundir.ledger import start_caps_afresh

        # a person's --resume: the requeue caps count from here
        start_caps_afresh(Path(cfg.run_dir))
    return saved


def write_job(run_dir: Path, record: dict[str, object]) -> None:
    """RUN_DIR/job.json: who runs this run now (a Slurm job, or a local rehearsal's launcher)."""
    layout.job(run_dir).write_text(json.dumps({**record, "submitted": time.time()}) + "\n")


def live_holder(run_dir: Path) -> tuple[str, str] | None:
    """(who, how to stop it) for a job or rehearsal still using the run dir, else None.

    Asked before anything is written: RUN_DIR/job.json names the last job submitted
    (pending or running while squeue lists it) or local rehearsal (while its launcher
    lives); RUN_DIR/lock.json names the job whose ranks are running now.
    """
    from hpc_ddp.core.slurm_jobs import job_state
    from hpc_ddp.rundir.runlock import holder_alive

    job = read_record(layout.job(run_dir)) or {}
    if job.get("local") and holder_alive({"local": True, "host": job.get("host"),
                                          "pid": job.get("pid")}):
        return (f"job {job.get('job_id')} (a local rehearsal: launcher pid {job.get('pid')} on "
                f"{job.get('host')})",
                "wait for it, or press Ctrl-C in its terminal")
    if "job_id" in job and not job.get("local"):
        state = job_state(str(job["job_id"]))
        # finished; Slurm still lists the job while it ends
        if state and layout.done(run_dir).exists():
            return (f"job {job['job_id']} ({state}: its run has finished, DONE.json is written, "
                    "and the job "
                    "is ending)", "try again in a few seconds, once `squeue` no longer lists it")
        if state:
            return (f"job {job['job_id']} ({state})",
                    f"wait for it, or cancel it: scancel {job['job_id']}")
    lock = read_record(layout.lock(run_dir))
    if lock and holder_alive(lock):
        return (f"job {lock.get('job')} (it holds {layout.lock(run_dir)}: host {lock.get('host')}, "
                f"pid {lock.get('pid')})",
                "wait for it or stop it; if you are sure nothing uses the run dir, delete "
                f"{layout.lock(run_dir)}")
    return None


def check_free(cfg: RunConfig, resume: bool, earlier: bool = True) -> None:
    """Refuse, before anything is written, a run dir in use; and (``earlier``) an earlier run
    without ``resume``, or ``resume`` where there is no earlier run."""
    from hpc_ddp.rundir.runlock import in_use

    run_dir = Path(cfg.run_dir)
    live = live_holder(run_dir)
    if live:
        raise in_use(run_dir, live[0], f"nothing in it was changed; {live[1]}")
    if earlier:
        _check_earlier(run_dir, resume)
        if resume:
            from hpc_ddp.login import finished

            finished.check(cfg)
        # a task or a loop: both take run.batch's share of the global batch
        if resume and not cfg.train.script:
            _check_resume_batch(cfg)


def _check_resume_batch(cfg: RunConfig) -> None:
    """Refuse a resume at another world size that would change the global batch, or whose per-rank
    state cannot be resumed at another size (manifests only: no torch), before config.yaml is
    rewritten or a job queued."""
    from hpc_ddp.rundir.snapshot.steps import (committed_steps, read_manifest, refuses_resize,
                                               step_dir)

    run_dir = Path(cfg.run_dir)
    steps = committed_steps(run_dir)
    manifest = read_manifest(step_dir(run_dir, steps[0])) if steps else None
    problem = resume_batch_problem(manifest, cfg.train, cfg.slurm.nodes,
                                   cfg.slurm.tasks_per_node) if manifest else None
    if problem:
        raise HpcDdpError(problem, key="train.global_batch_size")
    world, written = cfg.slurm.nodes * cfg.slurm.tasks_per_node, (manifest or {}).get("world_size")
    resized = isinstance(written, int) and written != world
    refusal = refuses_resize(run_dir, per_rank_only=True) if resized else None
    # every rank would refuse it once the allocation came, after config.yaml was rewritten
    if refusal:
        raise HpcDdpError(explain(f"--resume at {world} ranks ({cfg.slurm.nodes} x "
                                  f"{cfg.slurm.tasks_per_node}): the "
                                  f"run's newest snapshot (step {steps[0]}) was written by "
                                  f"{written} ranks, and "
                                  f"{refusal}",
                                  hint=f"resume at {written} ranks (slurm.nodes and "
                                       "slurm.tasks_per_node as the run "
                                  "had them); or track that state with hpc_ddp.per_rank(..., "
                                  "elastic='fresh') if "
                                  "each rank may start it afresh "
                                  "(docs/resume.md#resuming-on-another-number-of-nodes)"),
                          key="slurm.nodes")


def _check_earlier(run_dir: Path, resume: bool) -> None:
    from hpc_ddp.rundir.snapshot.steps import committed_steps  # manifests only: no torch

    earlier = bool(committed_steps(run_dir)) or layout.done(run_dir).exists()
    if earlier and not resume:
        raise HpcDdpError(explain(f"{run_dir} holds an earlier run (snapshots or DONE.json)",
                                  hint="add --resume to continue it from its newest snapshot, or "
                                       "choose a new "
                                  "run with run_dir=..."), key="run_dir")
    started = earlier or any((run_dir / name).exists() for name in (layout.CONFIG, layout.LEDGER))
    if resume and not started:
        raise HpcDdpError(explain(f"--resume: there is no earlier run in {run_dir}",
                                  found=sorted(p.name for p in run_dir.iterdir())
                                  if run_dir.is_dir() else
                                  "no such directory",
                                  expected="the config.yaml, attempts.jsonl or snapshots/ that an "
                                           "earlier submit "
                                  "of this run wrote there",
                                  hint="check run_dir=... (or name=..., which sets the default "
                                       "run_dir "
                                  "runs/NAME); to start a new run, drop --resume"), key="run_dir")
