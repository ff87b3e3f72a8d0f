"""The one config schema of a run, and loading it from YAML files and ``key=value`` overrides.

``omegaconf`` lives only in this module: it merges the YAML files in order, then
the dotlist overrides, against the dataclass schema; every omegaconf or YAML
failure is turned into a :class:`ConfigError` that names the key, the value, what
was expected and the fix. Checks omegaconf does not do (ranges, choices, the
element types of lists and dicts) are in :mod:`hpc_ddp.core.config_checks`.

Every field carries its documentation in ``metadata["doc"]``: the config
reference is generated from it (:func:`schema_rows`), so it cannot drift.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError

from hpc_ddp.core.config_checks import LIVENESS_S, check_config
from hpc_ddp.core.errors import ConfigError, explain


def _doc(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def _doc_factory(factory: Any, doc: str) -> Any:
    return field(default_factory=factory, metadata={"doc": doc})


@dataclass
class SlurmConfig:
    """What to ask Slurm for, and how often a run may be requeued."""

    nodes: Union[int, str] = _doc(1, "Number of nodes, or a range MIN-MAX (e.g. 2-4): Slurm starts the job on any "
                                  "count in it that is free, and each requeue may get another (needs "
                                  "train.global_batch_size; see docs/resume.md).")
    tasks_per_node: int = _doc(1, "Processes per node; one per GPU on GPU nodes.")
    gpus_per_node: int = _doc(0, "GPUs to request per node (0 on CPU partitions).")
    cpus_per_task: int = _doc(1, "CPU cores per task (data loader workers need their own).")
    mem_gb: Optional[float] = _doc(None, "Memory per node in GB; null keeps the partition's default.")
    timeout_min: int = _doc(60, "Time limit of one attempt in minutes.")
    partition: Optional[str] = _doc(None, "Partition (-p); null uses the cluster's default.")
    account: Optional[str] = _doc(None, "Account to charge (-A).")
    qos: Optional[str] = _doc(None, "Quality of service (--qos).")
    constraint: Optional[str] = _doc(None, "Node features (-C), e.g. 'a100'.")
    exclusive: bool = _doc(False, "Ask for whole nodes (--exclusive).")
    signal: str = _doc("USR2", "Warning signal Slurm sends before the time limit; never USR1 (NCCL uses it).")
    signal_delay_s: int = _doc(120, "Seconds before the time limit that the warning signal arrives.")
    max_timeouts: int = _doc(20, "Requeues allowed after running into the time limit.")
    max_preemptions: int = _doc(20, "Requeues allowed after preemption.")
    max_failures: int = _doc(0, "Requeues allowed after a crash or a hang (0: a crash ends the run, keeping "
                             "its newest snapshot; a bug that crashes every time would burn the allocation).")
    spare_nodes: int = _doc(0, "Nodes the job holds beside slurm.nodes and trains on only when one fails: a "
                            "failed node is replaced inside the allocation and the resume is bit-exact "
                            "(needs a fixed slurm.nodes; see docs/faults.md, healing).")
    max_restarts_in_job: int = _doc(3, "New steps the batch shell may start inside the job after failed ones (a "
                                    "crash, a hang, a lost node), on healthy nodes from the last snapshot, before "
                                    "the failure takes the requeue path (slurm.max_failures); 0: never.")
    setup: List[str] = _doc_factory(list, "Shell lines run before the job starts (module load, source venv).")
    sbatch_extra: Dict[str, str] = _doc_factory(dict, "Extra sbatch options without '--', e.g. {mail-type: END}.")
    srun_args: List[str] = _doc_factory(list, "Extra arguments for srun, e.g. ['--cpu-bind=cores'].")


@dataclass
class DistConfig:
    """How the processes of a job find each other."""

    backend: str = _doc("auto", "auto (NCCL when CUDA is available, else gloo), nccl or gloo.")
    timeout_s: int = _doc(600, "Seconds a rank may go without progress (one step, a snapshot write, the "
                          "start-up) before the watchdog declares the job hung, names the stuck ranks and dumps the collectives "
                          "each rank was in to RUN_DIR/errors/. When every rank is at the same place (a collective "
                          "itself is stuck), rank 0 waits up to 2 x this before it declares the hang. The "
                          "collectives' own timeout is 2 x this + 30 s.")
    liveness_s: Optional[float] = _doc(LIVENESS_S, "Seconds without a liveness beat after which a rank or node "
                                       "counts as lost (frozen, powered off): every rank beats from a side thread "
                                       "to RUN_DIR/liveness/ (a long step or eval is not silence) and watches one "
                                       "peer; the rank that sees the silence names the lost rank and its host in "
                                       "RUN_DIR/errors/ and ends the step (exit 6), which the batch shell heals. "
                                       "null or 0: off. It must be at most half of dist.timeout_s, or the hang "
                                       "watchdog speaks first; the default steps aside (off) when dist.timeout_s is "
                                       "below 60.")
    master_port: Optional[int] = _doc(None, "Rendezvous port; null derives it from the job id.")
    nccl_env: Dict[str, str] = _doc_factory(dict, "Variables exported before init, e.g. {NCCL_DEBUG: INFO}. "
                                 "They win over hpc_ddp's own NCCL defaults (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, the "
                                 "flight recorder: docs/faults.md).")


@dataclass
class TrainConfig:
    """The training loop."""

    task: str = _doc("", "The task class our Trainer trains, as 'package.module:ClassName'. Exactly one of "
                     "train.task, train.loop and train.script names what the job runs.")
    loop: str = _doc("", "Your own training loop, as 'package.module:function': called as function(run) in "
                     "every task, with the run object (run.resume, run.boundary; see docs/own-loop.md).")
    script: str = _doc("", "An unmodified torchrun-style script (a .py path, relative to the submit directory) run "
                       "in every task with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... set; the stop signal "
                       "reaches it and its exit after one is a requeue.")
    args: List[str] = _doc_factory(list, "Command-line arguments for train.script.")
    resume_args: List[str] = _doc_factory(list, "Appended to train.args on every attempt that continues the run "
                                          "(a requeue or --resume: the ledger has an earlier attempt), for "
                                          "scripts that must be told to resume: ['--init_from=resume'] for "
                                          "nanoGPT's train.py, ['--resume', '${run_dir}/ckpt.pt'].")
    script_progress: str = _doc(r"(?i)\bstep\b\D{0,3}(\d+)", "A regex that finds train.script's step in rank 0's "
                                "output (group 1: the step): the local rehearsal's --preempt-at/--timeout-at fire "
                                "by it, and the worker judges by it whether the script went on after a stop signal.")
    max_steps: Optional[int] = _doc(None, "Stop after this many optimizer steps (train.task needs this or epochs; "
                                    "a train.loop may read it from run.config).")
    epochs: Optional[int] = _doc(None, "Stop after this many epochs; with max_steps, whichever comes first.")
    batch_size: int = _doc(32, "Samples per rank per micro-step.")
    grad_accum: int = _doc(1, "Micro-steps per optimizer step (with train.global_batch_size set, it follows the "
                           "world size instead).")
    global_batch_size: Optional[int] = _doc(None, "Samples per optimizer step over all ranks. Set, it stays the "
                                            "same at any world size: the accumulation is global_batch_size / "
                                            "(batch_size x world size), so a run can resume on another node count "
                                            "with the same batch and data order. Null: batch_size x grad_accum x "
                                            "world size.")
    lr: float = _doc(1e-3, "Learning rate given to the task's optimizer.")
    amp: str = _doc("off", "Mixed precision: off, bf16 (autocast) or fp16 (autocast with a grad scaler).")
    clip_grad_norm: Optional[float] = _doc(None, "Clip the gradient norm to this value; null: no clipping.")
    sync_batchnorm: bool = _doc(False, "Convert BatchNorm layers to SyncBatchNorm.")
    find_unused_parameters: bool = _doc(False, "DDP's find_unused_parameters (slower; only if the model needs it).")
    seed: int = _doc(0, "Seed for model init, shuffling and every rank's RNG.")
    log_every: int = _doc(10, "Write a metrics line every this many steps.")
    num_workers: int = _doc(0, "DataLoader worker processes per rank.")


@dataclass
class SnapshotConfig:
    """When snapshots are written and how many are kept."""

    every_steps: Optional[int] = _doc(None, "Snapshot every this many steps; null: not by step count.")
    every_minutes: Optional[float] = _doc(30.0, "Snapshot every this many minutes; null: not by time.")
    keep_last: int = _doc(2, "Committed snapshots to keep (the newest is never deleted early).")
    replicas: int = _doc(2, "Nodes whose files hold each slice of the replicated state. Each node writes "
                         "replicas/nodes of it, so a snapshot costs replicas x the state at any node count. "
                         "1: fewest bytes, a lost file falls back to the previous snapshot; 2 (default): any "
                         "one lost or damaged file is survived with the newest step; >= nodes: a whole copy "
                         "in every node's file.")
    load: str = _doc("auto", "How a resume reads the snapshot: spread (each node reads its own slices once, the "
                     "rest arrives over the process group: the filesystem serves the state once), every_rank "
                     "(every rank reads every slice: the state once per node at best), or auto: spread on a "
                     "cluster, every_rank in the local rehearsal (one page cache; broadcasts there cost more, B9).")
    async_write: bool = _doc(False, "Write periodic snapshots in a background thread (the step only copies "
                             "to CPU); the stop snapshot is always synchronous.")


@dataclass
class MetricsConfig:
    """Where rank 0's metrics go besides metrics.jsonl; each stays one run across requeues."""

    tensorboard: bool = _doc(False, "Write TensorBoard event files to RUN_DIR/tensorboard (pip install "
                             "'hpc_ddp[tensorboard]'); a resumed attempt replaces the steps after its snapshot.")
    wandb: bool = _doc(False, "Log to Weights & Biases (pip install 'hpc_ddp[wandb]'): one W&B run per run, its "
                       "id kept in RUN_DIR/wandb_id.txt so every requeued attempt resumes it.")
    wandb_project: str = _doc("", "W&B project; empty: the run's name.")
    wandb_mode: str = _doc("online", "W&B mode: online, offline (no network needed; upload later with wandb "
                           "sync RUN_DIR/wandb/offline-run-*) or disabled.")


