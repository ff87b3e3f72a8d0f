"""From the run config to what Slurm is asked for (pure: no submitit, no torch).

``submitit_parameters`` is the one place that maps config keys to sbatch options,
so the submit path and (later) the rendered templates cannot disagree.
"""

from __future__ import annotations

import re
import shlex
from importlib import resources
from typing import Any

from hpc_ddp.config import RunConfig


def submitit_parameters(cfg: RunConfig) -> dict[str, Any]:
    """Keyword arguments for ``submitit.SlurmExecutor.update_parameters``.

    Our warning signal replaces submitit's fixed ``USR2@delay`` (``additional_parameters``
    are applied last), ``--requeue`` lets the worker's ``scontrol requeue`` work, and
    ``--kill-on-bad-exit=1`` makes one crashing task end the whole step at once instead
    of leaving the other ranks waiting in a collective.
    """
    slurm = cfg.slurm
    params: dict[str, Any] = {
        "job_name": cfg.name,
        "nodes": slurm.nodes,
        "ntasks_per_node": slurm.tasks_per_node,
        "cpus_per_task": slurm.cpus_per_task,
        "time": slurm.timeout_min,
        "signal_delay_s": slurm.signal_delay_s,
        "setup": list(slurm.setup),
        "srun_args": ["--kill-on-bad-exit=1", *slurm.srun_args],
        "additional_parameters": {"signal": f"{slurm.signal}@{slurm.signal_delay_s}", "requeue": True,
                                  **slurm.sbatch_extra},
    }
    optional = {"gpus_per_node": slurm.gpus_per_node or None, "partition": slurm.partition,
                "account": slurm.account, "qos": slurm.qos, "constraint": slurm.constraint,
                "mem": f"{slurm.mem_gb:g}GB" if slurm.mem_gb else None, "exclusive": slurm.exclusive or None}
    params.update({key: value for key, value in optional.items() if value is not None})
    return params


def sbatch_options(cfg: RunConfig) -> list[str]:
    """The ``#SBATCH`` lines of a rendered template; the same choices as :func:`submitit_parameters`."""
    slurm = cfg.slurm
    options = [f"--job-name={cfg.name}", f"--nodes={slurm.nodes}", f"--ntasks-per-node={slurm.tasks_per_node}"]
    if slurm.gpus_per_node:
        options.append(f"--gpus-per-node={slurm.gpus_per_node}")
    options += [f"--cpus-per-task={slurm.cpus_per_task}", f"--time={slurm.timeout_min}"]
    if slurm.mem_gb:
        options.append(f"--mem={slurm.mem_gb:g}GB")
    for flag, value in (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos),
                        ("constraint", slurm.constraint)):
        if value:
            options.append(f"--{flag}={value}")
    if slurm.exclusive:
        options.append("--exclusive")
    options += [f"--signal={slurm.signal}@{slurm.signal_delay_s}", "--requeue", "--open-mode=append",
                f"--output={cfg.run_dir}/slurm/%j.out"]
    options += [f"--{key}={value}" for key, value in slurm.sbatch_extra.items()]
    return [f"#SBATCH {option}" for option in options]


def render(cfg: RunConfig, config_path: str, python: str = "python", template: str = "ddp.sbatch") -> str:
    """A template from hpc_ddp/templates with its options, setup, CONFIG and command from ``cfg``."""
    text = resources.files("hpc_ddp.templates").joinpath(template).read_text()
    block = re.search(r"^#SBATCH .*?^# --- end of options ---\n", text, flags=re.M | re.S)
    if block is None:
        raise ValueError(f"template {template} has no '#SBATCH ... # --- end of options ---' block")
    head, rest = text[:block.start()], text[block.end():]
    lines = [*sbatch_options(cfg), "# --- end of options ---"]
    rest = re.sub(r"(# --- setup[^\n]*\n)(?:.*\n)*?(# --- end of setup ---)",
                  lambda m: m.group(1) + "".join(f"{line}\n" for line in cfg.slurm.setup) + m.group(2), rest)
    rest = re.sub(r"^CONFIG=.*$", f"CONFIG={shlex.quote(config_path)}", rest, flags=re.M)
    srun = " ".join(["srun", "--kill-on-bad-exit=1", *map(shlex.quote, cfg.slurm.srun_args)])
    rest = re.sub(r"^exec srun .* -m hpc_ddp.worker", f"exec {srun} {shlex.quote(python)} -m hpc_ddp.worker",
                  rest, flags=re.M)
    return head + "\n".join(lines) + "\n" + rest
