"""Every srun the job makes, from one place: its CPUs, and the container its ranks run in
(``slurm.container``).

A job makes several kinds of step: submitit's first one, the batch shell's own first step (the
templates), every step that heals a failure in the job, and the probes that ask whether a node still
starts a task. If any of them ran outside the user's container, or with the one CPU srun gives by
default, the rank there would fail or crawl in a way nobody could see from the config. So all of
them are built here:

- ``pyxis`` (enroot): srun itself takes the container, by ``--container-image``,
  ``--container-mounts`` and ``--container-workdir``; the rank command is unchanged. Every step
  names the container (:func:`container_name`): pyxis imports an unnamed one for each srun and
  removes it when the step ends, so every heal step and every probe imported a 10-20 GB image again
  on every node (the 20 s probes timed out, and healing never happened: issue 57); a named one is
  imported once and reused.
- ``apptainer`` / ``singularity``: srun starts ``RUNTIME exec [--nv] --bind PATHS [args] IMAGE
  COMMAND...``; ``--nv`` on GPU jobs (``slurm.gpus_per_node`` > 0) makes the host's driver visible
  inside.

Either way the run dir (snapshots, ledger, logs) and the submit directory (the task's module, a
script) are mounted at the same paths inside, so every path in the config means the same thing in
and out.

``--cpus-per-task`` goes on every step explicitly: since Slurm 22.05 srun no longer takes it from
the allocation (only from ``SRUN_CPUS_PER_TASK``, which the batch script exports too), and a rank
with one core for itself and its data-loader workers is slow without a word. Pure: no environment is
read here.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

RUNTIMES = ("pyxis", "apptainer", "singularity")
EXEC_RUNTIMES = ("apptainer", "singularity")  # the ones that wrap the rank command


def binds(paths: Sequence[str]) -> list[str]:
    """The host paths every step mounts (the run dir, the submit directory), each once, none inside
    another."""
    kept = list(dict.fromkeys(p.rstrip("/") or "/" for p in paths if p))
    return [p for p in kept if not any(p != k and p.startswith(k.rstrip("/") + "/") for k in kept)]


def srun_options(slurm: Any, paths: Sequence[str] = (), workdir: str | None = None) -> list[str]:
    """The options srun itself needs for the container: pyxis's (``slurm.container.args`` among
    them); none for the runtimes that wrap the command instead, or without a container."""
    box = slurm.container
    if box.runtime != "pyxis":
        return []
    mounts = [f"{p}:{p}" for p in binds(paths)] + list(box.mounts)
    return [f"--container-image={box.image}", f"--container-name={container_name(box.image)}",
            *([f"--container-mounts={','.join(mounts)}"] if mounts else []),
            *([f"--container-workdir={workdir}"] if workdir else []), *box.args]


def container_name(image: str) -> str:
    """The pyxis container of every step of a job: named after the image, so that only a step of
    the same image reuses it. pyxis keeps a named container to the job's end by default
    (``container_scope=job``); a site with ``container_scope=global`` keeps it across the user's
    jobs, which then start without the import (a tag that moved since is not imported again: name
    the image by digest or by a squashfs file there)."""
    import hashlib  # here: OpenSSL's hashlib is ~3 ms of the login node's import budget (B1)

    return "hpc_ddp-" + hashlib.sha256(image.encode()).hexdigest()[:12]


def wrap(slurm: Any, command: Sequence[str], paths: Sequence[str] = ()) -> list[str]:
    """``command`` as srun starts it on every task: inside ``RUNTIME exec ... IMAGE`` for apptainer
    and singularity, unchanged otherwise (pyxis is srun's business, :func:`srun_options`)."""
    box = slurm.container
    if box.runtime not in EXEC_RUNTIMES:
        return list(command)
    mounts = [*binds(paths), *box.mounts]
    return [box.runtime, "exec", *(["--nv"] if slurm.gpus_per_node else []),
            *(["--bind", ",".join(mounts)] if mounts else []), *box.args, box.image, *command]


def step_srun_args(slurm: Any, cpus: int | None = None, paths: Sequence[str] = (),
                   workdir: str | None = None) -> list[str]:
    """The options of a training step's srun (after ``srun``): one crashing task ends the step, the
    CPUs of a task (``cpus``: the torchrun template's one task per node gets the node's),
    ``--overlap``, the container's, then the user's ``slurm.srun_args`` (last: srun takes the last
    of a repeated option, so the user's win).

    ``--overlap``: an explicit ``--cpus-per-task`` (or ``SRUN_CPUS_PER_TASK``) implies ``--exact``
    since Slurm 21.08, and after Slurm removes a failed node from a job it no longer frees the cores
    of the step that ran there (``_step_dealloc_lps``: "unable to update job's core use information
    due to job resizing"), so an exact step on the surviving nodes waits for them forever: the
    healing step and its probe never start (seen on the local cluster, Slurm 22.05.8). Only one
    training step runs at a time, so letting it overlap costs nothing."""
    return ["--kill-on-bad-exit=1", f"--cpus-per-task={cpus or slurm.cpus_per_task}", "--overlap",
            *srun_options(slurm, paths, workdir), *slurm.srun_args]


def step_argv(slurm: Any, program: Sequence[str], paths: Sequence[str] = (),
              workdir: str | None = None,
              cpus: int | None = None) -> list[str]:
    """A whole training step: ``srun OPTIONS [RUNTIME exec ... IMAGE] PROGRAM...``."""
    return ["srun", *step_srun_args(slurm, cpus, paths, workdir), *wrap(slurm, program, paths)]


def probe_tail(slurm: Any, paths: Sequence[str] = (), workdir: str | None = None) -> list[str]:
    """What a probe step runs after its shape: ``true`` in the job's container, on one CPU (a probe
    asks whether a node starts a task in that container at all; it needs no more), overlapping like
    every step (:func:`step_srun_args` says why)."""
    return ["--cpus-per-task=1", "--overlap", *srun_options(slurm, paths, workdir),
            *wrap(slurm, ["true"], paths)]


def rank_python(slurm: Any, python: str) -> str:
    """The Python that runs every rank: ``python`` (the submitting one), or the image's
    (``slurm.container.python``): the login node's interpreter path rarely exists inside an
    image."""
    return slurm.container.python if slurm.container.runtime else python


def runtime_check(slurm: Any) -> list[str]:
    """Batch-script lines, after the user's setup (which may ``module load`` it), that stop the job
    with a clear error when the container runtime is missing on the job's node: without them every
    rank would die of "execve(): apptainer: No such file" (or srun of an unknown option), once per
    rank and retry."""
    runtime = slurm.container.runtime
    if runtime in EXEC_RUNTIMES:
        test = f"command -v {runtime} >/dev/null 2>&1"
        missing = f"the command {runtime} is not on the PATH of the job ($PATH)"
        fix = (f"load it in slurm.setup (e.g. module load {runtime}), or set "
               "slurm.container.runtime="
               f"{'singularity' if runtime == 'apptainer' else 'apptainer'} if your site has that "
               "one")
    elif runtime == "pyxis":
        test = 'case "$(srun --help 2>&1)" in *--container-image*) true ;; *) false ;; esac'
        missing = ("the srun of this cluster has no --container-image (the pyxis plugin is not "
                   "installed)")
        fix = ("ask your site which container runtime it offers, e.g. "
               "slurm.container.runtime=apptainer")
    else:
        return []
    said = f"hpc_ddp: error: slurm.container.runtime={runtime}, but {missing}. HINT: {fix}"
    before, _, after = said.partition("$PATH")
    text = shlex.quote(before) + ('"$PATH"' + shlex.quote(after) if after else "")
    return [f"{test} || {{ echo {text} >&2; exit 2; }}"]
