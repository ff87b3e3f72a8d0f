"""``submit --dry-run``: what would be submitted, shown and checked, nothing started; and the lines
that say how a failure is healed and how the batch is split (shared with the real submission).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout
from hpc_ddp.core.batching import node_counts, plan, slurm_nodes
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.config.env import masked
from hpc_ddp.core.container import probe_tail
from hpc_ddp.login.sbatch import held_nodes, mount_paths, submitit_parameters, submitit_python
from hpc_ddp.core.slurm_env import from_environ, simulated_environ


def healing_line(slurm: Any) -> str:
    """What a failure costs this run: spares, in-job restarts, then requeues (docs/faults.md,
    healing)."""
    spares = (f"{slurm.spare_nodes} spare node(s) (the job holds {held_nodes(slurm)})"
              if slurm.spare_nodes else "no spare node" + (", fewer nodes within slurm.nodes"
                                                          if len(node_counts(slurm.nodes)) > 1
                                                           else ""))
    return (f"on a failure: {slurm.max_restarts_in_job} in-job restart(s) "
            f"(slurm.max_restarts_in_job), {spares}; "
            f"then {slurm.max_failures} requeue(s) (slurm.max_failures)")


def submitit_script(cfg: RunConfig, array: int | None = None, python: str = sys.executable,
                    cfgs: list[RunConfig] | None = None, workdir: str | None = None) -> str:
    """The sbatch script submitit writes for this config (the same call it makes when
    submitting)."""
    # no public renderer; pinned by a golden file
    from submitit.slurm.slurm import _make_sbatch_string

    folder = log_folder(cfg, array)
    wrapped = submitit_python(cfg, python, workdir, bool(array))
    command = f"{wrapped} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=folder, map_count=array,
                               **submitit_parameters(cfg, _config_paths(cfgs or [cfg]), python,
                                                     workdir))


def _config_paths(cfgs: list[RunConfig]) -> list[str]:
    return [str(layout.config(c.run_dir)) for c in cfgs]


def log_folder(cfg: RunConfig, array: int | None) -> Path:
    """submitit's folder: RUN_DIR/slurm, or for a job array the sweep's base dir's slurm/."""
    return (Path(cfg.run_dir).parent if array else Path(cfg.run_dir)) / layout.SLURM_LOGS


def dry_run(cfgs: list[RunConfig], checks: bool = True) -> int:
    from hpc_ddp.core.whoami import table

    cfg, array = cfgs[0], (len(cfgs) if len(cfgs) > 1 else None)
    workdir = os.getcwd()  # where the job runs: sbatch's default, as submit leaves it
    print("# the sbatch script submit would hand to Slurm (through submitit):\n"
          + submitit_script(cfg, array, cfgs=cfgs, workdir=workdir))
    if array:
        print(f"job array of {array} runs ({{config}} in the teardown line: each element's "
              "RUN_DIR/config.yaml):")
        print("\n".join(f"  [{i}] {c.run_dir}" for i, c in enumerate(cfgs)))
    nodes = node_counts(cfg.slurm.nodes)
    world = nodes[-1] * cfg.slurm.tasks_per_node
    environs = simulated_environ(nodes[-1], cfg.slurm.tasks_per_node, job_id=4242,
                                 ranks=shown(world))
    print(f"run {cfg.name}: {shape(slurm_nodes(cfg.slurm.nodes), cfg.slurm.tasks_per_node)}, "
          f"{run_dir_words(cfg)}")
    print(f"program: {program_line(cfg)}")
    if cfg.profile:
        print(f"profile: {cfg.profile} (merged under the config files; python -m hpc_ddp.profiles "
              f"show {cfg.profile})")
    print(container_line(cfg, workdir, bool(array)))
    print(healing_line(cfg.slurm))
    if not cfg.train.script:
        print(batch_plans(cfg))
    print("every rank as Slurm job 4242 would derive "
          f"it{f' on {nodes[-1]} nodes' if len(nodes) > 1 else ''} "
          "(nodes named node0..; the port follows the job id):")
    print(elided(table([from_environ(e) for e in environs],
                       [e["SLURMD_NODENAME"] for e in environs]), world,
                 "rank", head=1))
    if not checks:
        return 0
    from hpc_ddp.core.requeue_policy import requeue_path
    # here: --no-preflight need not import it (benchmark B1)
    from hpc_ddp.login.preflight import preflight

    everything = preflight(cfg)
    findings = [f for f in everything if f.level != "note"]
    if findings:
        print(f"preflight: {len(findings)} finding(s)")
        print("\n".join(f"  {line}" for f in findings for line in str(f).splitlines()))
    else:
        print("preflight: all checks pass")
    for note in (f for f in everything if f.level == "note"):  # what the job is planned for
        print(f"  {note}")
    if shutil.which("scontrol"):
        print(f"requeue: {requeue_path(cfg.slurm)}")
    errors = sum(f.level == "error" for f in findings)
    if errors:  # a "dry-run first" gate must stop here, as the submit would
        print(f"preflight found {errors} error(s): submitting would be refused", file=sys.stderr)
        return 2
    return 0