@dataclass
class RunConfig:
    """One run: where it lives, what it asks of Slurm, and how it trains."""

    name: str = _doc("", "Run name; keys the run directory. Defaults to the first config file's name.")
    run_dir: str = _doc("runs/${name}", "Run directory: config, snapshots, ledger, metrics, logs.")
    slurm: SlurmConfig = _doc_factory(SlurmConfig, "Slurm resources and requeue caps.")
    dist: DistConfig = _doc_factory(DistConfig, "Process group settings.")
    train: TrainConfig = _doc_factory(TrainConfig, "Training loop settings.")
    snapshot: SnapshotConfig = _doc_factory(SnapshotConfig, "Snapshot policy.")
    metrics: MetricsConfig = _doc_factory(MetricsConfig, "TensorBoard and W&B (metrics.jsonl is always written).")


def schema_rows(schema: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """(key path, type, default, doc) for every leaf of the schema, in declaration order."""
    hints = _type_hints(schema)
    for f in dataclasses.fields(schema):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_rows(hints[f.name], prefix=f"{path}.")
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            yield path, _type_name(hints[f.name]), default, f.metadata.get("doc", "")


def _type_hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _type_name(tp: Any) -> str:
    text = repr(tp).replace("typing.", "")
    return getattr(tp, "__name__", text) if not hasattr(tp, "__args__") else text


def schema_node(path: str) -> tuple[type | None, Any]:
    """(section dataclass, field type) at a dotted key path; (None, None) if unknown."""
    section: type = RunConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        hints = _type_hints(section)
        if part not in hints:
            return (section if i == len(parts) - 1 else None), None
        if i == len(parts) - 1 or not dataclasses.is_dataclass(hints[part]):
            return section, hints[part]
        section = hints[part]
    return None, None


def load_config(paths: Sequence[str | os.PathLike[str]] = (), overrides: Sequence[str] = ()) -> RunConfig:
    """Merge YAML files in order, then ``key=value`` overrides; validate; return the dataclass.

    ``name`` defaults to the first file's stem (``examples/mlp.yaml`` -> ``mlp``).
    Raises :class:`ConfigError` naming the key, value, expectation and fix.
    """
    merged = OmegaConf.structured(RunConfig)
    for path in paths:
        merged = _merge(merged, _read_yaml(Path(path)), f"config file {os.fspath(path)}")
    for item in overrides:
        merged = _merge(merged, _parse_override(item), f"override {item!r}", key=item.partition("=")[0])
    try:
        name = merged.name  # resolves an interpolation such as name=${x}: a missing key fails here
    except Exception as err:
        raise _translate(err, "the merged config") from err
    if not name:
        if not paths:
            raise ConfigError(explain("the run has no name", expected="a name for the run directory",
                                      hint="pass a config file or add name=my_run"), key="name")
        merged.name = Path(paths[0]).stem
    try:
        cfg = OmegaConf.to_object(merged)
    except Exception as err:  # interpolations resolve here: ${oc.env:SCRATCH}, ${name}
        raise _translate(err, "the merged config") from err
    check_config(cfg)
    return cfg  # type: ignore[return-value]


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(explain(f"cannot read config file {os.fspath(path)}: {err.strerror}",
                                  hint="check the path (relative paths start at the current directory)")) from None
    try:
        data = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except Exception as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(explain(f"config file {os.fspath(path)} is not valid YAML{where}: "
                                  f"{str(err).splitlines()[0]}", hint="fix the YAML syntax there")) from None
    if not OmegaConf.is_dict(data):
        raise ConfigError(explain(f"config file {os.fspath(path)} must hold a mapping of keys",
                                  found=type(data._content).__name__, expected="'key: value' lines"))
    return data


def _parse_override(item: str) -> Any:
    key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
    if not sep or not _KEY.fullmatch(key):
        hint = (f"give it a value: {key}=VALUE" if not sep and _KEY.fullmatch(key) else
                "keys are dotted names (train.lr); quote values with spaces: 'slurm.setup=[\"a b\"]'")
        raise ConfigError(explain("cannot read override", found=item, expected="key=value with a dotted key, "
                                  "e.g. train.lr=0.01", hint=hint),
                          key=key if sep and key else (str(item) or "<empty override>"))
    try:
        return OmegaConf.from_dotlist([item])
    except Exception as err:
        raise ConfigError(explain(f"cannot parse the value of override {item!r}: {str(err).splitlines()[0]}",
                                  hint=_parse_hint(key, value)), key=key) from None


def _parse_hint(key: str, value: str) -> str:
    """What to type instead: an element with ${...} or a colon must be quoted inside a YAML list."""
    hint = "values are YAML: 0.1, true, null, [a, b], {k: v}, or quoted text"
    if value.startswith("[") and ("${" in value or ":" in value):
        items = [v.strip() for v in value.strip("[]").split(",")]
        quoted = ",".join(f'"{v}"' if ("${" in v or ":" in v) and not v.startswith(("'", '"')) else v for v in items)
        hint += (f"; in a list, quote an element that holds ${{...}} or a colon, and the whole override for the "
                 f"shell: '{key}=[{quoted}]'")
    return hint


_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


def _unset_nulls(raw: dict[str, Any], section: type | None = None) -> None:
    """``train.task: null`` unsets a text key whose default is empty (it becomes ""), as on the command
    line ``train.task=null``: the key is then not set. Other nulls are left to the schema's check."""
    section = section or RunConfig
    fields = {f.name: f for f in dataclasses.fields(section)}
    hints = _type_hints(section)
    for name, value in raw.items():
        field = fields.get(name)
        if field is None:
            continue
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[name]):
            _unset_nulls(value, hints[name])
        elif value is None and hints[name] is str and field.default == "":
            raw[name] = ""


