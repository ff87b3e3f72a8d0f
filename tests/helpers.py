"""Small helpers shared by the tests that wait on real jobs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hpc_ddp.rundir import metrics_file
from hpc_ddp.rundir.ledger import read_attempts


def wait_until(predicate: Callable[[], object], timeout: float, poll: float = 0.2) -> bool:
    """Poll ``predicate`` until it is truthy or ``timeout`` seconds pass; return its last value as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return bool(predicate())


def job_gone(job: str) -> bool:
    """Slurm no longer lists the job: its batch script has ended, not only its run (DONE.json comes first)."""
    return not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip()


def finished(run_dir: Path) -> bool:
    """The run is over and recorded: DONE.json exists and the ledger's last line says "finished".

    DONE.json is written after the ledger's finished line (tests/rehearsal/test_local_training.py checks the order);
    both are checked all the same, as a user's poller might.
    """
    if not (run_dir / "DONE.json").exists():  # the cheap check first: this is polled
        return False
    attempts = read_attempts(run_dir)
    return bool(attempts) and attempts[-1].get("reason") == "finished"


def alive_with(marker: str) -> list[int]:
    """PIDs whose command line mentions ``marker`` (the run's unique config path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    if (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


ROOT = Path(__file__).resolve().parent.parent


def submit(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m hpc_ddp.submit ARGS`` from the checkout, as a user runs it; its output captured."""
    return subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def losses(run_dir: Path) -> dict[int, float]:
    """Rank 0's loss at every logged step, from metrics.jsonl as every reader reads it (hpc_ddp.rundir.metrics_file):
    each step once, the newest attempt's value; a line still being written is skipped."""
    return {r["step"]: r["loss"] for r in metrics_file.read(run_dir)}


def done(run_dir: Path) -> dict:
    """DONE.json of a finished run."""
    return json.loads((run_dir / "DONE.json").read_text())


def spawn_ranks(target: Callable[..., None], nodes: int, tasks: int, *args: object, timeout: float = 240) -> list:
    """Run ``target(environ, *args, queue)`` in one spawned process per simulated rank (real gloo); return what
    each put on the queue, sorted, once every process exited 0.

    The rendezvous ports are an attempt's secret ones (hpc_ddp.core.store_ports: below the ephemeral range, with
    the key only this call's rank 0 sets, and fallbacks), not a free port picked and closed before rank 0 binds it:
    between the two, another test's process could take it, and a rank could join another call's store (two calls
    side by side, or the local cluster's daemons beside the suite). Targets that read the environment with
    ``from_environ`` get the fallbacks and the key check; the others use MASTER_PORT, the first candidate."""
    import multiprocessing
    import secrets

    from hpc_ddp.core import store_ports
    from hpc_ddp.core.slurm_env import simulated_environ

    token = secrets.token_hex(8)
    rendezvous = store_ports.exported(secrets.token_bytes(16), f"spawn-{token}", token)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for e in simulated_environ(nodes, tasks, job_id=1):
        chosen = e.get(store_ports.PORTS_VAR)  # a test's own ports (and key): the first is MASTER_PORT
        given = {"MASTER_PORT": chosen.split(",")[0]} if chosen else rendezvous
        procs.append(ctx.Process(target=target, args=({**e, "MASTER_ADDR": "127.0.0.1", **given}, *args, out)))
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=timeout) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return results


# The MLP example at 300 steps, uninterrupted: the reference of two cluster tests (torchrun's template
# signalled and requeued; the time-out warnings by scancel and by the limit), rehearsed once a session.
# Their jobs' other options (slurm.timeout_min, slurm.signal_delay_s) shape only when the cluster
# signals, never what training computes.
MLP_300 = ("examples/mlp.yaml", "train.max_steps=300", "train.log_every=10")

