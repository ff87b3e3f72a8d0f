"""The run directory's layout, named once: every module asks here for a path.

A run directory is keyed by the run's name, never by a job id, so a requeued job
(or a resubmitted one) finds its own state. What it holds::

    config.yaml        the resolved config every attempt reads (${oc.env:VAR} kept as written:
                       hpc_ddp.core.config.env)
    .hpc_ddp-secret    the run's secret (mode 0600): names its node-local folders, signs their
                       records (hpc_ddp.rundir.node_local)
    attempts.jsonl     the ledger: one line per attempt (why it ended, steps gained)
    metrics.jsonl      step, loss, lr, samples/s (rank 0)
    script_progress.json  a train.script's recent steps as rank 0's worker read them from its output
    tensorboard/       TensorBoard event files (metrics.tensorboard=true)
    wandb_id.txt       the W&B run every attempt resumes; wandb/ its local files
                       (metrics.wandb=true)
    snapshots/         step-00000123/ node files + manifest.json (the checkpointer's business);
                       newest.json names the newest commit (hpc_ddp.rundir.newest)
    lock.json          which job holds the run now
    job.json           the job id (or the local launcher's pid) of the last submission
    DONE.json          written last when training finished (after the ledger's finished line): step,
                       world size, params_sha256 (a train.script: its exit code and last step)
    model.pt           the final model's state_dict (not for a train.script: the script keeps
                       its own)
    errors/            job-J-restart-N.txt: the full message of a deterministic error;
                       job-J-restart-N-lost-rank-K.json: rank K was declared lost (liveness)
    liveness/          node-N.json: node N's newest beat, for all its ranks (rewritten in place;
                       hpc_ddp.rundir.beats); declared.json: the last declaration of a loss;
                       slow.json: the slow nodes the running attempt named (rank/loop/pace.py);
                       health-node-N.probe: node N's health check writing (removed at once)
    jit/               job-J-restart-N[-step-K]/: what the survivors of a failure said, one
                       node-N.json (and blobs-node-N.pt) per node (hpc_ddp.rundir.jit_files);
                       an earlier attempt's keeps only its commit claim (hpc_ddp.rundir.jit_tidy)
    logs/              the local rehearsal's per-rank logs
    slurm/             submitit's and the sbatch templates' job logs
    compile_cache/     torch.compile's caches (TORCHINDUCTOR_CACHE_DIR; train.compile_cache=run,
                       the default): every step, node and requeue of the run finds its compiled
                       graphs warm (hpc_ddp.rundir.compile_cache)
    chain/             job-J.sbatch: the batch script job J submitted its successor with, where
                       Slurm refuses requeue (hpc_ddp.shell.chain)

No torch, no I/O: plain names and paths.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG = "config.yaml"
LEDGER = "attempts.jsonl"
METRICS = "metrics.jsonl"
# a train.script's step as rank 0's worker read it (rundir/script_progress.py)
SCRIPT_PROGRESS = "script_progress.json"
SNAPSHOTS = "snapshots"
LOCK = "lock.json"
JOB = "job.json"
DONE = "DONE.json"
MODEL = "model.pt"
TENSORBOARD = "tensorboard"
WANDB_ID = "wandb_id.txt"
ERRORS = "errors"
LOGS = "logs"
SLURM_LOGS = "slurm"
CHAIN = "chain"
LIVENESS = "liveness"
COMPILE_CACHE = "compile_cache"
SECRET = ".hpc_ddp-secret"


def secret(run_dir: Path | str) -> Path:
    return Path(run_dir) / SECRET


def config(run_dir: Path | str) -> Path:
    return Path(run_dir) / CONFIG


def ledger(run_dir: Path | str) -> Path:
    return Path(run_dir) / LEDGER


def metrics(run_dir: Path | str) -> Path:
    return Path(run_dir) / METRICS


def script_progress(run_dir: Path | str) -> Path:
    return Path(run_dir) / SCRIPT_PROGRESS


def snapshots(run_dir: Path | str) -> Path:
    return Path(run_dir) / SNAPSHOTS


def lock(run_dir: Path | str) -> Path:
    return Path(run_dir) / LOCK


def job(run_dir: Path | str) -> Path:
    return Path(run_dir) / JOB


def done(run_dir: Path | str) -> Path:
    return Path(run_dir) / DONE


def done_pending(run_dir: Path | str) -> Path:
    """DONE.json as a script's own hpc_ddp.session() leaves it: its worker publishes it after the
    ledger line."""
    return Path(run_dir) / f".{DONE}.pending"


def publish_done(run_dir: Path | str, fallback: str) -> None:
    """DONE.json, last (after the ledger's finished line): the pending one a wrapped session left,
    else ``fallback``. A reader that sees DONE.json finds the ledger complete."""
    from hpc_ddp.core.atomic import write_atomic

    pending = done_pending(run_dir)
    if pending.exists():
        os.replace(pending, done(run_dir))
    elif not done(run_dir).exists():
        write_atomic(done(run_dir), fallback)


def model(run_dir: Path | str) -> Path:
    return Path(run_dir) / MODEL


def tensorboard(run_dir: Path | str) -> Path:
    return Path(run_dir) / TENSORBOARD


def wandb_id(run_dir: Path | str) -> Path:
    return Path(run_dir) / WANDB_ID


def errors(run_dir: Path | str) -> Path:
    return Path(run_dir) / ERRORS


def logs(run_dir: Path | str) -> Path:
    return Path(run_dir) / LOGS


def slurm_logs(run_dir: Path | str) -> Path:
    return Path(run_dir) / SLURM_LOGS


def compile_cache(run_dir: Path | str) -> Path:
    """torch.compile's caches for the whole run (:mod:`hpc_ddp.rundir.compile_cache`)."""
    return Path(run_dir) / COMPILE_CACHE


def chain_script(run_dir: Path | str, job: str) -> Path:
    """The batch script job ``job`` submitted the run's next job with (a cluster that refuses
    requeue)."""
    return Path(run_dir) / CHAIN / f"job-{job}.sbatch"


def declared(run_dir: Path | str) -> Path:
    """The last declaration of a lost rank (:mod:`hpc_ddp.rank.watch.declaration`): one file per
    run, rewritten in place, the attempt inside. Each node's first rank reads it by name each
    period; rank 0 creates it before the rendezvous, so no node ever looked the name up before it
    existed (an NFS client would keep that answer for up to 30 s)."""
    return Path(run_dir) / LIVENESS / "declared.json"


def slow_nodes(run_dir: Path | str) -> Path:
    """The slow nodes rank 0 named in the running attempt (:mod:`hpc_ddp.rank.loop.pace`), for
    ``status``; the attempt's ledger line keeps them once it ends."""
    return Path(run_dir) / LIVENESS / "slow.json"


def health_probe(run_dir: Path | str, node: int) -> Path:
    """The file node ``node``'s first rank writes and reads back to time the run dir before the
    first step (``slurm.health``, :mod:`hpc_ddp.rank.attempt.health`), removed at once."""
    return Path(run_dir) / LIVENESS / f"health-node-{node}.probe"


def lost_marker(run_dir: Path | str, tag: str, rank: int | str) -> Path:
    """The marker of rank ``rank`` declared lost in the attempt ``tag``
    (:func:`hpc_ddp.rundir.ledger.attempt_tag`); ``rank="*"`` gives the glob pattern of every
    rank's."""
    return errors(run_dir) / f"{tag}-lost-rank-{rank}.json"
