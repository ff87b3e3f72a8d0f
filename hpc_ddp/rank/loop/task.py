"""The user's side of a run: a Task builds the model, data and optimizer, and computes a loss.

Named in the config as ``train.task: "package.module:ClassName"`` and loaded in
each worker process, never on the login node (``preflight`` only checks that
the module can be found). One instance per process, built after the process
group exists; ``ClassName()`` is called without arguments and every method gets
the run config. This module imports torch only for type checking.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hpc_ddp.core.errors import HpcDdpError, explain

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from hpc_ddp.core.config import RunConfig

REQUIRED_METHODS = ("build_model", "build_dataset", "build_optimizer", "loss")


class TaskError(HpcDdpError):
    """``train.task`` cannot be imported or does not implement the Task protocol."""


@runtime_checkable
class Task(Protocol):
    """Implement these four methods; ``build_scheduler`` is optional.

    The same seed is set on every rank before ``build_model``, and DDP
    broadcasts rank 0's parameters anyway. ``build_dataset`` returns a map-style
    dataset (``__len__`` and ``__getitem__``); hpc_ddp shards it across ranks and
    batches it. ``loss`` gets the DDP-wrapped model and a batch already on the
    device, and returns a scalar tensor (the mean over the batch).
    """

    def build_model(self, cfg: RunConfig) -> torch.nn.Module: ...

    def build_dataset(self, cfg: RunConfig) -> Dataset[Any]: ...

    def build_optimizer(self, model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer: ...

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor: ...


def _fail(what: str, hint: str, found: object = None, key: str = "train.task") -> TaskError:
    return TaskError(explain(what, found=found, hint=hint), key=key)


def import_target(path: str, key: str = "train.task") -> Any:
    """Import ``package.module:Name`` and return the named object; errors name ``key`` and the
    fix."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        kind = "ClassName" if key == "train.task" else "function"
        raise _fail(f"{key} must name {'a class' if key == 'train.task' else 'a function'} as "
                    f"'package.module:{kind}'",
                    found=path, key=key,
                    hint="e.g. train.task=examples.mlp:MLPTask or "
                         "train.loop=examples.own_loop_gpt:train")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise _fail(f"cannot import module {module_name!r} of {key}: no module named "
                        f"{err.name!r}", key=key,
                        hint="run from the directory that holds the package, or pip install it "
                             "into the "
                        "job's environment; jobs start in the submit directory") from err
        raise _fail(f"importing {module_name!r} of {key} failed: {err}", key=key,
                    hint=f"install {err.name!r} in the job's environment") from err
    except Exception as err:
        raise _fail(f"importing {module_name!r} of {key} raised {type(err).__name__}: {err}",
                    key=key,
                    hint="see the traceback above; the module runs on import in every worker"
                    ) from err
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        near = difflib.get_close_matches(attr, names, n=1)
        raise _fail(f"module {module_name!r} has no {attr!r} ({key}={path})", key=key,
                    hint=f"did you mean {module_name}:{near[0]}?" if near
                    else f"it defines: {', '.join(names)}")
    return getattr(module, attr)


def load_task(path: str) -> Task:
    """Import ``package.module:Name``, instantiate it, and check it is a Task."""
    target = import_target(path)
    task = target() if isinstance(target, type) else target
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise _fail(f"{path} does not implement the Task protocol: missing {', '.join(missing)}",
                    hint="a task defines build_model, build_dataset, build_optimizer and loss "
                    "(see hpc_ddp.rank.loop.task.Task)")
    return task  # type: ignore[no-any-return]


def load_loop(path: str) -> Callable[[Any], Any]:
    """Import ``train.loop``'s function and check it can be called as ``function(run)``."""
    target = import_target(path, key="train.loop")
    hint = f"define it as `def {path.partition(':')[2]}(run): ...` (hpc_ddp passes the run object)"
    if not callable(target) or isinstance(target, type):
        raise _fail(f"train.loop={path} is a {type(target).__name__}, not a function",
                    key="train.loop", hint=hint)
    try:
        inspect.signature(target).bind(object())
    except TypeError as err:
        raise _fail(f"train.loop={path} cannot be called with the run as its one argument: {err}",
                    found=f"{path.partition(':')[2]}{inspect.signature(target)}", key="train.loop",
                    hint=hint) from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass
    return target  # type: ignore[no-any-return]


def build_dataset(task: Task, cfg: RunConfig) -> Dataset[Any]:
    """``task.build_dataset(cfg)``, checked to be map-style (``len()`` and ``[i]``): the Trainer
    shards and batches it itself. A tutorial's DataLoader returned as it was (the newcomer's
    mistake) used to end in "the dataset has 16" samples (its batches) with advice to lower the
    batch size, and an iterable in a TypeError counted as a failure and retried; both are a
    :class:`TaskError` naming ``build_dataset`` (exit 2, never retried)."""
    from torch.utils.data import DataLoader, IterableDataset

    dataset = task.build_dataset(cfg)
    name = f"{type(task).__name__}.build_dataset"
    if isinstance(dataset, DataLoader):
        raise _fail(f"{name} returned a DataLoader; the Trainer builds the loader itself (its "
                    "sampler shards the data over the ranks, its batch size is train.batch_size)",
                    found=f"DataLoader of {type(dataset.dataset).__name__}",
                    hint="return the loader's dataset (`return loader.dataset`, or the Dataset you "
                         "gave it) and set train.batch_size and train.num_workers in the config")
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__")
                                                    and hasattr(dataset, "__getitem__")):
        raise _fail(f"{name} returned a {type(dataset).__name__}, not a map-style dataset "
                    "(len() and [i]): the Trainer shards a dataset by index",
                    found=type(dataset).__name__,
                    hint="return a torch.utils.data.Dataset with __len__ and __getitem__ (e.g. "
                         "TensorDataset); for a stream, write your own loop (train.loop, "
                         "docs/own-loop.md)")
    return dataset