def _merge(base: Any, data: Any, source: str, key: str = "") -> Any:
    raw = OmegaConf.to_container(data, resolve=False)  # unresolved: "train=${x}" must not resolve here
    if isinstance(raw, dict):
        _unset_nulls(raw)
        data = OmegaConf.create(raw)
    for section in (f.name for f in dataclasses.fields(RunConfig) if f.default_factory is not dataclasses.MISSING):
        if section in raw and not isinstance(raw[section], dict) and raw[section] is not None:
            raise ConfigError(explain(f"in {source}, {section} must be a section of keys",
                                      found=raw[section], expected=f"{section}.KEY: VALUE or a mapping",
                                      hint=f"e.g. {section}.{_first_key(section)}=..."), key=section)
    try:
        return OmegaConf.merge(base, data)
    except Exception as err:
        raise _translate(err, source, key) from None


def _first_key(section: str) -> str:
    return dataclasses.fields(_type_hints(RunConfig)[section])[0].name


def _translate(err: Exception, source: str, fallback_key: str = "") -> ConfigError:
    """An omegaconf exception as a ConfigError in the house style (``fallback_key``: the override's key,
    for errors that omegaconf reports without one, such as a mapping given for a list)."""
    key = str(getattr(err, "full_key", "") or "") or fallback_key
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, InterpolationResolutionError):
        return ConfigError(explain(f"cannot resolve an interpolation in config key {key or '?'} ({source}): "
                                   f"{first_line}", hint="${name} refers to a config key and ${oc.env:VAR} to an "
                                   "environment variable; for a shell variable in a setup line write $VAR, "
                                   "or escape it as \\${VAR}"), key=key or None)
    key_path = re.sub(r"\[\d+\]", "", key)  # slurm.setup[0] -> slurm.setup
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key:
        section, _ = schema_node(key_path)
        parent, _, leaf = key_path.rpartition(".")
        valid = [f.name for f in dataclasses.fields(section)] if section else []
        near = difflib.get_close_matches(leaf, valid, n=1)
        hint = f"did you mean {'.'.join(filter(None, [parent, near[0]]))}?" if near else \
            "see the config reference (docs/config.md) for every key"
        return ConfigError(explain(f"unknown config key {key!r} in {source}",
                                   expected=f"one of the keys of {parent or 'the top level'}: {', '.join(valid)}",
                                   hint=hint), key=key)
    if key:
        section, tp = schema_node(key_path)
        found = getattr(err, "value", None)
        hint = f"set it as {key}=<{_expected(tp)}>"
        if found is None and "Optional" not in _type_name(tp):
            default = next((f.default for f in dataclasses.fields(section) if f.name == key_path.rpartition(".")[2]),
                           None) if section else None
            hint = (f"{key} cannot be unset (null): give {_expected(tp)}, or leave it out for its default"
                    + (f" ({default})" if default not in (None, dataclasses.MISSING) else ""))
        return ConfigError(explain(f"bad value for config key {key} in {source}: {first_line}",
                                   found=found, expected=_expected(tp), hint=hint), key=key)
    return ConfigError(f"invalid config in {source}: {first_line}")