def container_line(cfg: RunConfig, workdir: str, array: bool = False) -> str:
    """Where every rank runs: the srun lines above carry the container (the first step, and the one
    the batch shell starts on each heal); a probe of the nodes runs ``true`` in it."""
    box = cfg.slurm.container
    if not box.runtime:
        return "container: none (slurm.container); every rank runs on the host"
    probe = ["srun", "--nodes=N", "...",
             *probe_tail(cfg.slurm, mount_paths(cfg, workdir, array), workdir)]
    return (f"container: {box.runtime}, image {box.image}: every step of the job runs in it (the "
            "first and each "
            f"healing step: the srun lines above; a probe of the nodes: {shlex.join(probe)})")


def run_dir_words(cfg: RunConfig) -> str:
    """'run dir /abs/path', and where it lies under the submit directory, why
    (docs/submit.md#where-the-run-dir-is)."""
    cwd = Path.cwd().resolve()
    under = Path(cfg.run_dir).is_relative_to(cwd)
    return f"run dir {cfg.run_dir}" + (" (under the directory you submit from: a relative run_dir "
                                       "is resolved "
                                       "against it, not against the config file's directory)"
                                       if under else "")


def program_line(cfg: RunConfig) -> str:
    """What every task runs, as --dry-run shows it: the script's command line resolved, or the loop
    or task; a value from the environment as its ``${oc.env:...}`` text (dry-run output gets pasted
    into tickets)."""
    train = masked(cfg).train
    if train.script:
        resume = (" (then on every attempt that continues the run: + "
                  f"{shlex.join(train.resume_args)})" if train.resume_args else "")
        return f"python {shlex.join([train.script, *train.args])}{resume}"
    if train.loop:
        return (f"train.loop={train.loop}, called as {train.loop.rsplit(':', 1)[-1]}(run) in every "
                "task")
    return f"train.task={train.task}, trained by hpc_ddp's Trainer in every task"


def batch_plans(cfg: RunConfig) -> str:
    """How each node count Slurm may grant splits the global batch (one line per count)."""
    counts = node_counts(cfg.slurm.nodes)
    rows = [f"{n} node{'s' if n > 1 else ' '} -> {plan(cfg.train, n * cfg.slurm.tasks_per_node)}"
            for n in (counts[i] for i in shown(len(counts)))]
    fixed = (f"train.global_batch_size={cfg.train.global_batch_size}: the accumulation follows the "
             "node count"
             if cfg.train.global_batch_size else "train.global_batch_size unset: the batch follows "
                                                 "the world size")
    whose = ("; run.batch gives a train.loop this plan, a loop that sizes its own batches ignores "
             "it" if cfg.train.loop else "")
    return f"batch ({fixed}{whose}):\n" + elided("\n".join(f"  {row}" for row in rows), len(counts),
                                                 "node count")


# a big job's per-rank table: these first and last rows, "... N more" between
SHOW_FIRST, SHOW_LAST = 8, 2


def shown(total: int) -> list[int]:
    """The rows of ``total`` that a table shows: all of a small one, else the first and last few."""
    if total <= SHOW_FIRST + SHOW_LAST + 1:
        return list(range(total))
    return [*range(SHOW_FIRST), *range(total - SHOW_LAST, total)]


def elided(text: str, total: int, what: str, head: int = 0) -> str:
    """``text`` (``head`` header lines, then the :func:`shown` rows of ``total``) with a "... N
    more" line where rows were left out."""
    lines = text.split("\n")
    if total == len(lines) - head:
        return text
    cut = head + SHOW_FIRST
    more = f"  ... {total - SHOW_FIRST - SHOW_LAST} more {what}s ..."
    return "\n".join([*lines[:cut], more, *lines[cut:]])


def shape(nodes: int | str, tasks: int) -> str:
    """'1 node x 1 task', '2-4 nodes x 8 tasks': what the job asks of Slurm, in words."""
    return (f"{nodes} node{'' if str(nodes) == '1' else 's'} x "
            f"{tasks} task{'' if tasks == 1 else 's'}")
