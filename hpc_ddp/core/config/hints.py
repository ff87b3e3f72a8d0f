""""Did you mean": the config key a mistyped or foreign one stands for, and the override an sbatch
flag does.

A fuzzy match alone misses what newcomers type most: the names other tools use (``lr``,
``learning_rate``, ``slurm.time``, ``slurm.gpus``), a right key in the wrong section (``max_steps``,
``slurm.lr``), and sbatch's own flags on our command line (``--nodes=2``). So: a table of known
synonyms first, then the same key name in another section, then the closest spelling. Pure.
"""

from __future__ import annotations

import difflib

from hpc_ddp.core.config.schema import schema_rows

# what other tools (PyTorch, Lightning, Hydra configs, sbatch, torchrun) call our keys; leaf names
# apply in any section
ALIASES = {
    "lr": "train.lr", "learning_rate": "train.lr", "learningrate": "train.lr",
    "base_lr": "train.lr",
    "steps": "train.max_steps", "max_iters": "train.max_steps", "iterations": "train.max_steps",
    "num_steps": "train.max_steps", "total_steps": "train.max_steps", "max_epochs": "train.epochs",
    "num_epochs": "train.epochs", "batch": "train.batch_size",
    "micro_batch_size": "train.batch_size",
    "accumulate_grad_batches": "train.grad_accum",
    "gradient_accumulation_steps": "train.grad_accum",
    "precision": "train.amp", "mixed_precision": "train.amp",
    "gradient_clip_val": "train.clip_grad_norm",
    "max_grad_norm": "train.clip_grad_norm", "workers": "train.num_workers",
    "time": "slurm.timeout_min", "time_limit": "slurm.timeout_min", "walltime": "slurm.timeout_min",
    "timeout": "slurm.timeout_min", "minutes": "slurm.timeout_min",
    "gpus": "slurm.gpus_per_node", "gres": "slurm.gpus_per_node",
    "gpus_per_task": "slurm.gpus_per_node",
    "num_gpus": "slurm.gpus_per_node", "devices": "slurm.gpus_per_node",
    "ntasks_per_node": "slurm.tasks_per_node", "nproc_per_node": "slurm.tasks_per_node",
    "num_nodes": "slurm.nodes", "nnodes": "slurm.nodes", "n_nodes": "slurm.nodes",
    "mem": "slurm.mem_gb", "memory": "slurm.mem_gb", "cpus": "slurm.cpus_per_task",
    "queue": "slurm.partition", "qos_name": "slurm.qos", "spares": "slurm.spare_nodes",
    "output_dir": "run_dir", "out_dir": "run_dir", "save_dir": "run_dir",
    "checkpoint_dir": "run_dir",
}
# sbatch's flags (long, and the short ones people type), as our keys; "!": the value needs
# converting
SBATCH_FLAGS = {
    "nodes": "slurm.nodes", "N": "slurm.nodes", "ntasks-per-node": "slurm.tasks_per_node",
    "gpus-per-node": "slurm.gpus_per_node", "gpus": "slurm.gpus_per_node",
    "gres": "slurm.gpus_per_node!",
    "cpus-per-task": "slurm.cpus_per_task", "c": "slurm.cpus_per_task",
    "time": "slurm.timeout_min!",
    "t": "slurm.timeout_min!", "partition": "slurm.partition", "p": "slurm.partition",
    "account": "slurm.account",
    "A": "slurm.account", "qos": "slurm.qos", "q": "slurm.qos", "constraint": "slurm.constraint",
    "C": "slurm.constraint", "mem": "slurm.mem_gb!", "exclusive": "slurm.exclusive",
    "job-name": "name",
    "J": "name", "signal": "slurm.signal!", "nproc-per-node": "slurm.tasks_per_node",
    "nnodes": "slurm.nodes",
}
CONVERT = {"slurm.timeout_min": "in minutes (e.g. 2:00:00 is 120)",
           "slurm.mem_gb": "in GB (e.g. 64G is 64)",
           "slurm.gpus_per_node": "a count (e.g. gpu:4 is 4)",
           "slurm.signal": "USR2, with slurm.signal_delay_s"}