def _expected(tp: Any) -> str:
    name = _type_name(tp)
    for words, text in (("List", "a list of text, e.g. [a, b]"), ("Dict", "a mapping, e.g. {k: v}"),
                        ("bool", "true or false"), ("int", "an integer"), ("float", "a number"), ("str", "text")):
        if words in name:
            return text + (" or null" if "Optional" in name else "")
    return name


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML that :func:`load_config` reads back to an equal config."""
    return OmegaConf.to_yaml(OmegaConf.create(_escape(dataclasses.asdict(cfg))))


def _escape(value: Any) -> Any:
    """Resolved text may hold a literal '${' (an escaped shell variable); keep it literal on reload."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def save_config(cfg: RunConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config durably (temp file, fsync, rename): never half a file."""
    from hpc_ddp.core.atomic import write_atomic

    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, to_yaml(cfg))
    except OSError as err:
        raise ConfigError(explain(f"cannot write {target}: {err.strerror}", found=str(target.parent),
                                  expected="a writable run dir",
                                  hint="set run_dir=... to a writable directory with free space (a read-only or "
                                  "full filesystem cannot hold snapshots either)"), key="run_dir") from None
    return target


def flat_values(cfg: RunConfig) -> dict[str, Any]:
    """Every leaf as ``{"train.lr": 0.1, ...}`` in JSON terms (lists and dicts are leaves): what a
    snapshot manifest records of the config that wrote it."""
    import json

    def walk(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if dataclasses.is_dataclass(value):
            for item in dataclasses.fields(value):
                yield from walk(getattr(value, item.name), f"{prefix}{item.name}.")
        else:
            yield prefix[:-1], value
    return json.loads(json.dumps(dict(walk(cfg, ""))))


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every key of two :func:`flat_values` that differs."""
    return [(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def describe_diff(diff: list[tuple[str, Any, Any]]) -> str:
    """``train.lr: 0.1 -> 0.01, train.max_steps: 100 -> 200``."""
    return ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diff)
