"""Print docs/reference.md from the public API's docstrings: `python dev/api_reference.py > docs/reference.md`.

tests/test_docs.py fails when the committed page differs from this output, and when a
public object listed here has no docstring.
"""

from __future__ import annotations

import importlib
import inspect
import re

# The library use of hpc_ddp: what own_loop.py-style code imports. Order is the page's order.
PUBLIC = {
    "hpc_ddp.rank.loop.run": ["Run", "params_sha256"],
    "hpc_ddp.rank.state.tracked": ["per_rank"],
    "hpc_ddp.rank.stop.shield": ["worker_init"],
    "hpc_ddp.rank.worker": ["session"],
    "hpc_ddp.core.slurm_env": ["DistEnv", "from_environ", "torch_env", "master_port", "rendezvous_endpoint",
                          "simulated_environ", "parse_tasks_per_node"],
    "hpc_ddp.core.hostlist": ["expand_hostlist", "compress_hostlist"],
    "hpc_ddp.rank.group.distributed": ["process_group", "init_process_group", "choose_backend", "device_index", "all_mean",
                            "any_rank", "exit_fast"],
    "hpc_ddp.rank.loop.sampler": ["ShardSampler"],
    "hpc_ddp.core.stopping": ["StopFlag", "stop_reason", "term_reason"],
    "hpc_ddp.core.slurm_jobs": ["requeue", "job_fields"],
    "hpc_ddp.rundir.ledger": ["read_attempts", "cap_reached"],
    "hpc_ddp.rundir.metrics_file": ["read", "history", "line"],
    "hpc_ddp.rundir.snapshot": ["committed_steps", "choose", "read_state", "file_problem", "load_file", "commit"],
    "hpc_ddp.rundir.retention": ["prune"],
    "hpc_ddp.rank.state.checkpointer": ["Checkpointer"],
    "hpc_ddp.rank.watch.watchdog": ["Watchdog", "laggards"],
    "hpc_ddp.rundir.runlock": ["acquire", "release"],
    "hpc_ddp.rank.loop.task": ["Task", "load_task", "load_loop"],
    "hpc_ddp.core.config": ["load_config", "save_config", "to_yaml"],
}
HEADER = """\
# Library reference

Generated from the docstrings by `python dev/api_reference.py > docs/reference.md`; a test fails
when they differ. First the run API your own loop calls (`hpc_ddp.Run`, `hpc_ddp.session`; see
[Your own loop](own-loop.md)); then the pieces underneath, for using hpc_ddp as a library (see
`examples/own_loop.py`): the derivation, the process group, the stop flag and the snapshots.
"""


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _methods(cls: type) -> list[str]:
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        doc = inspect.getdoc(member)
        if doc:
            sig = "" if isinstance(member, property) else _signature(member)
            out.append(f"- `{name}{sig}`: {doc.splitlines()[0]}")
    return out


def missing_docstrings() -> list[str]:
    return [f"{module}.{name}" for module, names in PUBLIC.items() for name in names
            if not inspect.getdoc(getattr(importlib.import_module(module), name))]


def render() -> str:
    parts = [HEADER]
    for module_name, names in PUBLIC.items():
        module = importlib.import_module(module_name)
        parts.append(f"\n## `{module_name}`\n\n{(inspect.getdoc(module) or '').strip()}\n")
        for name in names:
            obj = getattr(module, name)
            kind = "class " if inspect.isclass(obj) else ""
            parts.append(f"\n### {kind}`{name}{_signature(obj)}`\n\n{(inspect.getdoc(obj) or '').strip()}\n")
            if inspect.isclass(obj):
                methods = _methods(obj)
                if methods:
                    parts.append("\n" + "\n".join(methods) + "\n")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