UNLIMITED = ("UNLIMITED", "INFINITE", "NONE", "N/A")


def minutes(text: str) -> float | None:
    """A Slurm time (``MaxTime``: ``30``, ``1:00:00``, ``2-00:00:00``, ``7-12``) in minutes; None
    for unlimited or unreadable."""
    text = text.strip()
    if not text or text.upper() in UNLIMITED:
        return None
    days, _, rest = text.rpartition("-")
    try:
        day_count = int(days) if days else 0
        parts = [int(p) for p in rest.split(":")]
    except ValueError:
        return None
    if days:  # days-hours[:minutes[:seconds]]
        parts += [0] * (3 - len(parts))
        hours, mins, secs = parts[:3]
    elif len(parts) == 3:
        hours, mins, secs = parts
    elif len(parts) == 2:  # minutes:seconds
        hours, (mins, secs) = 0, parts
    else:
        hours, mins, secs = 0, parts[0], 0
    return day_count * 1440 + hours * 60 + mins + secs / 60


def _converted(key: str, value: str) -> str | None:
    """An sbatch flag's value as our key takes it (``2:00:00`` -> 120 minutes, ``64G`` -> 64,
    ``gpu:4`` -> 4)."""
    if key == "slurm.timeout_min":
        found = minutes(value)
        return None if found is None else str(max(1, round(found)))
    if key == "slurm.mem_gb":
        units = {"K": 1 / 1024 ** 2, "M": 1 / 1024, "G": 1, "T": 1024}
        number, unit = value[:-1] if value[-1:].upper() in units else value, value[-1:].upper()
        try:
            return f"{float(number) * units.get(unit, 1 / 1024):g}"  # sbatch's default unit is MB
        except ValueError:
            return None
    if key == "slurm.gpus_per_node":
        count = value.rpartition(":")[2]
        return count if count.isdigit() else None
    return None


def _keys() -> list[str]:
    return [row[0] for row in schema_rows()]


def suggest(key: str) -> str | None:
    """The config key ``key`` most likely stands for, or None: a near-typo in its own section, then
    a known synonym, then the same name in another section, then the closest spelling (its section
    first)."""
    keys = _keys()
    norm = key.strip().lstrip("-+~").replace("-", "_")
    parent, _, leaf = norm.rpartition(".")
    prefix = parent + "." if parent else ""
    siblings = list(dict.fromkeys(k[len(prefix):].split(".")[0] for k in keys
                                  if k.startswith(prefix)))
    typo = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.85)
    if typo:
        return ".".join(filter(None, [parent, typo[0]]))
    for candidate in (norm, leaf, leaf.lower()):
        if candidate in ALIASES:
            return ALIASES[candidate]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf and k != norm]
    if len(same_leaf) == 1:
        return same_leaf[0]
    near = difflib.get_close_matches(leaf, siblings, n=1)
    if near:
        return ".".join(filter(None, [parent, near[0]]))
    anywhere = difflib.get_close_matches(norm, keys, n=1)
    return anywhere[0] if anywhere else None


def flag_hint(arg: str) -> str | None:
    """For a command-line argument that looks like an sbatch or torchrun flag (``--nodes=2``,
    ``-N``, ``--lr=0.1``), the ``key=value`` override to type instead; None when it looks like
    nothing we know."""
    name, sep, value = arg.lstrip("-").partition("=")
    if not arg.startswith("-") or not name:
        return None
    key = SBATCH_FLAGS.get(name) or SBATCH_FLAGS.get(name.lower())
    if key is None:
        known = name.replace("-", "_")
        key = suggest(name) if known in ALIASES or known in _leaves() else None
        if key is None:
            return None
    convert = key.endswith("!")
    key = key.rstrip("!")
    shown = ((_converted(key, value) if convert else value) if sep
             else ("true" if key == "slurm.exclusive" else None))
    text = f"{arg} -> {key}={shown or 'VALUE'}"
    if convert and not shown:
        text += f" ({key} is {CONVERT[key]})"
    return text


def _leaves() -> set[str]:
    return {k.rpartition(".")[2] for k in _keys()}
