"""From the run config to what Slurm is asked for (pure: no submitit, no torch).

``submitit_parameters`` is the one place that maps config keys to sbatch options,
so the submit path and (later) the rendered templates cannot disagree.
"""

from __future__ import annotations

import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

from hpc_ddp.core.batching import first_step_span, node_counts, slurm_nodes
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.container import rank_python, runtime_check, step_argv, step_srun_args, wrap
from hpc_ddp.core.requeue_policy import asks_no_requeue
from hpc_ddp.core.shell_safe import one_line, sbatch_value, setup_line, strings


def supervise_line(cfg: RunConfig, configs: list[str], python: str = "python",
                   workdir: str | None = None) -> str:
    """The batch-shell line after submitit's srun: settle the step it ran, heal a failure inside the
    job with steps of the worker, else requeue under max_failures. The worker's config is the run's
    own path; a job array's elements each have theirs, so there the line says ``{config}`` and
    supervise puts in the element's (a person reading the script of one run sees the real path). The
    step is the one
    :func:`hpc_ddp.core.container.step_argv` builds, as for the first step and the probes."""
    paths = mount_paths(cfg, workdir, array=len(configs) > 1)
    program = [rank_python(cfg.slurm, python), "-m", "hpc_ddp.worker", "--config",
               configs[0] if len(configs) == 1 else "{config}"]
    step = step_argv(cfg.slurm, program, paths, workdir)
    return " ".join([shlex.quote(python), "-m", "hpc_ddp.supervise", "--exit-code", "$?",
                     *map(shlex.quote, configs), "--", *map(shlex.quote, step)])


def watch_line(configs: list[str], python: str = "python") -> str:
    """The last setup line of a submitit job: in the background, ``supervise --watch`` ends
    submitit's srun once only nodes the survivors declared lost are left (a frozen or cut-off node:
    srun would wait for Slurm to mark it down, SlurmdTimeout later), so the supervise line after it
    heals at once (:mod:`hpc_ddp.shell.lost_wait`)."""
    return " ".join([shlex.quote(python), "-m", "hpc_ddp.supervise", "--watch",
                     *map(shlex.quote, configs), "&"])


# The first line of a submitit job's setup. A SIGTERM to the batch shell (a cancel, the end of a
# preemption's grace time, a cluster that preempts with SIGTERM) would end bash at once, before the
# teardown line after srun: no settle step, no line for a killed step, no chained next job where
# Slurm refuses requeue. With a trap, bash waits for srun and goes on to the teardown (measured on
# 22.05: without it nothing after srun ran).
TERM_TRAP = ("trap 'echo \"hpc_ddp: the batch shell got SIGTERM: the step ends, then the settle "
             "step runs\" >&2' "
             "TERM")


def mount_paths(cfg: RunConfig, workdir: str | None, array: bool = False) -> list[str]:
    """What a container mounts of the host: the run dir (a job array's: the sweep's folder that
    holds every element's run dir and the shared logs) and the submit directory, where the task's
    module is found."""
    return [str(Path(cfg.run_dir).parent) if array else cfg.run_dir,
            *([workdir] if workdir else [])]


def submitit_python(cfg: RunConfig, python: str, workdir: str | None = None,
                    array: bool = False) -> str:
    """submitit's ``python`` (``SlurmExecutor(python=...)``): the command its srun starts on every
    task, so in an apptainer or singularity container it is ``RUNTIME exec ... IMAGE python3``."""
    return shlex.join(wrap(cfg.slurm, [rank_python(cfg.slurm, python)],
                           mount_paths(cfg, workdir, array)))


def batch_setup(cfg: RunConfig, cpus: int | None = None) -> list[str]:
    """The batch script's setup lines: ``SRUN_CPUS_PER_TASK`` for every srun in it (the user's setup
    too), the user's ``slurm.setup``, then the check that the container runtime is there."""
    return [f"export SRUN_CPUS_PER_TASK={cpus or cfg.slurm.cpus_per_task}", *user_setup(cfg),
            *runtime_check(cfg.slurm)]


def user_setup(cfg: RunConfig) -> list[str]:
    """``slurm.setup``: the user's own shell lines, as they are, each one line of the script
    (checked again here: a config built in code skips the config checks)."""
    return [setup_line(f"slurm.setup[{i}]", line) for i, line in enumerate(cfg.slurm.setup)]


def script_inputs(python: str, workdir: str | None,
                  configs: list[str] | tuple[str, ...] = ()) -> None:
    """What a script gets besides the config: the submitting Python, the submit directory and the
    config paths are quoted where they land, but a line break in one cannot be carried: refused."""
    one_line("the Python that submits (sys.executable)", python, key="python")
    if workdir:
        one_line("the directory you submit from (the job's working directory)", workdir,
                 key="workdir")
    for path in configs:
        one_line("the run's config path (RUN_DIR/config.yaml)", path, key="run_dir")


