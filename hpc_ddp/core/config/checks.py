"""Checks on a loaded config that the schema's types alone cannot express.

Every key against its own rule (:mod:`hpc_ddp.core.config.rules`: ranges, choices, formats,
element types), then the rules across keys: exactly one program, an end for the Trainer, liveness
below the hang watchdog, a container with both runtime and image, ... Each failure is a
:class:`ConfigError` naming the key, the value found, what is expected and how to set it. Pure: no
omegaconf, no torch.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.core.batching import check_geometry, node_counts
from hpc_ddp.core.compile_settings import compile_problem
from hpc_ddp.core.config.rules import LIVENESS_S, OPTIONAL, RULES
from hpc_ddp.core.config.schema import schema_default
from hpc_ddp.core.container import RUNTIMES
from hpc_ddp.core.errors import ConfigError, explain
from hpc_ddp.core.shell_safe import check_one_line


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


PROGRAMS = ("train.task", "train.loop", "train.script")


def _check_program(train: Any) -> None:
    """Exactly one of train.task, train.loop and train.script names what the job runs."""
    chosen = [key for key in PROGRAMS if getattr(train, key.split(".")[1])]
    if not chosen:
        raise _fail("train.task", "nothing to train: train.task, train.loop and train.script are "
                                  "all unset", "",
                    "exactly one of them", "set one: train.task=mypkg.tasks:MyTask (our Trainer), "
                    "train.loop=mypkg.train:main (your loop, called with the run), or "
                    "train.script=train.py (an unmodified torchrun-style script)")
    if len(chosen) > 1:
        raise _fail(chosen[1], f"{' and '.join(chosen)} are both set", ", ".join(
            f"{key}={getattr(train, key.split('.')[1])}" for key in chosen), "exactly one of them",
            "keep one; unset the other" + (" with " if len(chosen) == 2 else "s with ")
            + " or ".join(f"{key}=null" for key in chosen))
    for key in ("args", "resume_args"):
        if getattr(train, key) and not train.script:
            raise _fail(f"train.{key}", f"train.{key} is set but train.script is not",
                        getattr(train, key),
                        "arguments for train.script", "set train.script=path/to/train.py, or drop "
                                                      f"train.{key}")


def _fail(key: str, what: str, found: Any, expected: str, hint: str | None = None) -> ConfigError:
    return ConfigError(explain(what, found=found, expected=expected, hint=hint or _example(key)),
                       key=key)


def _example(key: str) -> str:
    """The generic HINT: a value the key takes (its default), where the user set it. Only saying
    "set it in the config file or on the command line" told a newcomer who had just set
    slurm.nodes=two on the command line nothing new."""
    default = schema_default(key)
    where = "where you set it, in the config file or on the command line"
    if isinstance(default, bool) or not isinstance(default, (int, float, str)) or default == "":
        return f"change {key} {where} ({key}=...)"
    shown = f"{default:g}" if isinstance(default, float) else default
    return f"for example {key}={shown} (its default): change it {where}"


def _check_liveness(dist: Any) -> None:
    """A frozen node must be found by liveness before the hang watchdog (dist.timeout_s) fires on
    the ranks that wait for it: otherwise the attempt is recorded as hung and the frozen node is
    only a soft suspect."""
    live = dist.liveness_s
    if not live or live == LIVENESS_S or 2 * live <= dist.timeout_s:
        return
    raise _fail("dist.liveness_s", f"dist.liveness_s={live:g} is not well below "
                                   f"dist.timeout_s={dist.timeout_s}: "
                "the hang watchdog would fire first on the ranks waiting for a frozen node, and "
                "the attempt would "
                "be recorded as hung instead of naming the lost node", f"dist.liveness_s={live:g}",
                f"at most half of dist.timeout_s (<= {dist.timeout_s / 2:g})",
                f"lower it (dist.liveness_s={max(1, dist.timeout_s // 4)}), raise dist.timeout_s, "
                "or turn liveness "
                "off with dist.liveness_s=0")


# apptainer/singularity exec options that pass no host variable (issue 57)
CLEANENV = ("--cleanenv", "-e", "--containall", "-C")
CONTAIN = ("--contain", "-c")  # a private /dev/shm for every task


def _check_container(box: Any) -> None:
    """An image without a runtime, or a runtime without an image: either way the job would run
    somewhere else than the user meant (on the host, or nowhere), so neither is guessed."""
    if box.runtime and not box.image:
        raise _fail("slurm.container.image",
                    f"slurm.container.runtime={box.runtime} needs an image", box.image,
                    "the image every rank runs in", "set slurm.container.image=" + (
                        "nvcr.io#nvidia/pytorch:24.05-py3 (or a .sqsh file)"
                        if box.runtime == "pyxis" else
                        "/path/to/image.sif") + ", or slurm.container=null for no container")
    for key in ("args", "mounts"):
        given = list(getattr(box, key) or [])
        if given and not box.runtime:  # a script's own arguments put here by mistake
            raise _fail(f"slurm.container.{key}", f"slurm.container.{key} is set but no container "
                        "runtime runs the job: nothing would use it", given,
                        f"slurm.container.{key} with slurm.container.runtime and image",
                        "a train.script's own arguments go in train.args; to run in a container "
                        "set slurm.container.runtime and slurm.container.image; else drop "
                        f"slurm.container.{key}")
    cleaning = [a for a in box.args or [] if str(a).split("=")[0] in CLEANENV]
    if cleaning and box.runtime in ("apptainer", "singularity"):
        raise _fail("slurm.container.args", f"{box.runtime}'s {cleaning[0]} passes no host "
                    "variable into the container: no SLURM_*, so every task would be rank 0 of a "
                    "world of one, N trainings in one run dir", cleaning,
                    "exec options that keep the environment",
                    f"drop {cleaning[0]} from slurm.container.args; to keep a variable of yours "
                    "out, unset it in slurm.setup (e.g. ['unset PYTHONPATH'])")
    contained = [a for a in box.args or [] if str(a) in CONTAIN]
    if contained and box.runtime in ("apptainer", "singularity"):
        raise _fail("slurm.container.args", f"{box.runtime}'s {contained[0]} gives every task a "
                    "/dev/shm of its own: a node's ranks would not see each other's liveness "
                    "beats and node files", contained, "exec options that keep /dev/shm shared",
                    f"drop {contained[0]} from slurm.container.args")
    if box.image and not box.runtime:
        raise _fail("slurm.container.runtime", f"slurm.container.image={box.image} is set but no "
                                               "runtime runs it",
                    None, f"one of {', '.join(RUNTIMES)}", "set slurm.container.runtime=apptainer "
                    "(or pyxis, singularity: what your site offers), or drop slurm.container.image")


def _check_compile(train: Any) -> None:
    """train.compile: its shape, and only for our Trainer (a loop or a script calls torch.compile
    itself)."""
    problem = compile_problem(train.compile)
    if problem is not None:
        what, found, expected = problem
        raise _fail("train.compile", what, found, expected, "train.compile=true, or in a file: "
                    "compile: {mode: max-autotune} (docs/compile.md)")
    if train.compile not in (None, False) and not train.task:
        program = "train.loop" if train.loop else "train.script"
        raise _fail("train.compile", f"train.compile is set but {program} runs, not our Trainer "
                                     "(train.task)",
                    train.compile, "train.compile with train.task only",
                    f"drop train.compile; {program} compiles "
                    "its model itself: torch.compile(model) first, then "
                    "DistributedDataParallel(compiled) "
                    "(docs/compile.md)")


def check_config(cfg: Any) -> None:
    """Raise :class:`ConfigError` for the first value out of its range or format."""
    # first: a line break anywhere is named as what it is, whatever the key's own format
    check_one_line(cfg)
    sig = cfg.slurm.signal
    if isinstance(sig, str) and sig.upper().removeprefix("SIG") == "USR1":
        raise _fail("slurm.signal", "slurm.signal must not be USR1", sig,
                    "USR2 (the default) or another signal",
                    "NCCL uses SIGUSR1 internally; a USR1 warning would be swallowed. Use "
                    "slurm.signal=USR2")
    cfg.slurm.signal = sig.upper().removeprefix("SIG") if isinstance(sig, str) else sig
    for key, (ok, expected) in RULES.items():
        value = _get(cfg, key)
        if value is None and key in OPTIONAL:
            continue
        if value in (False, "False") and not ok(value) and ok("off"):  # YAML 1.1 read off as false
            value = "off"
            parent, _, leaf = key.rpartition(".")
            setattr(_get(cfg, parent) if parent else cfg, leaf, value)
        if not ok(value):
            yaml_bool = value in (True, False, "True", "False") and expected.startswith("one of")
            raise _fail(key, f"bad value for config key {key}", value, expected, hint=(
                f"YAML reads a bare true, false, yes, no or on as a boolean; give {key} one of its "
                "words" if yaml_bool else None))
    _check_program(cfg.train)
    _check_compile(cfg.train)
    if cfg.train.task and cfg.train.max_steps is None and cfg.train.epochs is None:
        raise _fail("train.max_steps", "the run has no end: train.max_steps and train.epochs are "
                                       "both null",
                    None, "at least one of them", "add train.max_steps=1000 or train.epochs=10")
    if cfg.slurm.signal_delay_s >= cfg.slurm.timeout_min * 60:
        raise _fail("slurm.signal_delay_s", f"slurm.signal_delay_s={cfg.slurm.signal_delay_s} "
                                            "leaves no time to "
                    f"train within slurm.timeout_min={cfg.slurm.timeout_min}",
                    cfg.slurm.signal_delay_s,
                    "fewer seconds than the time limit", "lower slurm.signal_delay_s or raise "
                                                         "slurm.timeout_min")
    _check_liveness(cfg.dist)
    _check_container(cfg.slurm.container)
    if cfg.train.global_batch_size is not None and cfg.train.grad_accum != 1:
        raise _fail("train.grad_accum", "train.grad_accum and train.global_batch_size are both set",
                    f"train.grad_accum={cfg.train.grad_accum}, "
                    f"train.global_batch_size={cfg.train.global_batch_size}",
                    "one of them", "with train.global_batch_size the accumulation follows the "
                    "world size: drop train.grad_accum")
    if cfg.slurm.spare_nodes and len(node_counts(cfg.slurm.nodes)) > 1:
        raise _fail("slurm.spare_nodes", "slurm.spare_nodes needs a fixed node count, but "
                                         "slurm.nodes is a range",
                    f"slurm.nodes={cfg.slurm.nodes}, slurm.spare_nodes={cfg.slurm.spare_nodes}",
                    "slurm.nodes=N with spares, or a range without them",
                    "with a range the run goes on with fewer nodes when one fails; spares keep the "
                    "world size (bit-exact): choose one, e.g. slurm.nodes=2 slurm.spare_nodes=1")
    check_geometry(cfg.train, cfg.slurm.nodes, cfg.slurm.tasks_per_node)
