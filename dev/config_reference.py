"""Print docs/config.md from the schema: `python dev/config_reference.py > docs/config.md`.

tests/test_docs.py fails when the committed page differs from this output.
"""

from __future__ import annotations

import json

from hpc_ddp.core.config import schema_rows

HEADER = """\
# Config reference

Generated from the schema in `hpc_ddp/core/config/` by `python dev/config_reference.py > docs/config.md`.
Do not edit by hand: a test fails when this page and the schema differ.

A run's config is one or more YAML files merged in order, then `key=value` overrides from the command
line (`train.lr=0.01`, `slurm.setup=[module load cuda]`, `slurm.sbatch_extra.mail-type=END`).
Values are YAML. `${name}` refers to another key, and `${oc.env:SCRATCH}` to an environment variable
read at submit and again wherever the config is read: `config.yaml` keeps `${oc.env:...}` as written, never
its value ([security](security.md)). A shell variable in a setup line is written `$VAR`, or escaped as `\\${VAR}`.
`key=null` unsets a key: an optional one becomes null, and a text key whose default is empty (such as
`train.task`, to run a `train.loop` from a Task's YAML) becomes empty.
A cluster profile (`--profile NAME`, `HPC_DDP_PROFILE`; see the `profile` key) goes under all of them:
schema defaults < profile < config files < overrides. Lists and values are replaced by a later layer,
mappings (`slurm.sbatch_extra`, `dist.nccl_env`, `user`) are merged key by key.
Your own settings go under `user:` (any keys, nested: `user.eval_every=100`); hpc_ddp reads none of them
and hands them to your program (`run.config.user`, or `HPC_DDP_USER_*` variables for a `train.script`).
An unknown key, a wrong type or a value out of range stops with a `ConfigError`. The error names the
key, what was found and what is expected, and suggests the key you meant: a synonym from other tools (`lr`,
`learning_rate`, `slurm.time`, `slurm.gpus`), the same name in another section (`max_steps`), or the nearest
spelling. An sbatch flag given to submit (`--nodes=2`, `-t 2:00:00`) is answered with the override to type.
Text that can reach the job's batch script (every key but `user`, `train.args`, `train.resume_args` and
`train.script_progress`) must be one line: a control character (a newline, a carriage return, a tab; in YAML
a double-quoted `\\n` or `\\t`) is refused with the key named, as is a backslash in the keys that land on
`#SBATCH` lines (`name`, `run_dir`, `slurm.partition`, `.account`, `.qos`, `.constraint`, `.sbatch_extra`).
Spaces, quotes, `$(...)` and backticks are fine: the scripts quote them (docs/submit.md, what reaches the
batch script). A `slurm.setup` line is your own shell command, kept as it is, one line each (a tab is fine;
a trailing backslash, which would join the next line, is not).
`slurm.nodes` is at most 65536 (one Slurm node list range) and `slurm.tasks_per_node` at most 65533 (Slurm's
MaxTasksPerNode ceiling): a larger value is a typo.

| key | type | default | meaning |
|---|---|---|---|
"""


def render() -> str:
    rows = [f"| `{key}` | {tp} | `{json.dumps(default)}` | {doc} |" for key, tp, default, doc in schema_rows()]
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