def submitit_parameters(cfg: RunConfig, configs: list[str] | None = None, python: str = "python",
                        workdir: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``submitit.SlurmExecutor.update_parameters``.

    Our warning signal replaces submitit's fixed ``USR2@delay`` (``additional_parameters``
    are applied last), ``--requeue`` lets the worker's ``scontrol requeue`` work (left out where
    ``slurm.sbatch_extra`` asks for ``no-requeue``: the job then chains its successor, and an empty
    value is a flag without one), and
    ``--kill-on-bad-exit=1`` makes one crashing task end the whole step at once instead
    of leaving the other ranks waiting in a collective. With ``configs`` (one per array
    element), the teardown settles the attempt (:mod:`hpc_ddp.shell.settle`). submitit's
    srun gets the same options as every later step (:func:`hpc_ddp.core.container.step_srun_args`);
    the command it starts is :func:`submitit_python`'s.
    """
    slurm = cfg.slurm
    script_inputs(python, workdir, configs or [])
    array = bool(configs) and len(configs or []) > 1
    srun = step_srun_args(slurm, paths=mount_paths(cfg, workdir, array), workdir=workdir)
    params: dict[str, Any] = {
        "job_name": cfg.name,
        # submitit multiplies it by the tasks per node: an int (a range goes below); spares are held
        # beside it
        "nodes": held_nodes(slurm),
        "ntasks_per_node": slurm.tasks_per_node,
        "cpus_per_task": slurm.cpus_per_task,
        "time": slurm.timeout_min,
        "signal_delay_s": slurm.signal_delay_s,
        "setup": [TERM_TRAP, *batch_setup(cfg),
                  *([watch_line(configs, python)] if configs else [])],
        "teardown": [supervise_line(cfg, configs, python, workdir)] if configs else [],
        "srun_args": [*srun[:2], *spare_shape(cfg), *srun[2:]],
        "additional_parameters": {"signal": f"{slurm.signal}@{slurm.signal_delay_s}",
                                  **({} if asks_no_requeue(slurm.sbatch_extra)
                                     else {"requeue": True}),
                                  "no_kill": True,
                                  **({"nodes": slurm_nodes(slurm.nodes)}
                                     if len(node_counts(slurm.nodes)) > 1 else {}),
                                  **{key: value if value != "" else True
                                     for key, value in slurm.sbatch_extra.items()}},
    }
    optional = {"gpus_per_node": slurm.gpus_per_node or None, "partition": slurm.partition,
                "account": slurm.account, "qos": slurm.qos, "constraint": slurm.constraint,
                "mem": f"{slurm.mem_gb:g}GB" if slurm.mem_gb else None, "exclusive": slurm.exclusive
                or None}
    params.update({key: value for key, value in optional.items() if value is not None})
    # submitit quotes its #SBATCH values, a line break it cannot
    for where, _, text in strings(params, "submitit's"):
        one_line(where.replace("'s.", "'s "), text, allow="\t", key=where)
    return params


def held_nodes(slurm: Any) -> int:
    """The nodes a job with spares asks for: the most ``slurm.nodes`` allows, plus
    ``slurm.spare_nodes``."""
    return node_counts(slurm.nodes)[-1] + slurm.spare_nodes


def spare_shape(cfg: RunConfig) -> list[str]:
    """With spares, submitit's first step runs on slurm.nodes of the job's nodes, not on all it
    holds, and not on the first one (``--relative=1``): the batch shell runs there, and a step that
    loses its node would take the supervisor with it (no ledger line, no heal). The batch host is a
    spare."""
    span = first_step_span(cfg.slurm)
    if span is None:
        return []
    first, nodes = span
    return [f"--nodes={nodes}", f"--ntasks={nodes * cfg.slurm.tasks_per_node}",
            f"--relative={first}"]


LAUNCHERS = {"srun": "ddp.sbatch", "torchrun": "ddp_torchrun.sbatch"}


def sbatch_options(cfg: RunConfig, launcher: str = "srun") -> list[str]:
    """The ``#SBATCH`` lines of a rendered template; the same choices as
    :func:`submitit_parameters`.

    With ``launcher="torchrun"`` Slurm starts one task per node (torchrun starts the
    workers), so that task gets the CPUs of all the node's workers.
    """
    slurm = cfg.slurm
    tasks, cpus = (1 if launcher == "torchrun" else slurm.tasks_per_node), task_cpus(cfg, launcher)
    nodes = str(held_nodes(slurm)) if slurm.spare_nodes else slurm_nodes(slurm.nodes)
    options = [f"--job-name={cfg.name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks}"]
    if slurm.gpus_per_node:
        options.append(f"--gpus-per-node={slurm.gpus_per_node}")
    options += [f"--cpus-per-task={cpus}", f"--time={slurm.timeout_min}"]
    if slurm.mem_gb:
        options.append(f"--mem={slurm.mem_gb:g}GB")
    for flag, value in (("partition", slurm.partition), ("account", slurm.account),
                        ("qos", slurm.qos),
                        ("constraint", slurm.constraint)):
        if value:
            options.append(f"--{flag}={value}")
    if slurm.exclusive:
        options.append("--exclusive")
    options += [f"--signal={slurm.signal}@{slurm.signal_delay_s}",
                *([] if asks_no_requeue(slurm.sbatch_extra) else ["--requeue"]), "--no-kill",
                "--open-mode=append",
                f"--output={cfg.run_dir}/slurm/%j.out"]
    options += [f"--{key}={value}" if value != "" else f"--{key}"
                for key, value in slurm.sbatch_extra.items()]
    return [f"#SBATCH {_quoted(option)}" for option in options]


def _quoted(option: str) -> str:
    """``--opt=VALUE`` with VALUE as sbatch reads it back
    (:func:`hpc_ddp.core.shell_safe.sbatch_value`): a run_dir with a space or a ``#`` stays one
    value, and a line break is refused."""
    flag, eq, value = option.partition("=")
    if not eq:
        return one_line("an #SBATCH option", flag)
    return f"{flag}={sbatch_value(value, f'the #SBATCH {flag} value')}"


def render(cfg: RunConfig, config_path: str, python: str = "python", launcher: str = "srun",
           workdir: str | None = None) -> str:
    """The ``launcher``'s template (hpc_ddp/templates, linked from slurm/) rendered from ``cfg``.

    Replaced: the ``#SBATCH`` block, ``SRUN_CPUS_PER_TASK``, the setup block (the user's lines, then
    the container runtime's check), the ``CONFIG=``, ``PYTHON=``, ``RANK_PYTHON=`` (the container's
    Python), ``WORKDIR=`` (when ``workdir`` is given: the script then works wherever ``sbatch`` is
    called, as the task module is found there), ``NPROC_PER_NODE=`` and ``SIGNAL=`` lines, and the
    srun options (the line that starts with ``srun --kill-on-bad-exit=1``, with the template's
    ``--cpus-per-task`` and ``--overlap``:
    :func:`hpc_ddp.core.container.step_argv`'s, the container's
    wrapper last, before the rank's command); the rest is the template's text, so a hand edit of a
    template shows up in every rendered script.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)}; found {launcher!r}")
    text = resources.files("hpc_ddp.templates").joinpath(LAUNCHERS[launcher]).read_text()
    block = re.search(r"^#SBATCH .*?^# --- end of options ---\n", text, flags=re.M | re.S)
    if block is None:
        raise ValueError(f"template {LAUNCHERS[launcher]} has no '#SBATCH ... # --- end of options "
                         "---' block")
    head, rest = text[:block.start()], text[block.end():]
    script_inputs(python, workdir, [config_path])
    lines = [*sbatch_options(cfg, launcher), "# --- end of options ---"]
    setup = [*user_setup(cfg), *runtime_check(cfg.slurm)]
    rest = re.sub(r"(# --- setup[^\n]*\n)(?:.*\n)*?(# --- end of setup ---)",
                  lambda m: m.group(1) + "".join(f"{line}\n" for line in setup) + m.group(2), rest)
    cpus = task_cpus(cfg, launcher)
    rest = re.sub(r"^export SRUN_CPUS_PER_TASK=.*$", f"export SRUN_CPUS_PER_TASK={cpus}", rest,
                  flags=re.M)
    values = {"CONFIG": config_path, "PYTHON": python,
              "RANK_PYTHON": rank_python(cfg.slurm, python),
              "NPROC_PER_NODE": str(cfg.slurm.tasks_per_node), "SIGNAL": cfg.slurm.signal,
              **({"WORKDIR": workdir} if workdir else {})}
    for name, value in values.items():
        rest = re.sub(rf"^{name}=.*$", lambda _m, n=name, v=value: f"{n}={shlex.quote(v)}", rest,
                      flags=re.M)
    srun = shlex.join(step_argv(cfg.slurm, [], mount_paths(cfg, workdir), workdir, cpus))
    rest = re.sub(r'^(\s*)srun --kill-on-bad-exit=1(?: --cpus-per-task="\$SRUN_CPUS_PER_TASK")?(?: '
                  r'--overlap)?',
                  lambda m: m.group(1) + srun, rest, flags=re.M)
    return head + "\n".join(lines) + "\n" + rest


def task_cpus(cfg: RunConfig, launcher: str = "srun") -> int:
    """The CPUs of one srun task: a rank's, or under torchrun (one task per node) all the node's
    ranks'."""
    per_node = cfg.slurm.tasks_per_node if launcher == "torchrun" else 1
    return cfg.slurm.cpus_per_task * per_node