FAKE_IMAGE = "/hpc_ddp-test/fake.sif"
FAKE_APPTAINER = """#!/bin/bash
# Stands in for apptainer: one line with where it ran and its arguments, then the command after the image,
# on the host (the real one would start it inside the image).
args="$*"
printf '%s\\n' "node=${SLURMD_NODENAME:-?} step=${SLURM_STEP_ID:-?} task=${SLURM_PROCID:-?} args=${args//$'\\n'/ }" >> RECORD
[ "$1" = exec ] || { echo "fake apptainer: only exec is known, got: $*" >&2; exit 90; }
shift
# --cleanenv/-e and --containall/-C (or APPTAINER_CLEANENV=1) pass no host variable: only PATH's default,
# HOME, and each APPTAINERENV_NAME as NAME, as the real runtime does
clean=${APPTAINER_CLEANENV:-}
while [ $# -gt 0 ] && [ "$1" != IMAGE ]; do
    case $1 in --cleanenv|-e|--containall|-C) clean=1 ;; esac
    shift
done
[ $# -gt 1 ] || { echo "fake apptainer: no image or no command" >&2; exit 91; }
shift
if [ -n "$clean" ]; then
    kept=()
    while IFS='=' read -r -d '' name value; do
        [[ $name == APPTAINERENV_* ]] && kept+=("${name#APPTAINERENV_}=$value")
    done < <(env -0)
    exec env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="${HOME:-/}" "${kept[@]}" "$@"
fi
if [ -n "${FAKE_ENROOT_HOOK:-}" ]; then
    # plays enroot's PyTorch hook (pyxis gives the container's variables precedence): torchrun's names from the
    # job, the job's first node as MASTER_ADDR, a fixed MASTER_PORT
    nl=$SLURM_JOB_NODELIST
    if [[ $nl == *"["* ]]; then rest=${nl#*[}; first=${nl%%[*}${rest%%[-,]*}; first=${first%]}; else first=${nl%%,*}; fi
    export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS MASTER_ADDR=$first MASTER_PORT=29500
    export OMP_NUM_THREADS=1
fi
exec "$@"
"""


def fake_apptainer(folder: Path, hook: bool = False) -> tuple[list[str], Path]:
    """The config overrides that run every rank through a stand-in ``apptainer`` found on the job's PATH only
    (a ``slurm.setup`` line puts it there, as ``module load apptainer`` would), and the file it records to.
    ``hook``: the stand-in also plays enroot's PyTorch hook (its variables over the job's)."""
    tools, record = folder / "container-bin", folder / "container-calls.txt"
    tools.mkdir(parents=True, exist_ok=True)
    (tools / "apptainer").write_text(FAKE_APPTAINER.replace("RECORD", str(record)).replace("IMAGE", FAKE_IMAGE))
    (tools / "apptainer").chmod(0o755)
    return ["slurm.container.runtime=apptainer", f"slurm.container.image={FAKE_IMAGE}",
            f"slurm.container.python={sys.executable}", 'slurm.container.mounts=["/tmp:/scratch"]',
            "slurm.container.args=[--writable-tmpfs]",
            f'slurm.setup=["export PATH={tools}:$PATH"' + (', "export FAKE_ENROOT_HOOK=1"]' if hook else "]")], record


def container_calls(record: Path) -> dict[str, list[tuple[str, str, str]]]:
    """The stand-in's lines by job step: ``{step: [(node, task, args), ...]}``."""
    steps: dict[str, list[tuple[str, str, str]]] = {}
    for line in record.read_text().splitlines() if record.exists() else []:
        node, step, task, args = line.split(" ", 3)
        steps.setdefault(step.removeprefix("step="), []).append((node.removeprefix("node="),
                                                                 task.removeprefix("task="),
                                                                 args.removeprefix("args=")))
    return steps


def assert_kept_the_step(first: dict[str, Any], log: str, signalled_at: int) -> None:
    """A stop that killed unshielded loader workers cost at most the step in flight, whichever way it went:
    - mostly a fetch found a worker gone before the agreed boundary: the step broke (on this rank, or on a peer
      first, whose leaving broke this rank's collective: ci47), and the survivors' snapshot holds the step every
      rank held; the log names the fix (hpc_ddp.worker_init());
    - or the batches the workers had sent before they died carried the loop to the agreed boundary, as
      rank/stop/child_deaths.py intends: a clean stop with its snapshot (CI saw it once, under load; it depends on
      how many batches were in the loader's pipe when the signal came)."""
    broke = first.get("stopped_mid_step")
    if broke is not None:
        assert broke["snapshot"] == broke["held"] == first["last_step"], first
        assert first["last_step"] >= signalled_at, first
        assert "worker_init_fn=hpc_ddp.worker_init()" in log  # the log names the fix
    else:
        assert first["last_step"] > signalled_at, first  # agreed at a boundary after the signal's
