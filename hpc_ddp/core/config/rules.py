"""Each key's own rule: the range, choice or format one value must have (:data:`RULES`), the keys
that may be null (:data:`OPTIONAL`), and the limits they name (:data:`MAX_NODES`, ...).

The schema's types cannot say these: ranges, choices, formats, the element types of lists and
mappings (omegaconf lets ``[a, [b]]`` through as ``List[str]``). A rule reads one value;
:func:`hpc_ddp.core.config.checks.check_config` walks them, then checks the rules across keys.
Apart from it so the table, which grows with every key, is read on its own. Pure: no omegaconf, no
torch.
"""

from __future__ import annotations

import math
import re
import signal as _signal
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.core.batching import node_counts, valid_nodes
from hpc_ddp.core.compile_settings import CACHE_EXPECTED, COMPILE_EXPECTED, cache_ok
from hpc_ddp.core.container import RUNTIMES
from hpc_ddp.core.hostlist import MAX_RANGE

_TASK = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_SBATCH_OPTION = re.compile(r"[a-z][a-z0-9-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MOUNT = re.compile(r"/[^,:\n]*(:/[^,:\n]*(:[^,:\n]+)?)?")
# The largest node count and tasks per node a config may ask for: Slurm's node lists hold at most
# MAX_RANGE (65536) hosts in one range (so does our hostlist), the largest Slurm clusters have tens
# of thousands of nodes, and Slurm's own MaxTasksPerNode may not exceed 65533. Beyond them a value
# is a typo (1e23), and the login node's tools (--dry-run's tables, the batch plans) would work
# through it for ever.
MAX_NODES = MAX_RANGE
MAX_TASKS_PER_NODE = 65_533
# dist.liveness_s's default: the one value that steps aside (off) for a small dist.timeout_s
LIVENESS_S = 30.0
SIGNALS = sorted(s.name[3:] for s in _signal.Signals if s.name.startswith("SIG")
                 and "_" not in s.name
                 and s.name not in ("SIGKILL", "SIGSTOP", "SIGUSR1"))


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _at_most(high: int, low: int = 1) -> Callable[[Any], bool]:
    return lambda v: _at_least(low)(v) and v <= high


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _mapping(key_pattern: re.Pattern[str]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and key_pattern.fullmatch(k) and isinstance(x, str) and "\n" not in x
        for k, x in v.items())


def _word(v: Any) -> bool:
    """One sbatch option value: it lands on an ``#SBATCH`` line, so no spaces or newlines."""
    return isinstance(v, str) and bool(v) and not any(c.isspace() for c in v)


def _regex_with_group(v: Any) -> bool:
    try:
        return isinstance(v, str) and re.compile(v).groups >= 1
    except re.error:
        return False


def _user_keys(v: Any) -> bool:
    """The user section: a mapping whose keys, at every depth, are names (they become dotted keys
    and HPC_DDP_USER_* variables); values are anything YAML holds."""
    return isinstance(v, dict) and all(isinstance(k, str) and _USER_KEY.fullmatch(k)
                                       and (not isinstance(x, dict) or _user_keys(x))
                                       for k, x in v.items())


_USER_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")

# key -> (check, expected); None passes for keys whose schema type is Optional.
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (lambda v: bool(_NAME.fullmatch(v)), "letters, digits, '.', '_', '+', '-' (it names a "
                                                 "directory)"),
    "run_dir": (lambda v: bool(v.strip()), "a directory path"),
    "profile": (lambda v: v == "" or bool(_NAME.fullmatch(v)),
                "a profile's name (its file's stem), or empty"),
    "slurm.nodes": (lambda v: valid_nodes(v) and node_counts(v)[-1] <= MAX_NODES,
                    f"an integer >= 1 and at most {MAX_NODES} (the most hosts one Slurm node list "
                    "range holds; no "
                    "Slurm cluster has more nodes), or a range MIN-MAX within them such as 2-4"),
    "slurm.tasks_per_node": (_at_most(MAX_TASKS_PER_NODE), "an integer >= 1 and at most "
                                                           f"{MAX_TASKS_PER_NODE} "
                             "(Slurm's own ceiling on MaxTasksPerNode)"),
    "slurm.gpus_per_node": (_at_least(0), "an integer >= 0"),
    "slurm.cpus_per_task": (_at_least(1), "an integer >= 1"),
    "slurm.mem_gb": (_positive, "a number of GB > 0, or null"),
    "slurm.timeout_min": (_at_least(1), "an integer number of minutes >= 1"),
    "slurm.partition": (_word, "a partition name without spaces (a,b for several), or null"),
    "slurm.account": (_word, "an account name without spaces, or null"),
    "slurm.qos": (_word, "a QOS name without spaces, or null"),
    "slurm.constraint": (_word, "a feature expression without spaces, e.g. 'a100|h100', or null"),
    "slurm.signal": (lambda v: v in SIGNALS, f"a signal name, one of {', '.join(SIGNALS)}"),
    "slurm.signal_delay_s": (_at_least(0), "an integer number of seconds >= 0"),
    "slurm.max_timeouts": (_at_least(0), "an integer >= 0"),
    "slurm.max_preemptions": (_at_least(0), "an integer >= 0"),
    "slurm.max_failures": (_at_least(0), "an integer >= 0"),
    "slurm.spare_nodes": (lambda v: _at_least(0)(v) and v <= MAX_NODES,
                          f"an integer >= 0 and at most {MAX_NODES}"),
    "slurm.max_restarts_in_job": (_at_least(0), "an integer >= 0"),
    "slurm.setup": (_texts, "a list of shell lines"),
    "slurm.sbatch_extra": (_mapping(_SBATCH_OPTION), "a mapping of sbatch long options without "
                           "'--' (e.g. mail-type) to one-line text values"),
    "slurm.srun_args": (_texts, "a list of text arguments"),
    "slurm.container.runtime": (lambda v: v in RUNTIMES, f"one of {', '.join(RUNTIMES)}, or null "
                                                         "(no container)"),
    "slurm.container.image": (lambda v: isinstance(v, str) and v.strip() == v and "\n" not in v,
                              "an image without surrounding spaces (empty without a container)"),
    "slurm.container.mounts": (lambda v: _texts(v) and all(_MOUNT.fullmatch(m) for m in v),
                               "a list of SRC[:DST[:OPTS]] with absolute paths and no commas, e.g. "
                               "[/scratch/data:/data:ro] (for an environment variable: "
                               "${oc.env:SCRATCH})"),
    "slurm.container.args": (_texts, "a list of text arguments"),
    "slurm.container.python": (_word, "a command without spaces, e.g. python3 or "
                                      "/opt/conda/bin/python"),
    "slurm.straggler.action": (lambda v: v in ("warn", "replace", "off"),
                               "one of warn, replace, off"),
    "slurm.straggler.ratio": (lambda v: _positive(v) and v > 1, "a number > 1, e.g. 1.5"),
    "slurm.straggler.windows": (_at_least(1), "an integer >= 1"),
    "slurm.straggler.window_steps": (_at_least(1), "an integer >= 1"),
    "slurm.health.checks": (lambda v: v in ("off", "quick", "full"), "one of off, quick, full"),
    "slurm.health.action": (lambda v: v in ("warn", "replace"), "one of warn, replace"),
    "slurm.health.below": (lambda v: _positive(v) and v < 1, "a number between 0 and 1, e.g. 0.3"),
    "dist.backend": (lambda v: v in ("auto", "nccl", "gloo"), "one of auto, nccl, gloo"),
    "dist.timeout_s": (_at_least(1), "an integer number of seconds >= 1"),
    "dist.liveness_s": (lambda v: v == 0 or (_positive(v) and v >= 1),
                        "a number of seconds >= 1, or 0 or null to turn liveness off"),
    "dist.master_port": (lambda v: _at_least(1)(v) and v <= 65535, "a port 1..65535, or null"),
    "dist.nccl_env": (_mapping(_ENV_NAME),
                      "a mapping of environment variable names to text values"),
    "train.task": (lambda v: v == "" or bool(_TASK.fullmatch(v)), "'package.module:ClassName'"),
    "train.loop": (lambda v: v == "" or bool(_TASK.fullmatch(v)), "'package.module:function'"),
    "train.script": (lambda v: v == "" or (v.strip() == v and "\n" not in v),
                     "a path to a .py file"),
    "train.args": (_texts, "a list of text arguments"),
    "train.resume_args": (_texts, "a list of text arguments"),
    "train.script_progress": (_regex_with_group, "a regular expression with one group that matches "
                                                 "the step"),
    "train.max_steps": (_at_least(1), "an integer >= 1, or null"),
    "train.epochs": (_at_least(1), "an integer >= 1, or null"),
    "train.batch_size": (_at_least(1), "an integer >= 1"),
    "train.grad_accum": (_at_least(1), "an integer >= 1"),
    "train.global_batch_size": (_at_least(1), "an integer >= 1, or null"),
    "train.lr": (_positive, "a finite number > 0"),
    "train.amp": (lambda v: v in ("off", "bf16", "fp16"), "one of off, bf16, fp16"),
    "train.clip_grad_norm": (_positive, "a finite number > 0, or null"),
    "train.seed": (_at_least(0), "an integer >= 0"),
    "train.rng": (lambda v: v in ("derived", "saved"), "one of derived, saved"),
    "train.log_every": (_at_least(1), "an integer >= 1"),
    "train.num_workers": (_at_least(0), "an integer >= 0"),
    # its options: _check_compile
    "train.compile": (lambda v: isinstance(v, (bool, Mapping)), COMPILE_EXPECTED),
    "train.compile_cache": (cache_ok, CACHE_EXPECTED),
    "snapshot.every_steps": (_at_least(1), "an integer >= 1, or null"),
    "snapshot.every_minutes": (_positive, "a number of minutes > 0, or null"),
    "snapshot.keep_last": (_at_least(1), "an integer >= 1"),
    "snapshot.replicas": (_at_least(1), "an integer >= 1 (2: survives the loss of any one node's "
                                        "file)"),
    "snapshot.load": (lambda v: v in ("auto", "spread", "every_node", "every_rank"),
                      "one of auto, spread, every_node (every_rank: its old name)"),
    "user": (_user_keys, "a mapping whose keys (at every depth) are names: a letter or _, then "
             "letters, digits, _ or -"),
    "metrics.wandb_mode": (lambda v: v in ("online", "offline", "disabled"),
                           "one of online, offline, disabled"),
    "metrics.wandb_project": (lambda v: isinstance(v, str) and not any(c in v for c in "/\\#?%:"),
                              "a W&B project name without / \\ # ? % : (empty: the run's name)"),
}
OPTIONAL = {"slurm.container.runtime", "slurm.mem_gb", "slurm.partition", "slurm.account",
            "slurm.qos", "slurm.constraint", "dist.master_port",
            "dist.liveness_s", "train.max_steps", "train.epochs", "train.global_batch_size",
            "train.clip_grad_norm", "snapshot.every_steps", "snapshot.every_minutes"}


def _run_dir_mode(value: Any) -> bool:
    """run_dir_mode's own check raises the error that says what to write
    (:mod:`hpc_ddp.core.run_dir_mode`)."""
    from hpc_ddp.core.run_dir_mode import check_run_dir_mode

    check_run_dir_mode(value)
    return True


RULES["run_dir_mode"] = (_run_dir_mode, "a folder mode of four octal digits in quotes, e.g. '0750'")
