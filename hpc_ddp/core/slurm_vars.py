"""Reading one Slurm variable: the first of its names that is set, as a checked integer.

Every variable of a job may come under several names (the step's view first, then the job's);
a value that is missing or not an integer, or that does not fit another, is refused with a
:class:`SlurmEnvError` that names the variable and the fix. Apart from
:mod:`hpc_ddp.core.slurm_env`, which decides from these values where each process stands: this
is how one value is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpc_ddp.core.errors import SlurmEnvError, explain

SRUN_HINT = ("run every task through srun, e.g. `srun python -m hpc_ddp.worker ...` in the batch "
             "script (or use `python -m hpc_ddp.submit`, which does)")


def lookup(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    """The first of ``names`` that is set, and its value; None when none is."""
    for name in names:
        if name in env:
            return name, env[name]
    return None


def var_name(env: Mapping[str, str], names: Sequence[str]) -> str:
    """The variable of ``names`` that is set (for messages), else the usual one."""
    found = lookup(env, names)
    return found[0] if found else names[0]


def int_var(env: Mapping[str, str], names: Sequence[str], *, minimum: int = 0,
            hint: str = SRUN_HINT) -> int | None:
    """The first of ``names`` present, as an int >= minimum; None when none is set."""
    found = lookup(env, names)
    if found is None:
        return None
    name, value = found
    if not value.strip().isdigit() or not value.strip().isascii() or int(value) < minimum:
        raise SlurmEnvError(explain(f"environment variable {name} is not usable", found=value,
                                    expected=f"an integer >= {minimum}", hint=hint), key=name)
    return int(value)


def required_int(env: Mapping[str, str], names: Sequence[str], *, minimum: int = 0,
                 hint: str = SRUN_HINT) -> int:
    value = int_var(env, names, minimum=minimum, hint=hint)
    if value is None:
        raise SlurmEnvError(explain(f"environment variable {names[0]} is missing",
                                    expected=f"{' or '.join(names)} to be set", hint=hint),
                            key=names[0])
    return value


def check_below(name: str, value: int, limit_name: str, limit: int) -> None:
    if value >= limit:
        raise SlurmEnvError(explain(f"{name}={value} does not fit {limit_name}={limit}",
                                    expected=f"0 <= {name} < {limit}",
                                    hint="the job's variables disagree; was part of the "
                                    "environment set by hand or copied from another job?"),
                            key=name)
