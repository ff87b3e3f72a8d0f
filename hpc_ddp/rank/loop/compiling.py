"""torch.compile in a run: the order that compiles, the cache every attempt finds warm, and what it
cost.

**The order.** Compile the module, then wrap it: ``DistributedDataParallel(torch.compile(model))``
(what nanoGPT does, and what our Trainer does with ``train.compile``). Dynamo then traces the
model's forward inside DDP's and splits the graph at DDP's gradient buckets, so the all-reduce still
overlaps the backward. The other order, ``torch.compile(DDP(model))``, hands dynamo DDP's own
forward, which it refuses to trace (DDP's forward is on its skip list): torch 2.13 captured no graph
at all and the loop ran eager, silently. :func:`order_problem` finds that at the first boundary and
says what to write.

**The cache.** :func:`apply_cache_env` exports ``TORCHINDUCTOR_CACHE_DIR`` and friends for
``train.compile_cache`` (:mod:`hpc_ddp.rundir.compile_cache`) before torch._inductor reads them, and
seeds a node-local cache from the run's copy.

**The report.** :func:`compile_report` says what this process compiled, from dynamo's and inductor's
own counters: how many graphs, whether inductor's FX graph cache held them, and the seconds dynamo
counted compiling. Rank 0 logs it at the first boundary (:func:`at_first_boundary`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from hpc_ddp.core.compile_settings import compile_options
from hpc_ddp.rundir import compile_cache, node_local
from hpc_ddp.rundir.compile_cache import CACHE_DIR_VAR, CacheEnv
from hpc_ddp.rank.metrics import timeline

if TYPE_CHECKING:
    import torch

    from hpc_ddp.core.config import RunConfig
    from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.compile")
WRONG_ORDER = ("{name} is torch.compile(DistributedDataParallel(model)), and dynamo compiled "
               "nothing: it does not "
               "trace DDP's own forward, so every step ran eager; compile the module first and "
               "wrap the compiled "
               "one: `model = DistributedDataParallel(torch.compile(model), "
               "device_ids=run.device_ids)` "
               "(docs/compile.md)")
WRONG_ORDER_COMPILED = ("{name} is torch.compile(DistributedDataParallel(model)): dynamo skips "
                        "DDP's forward and "
                        "compiled only the module's forward under it, so every gradient leaves the "
                        "one compiled "
                        "backward at its end and the gradient all-reduce cannot overlap the "
                        "backward (DDP's "
                        "bucketed graphs need the other order); compile the module first and wrap "
                        "the compiled "
                        "one: `model = DistributedDataParallel(torch.compile(model), "
                        "device_ids=run.device_ids)` "
                        "(docs/compile.md)")
NOTHING_COMPILED = ("{name} holds a torch.compile'd module, but dynamo compiled nothing by the "
                    "first boundary: "
                    "the loop may call the module inside it (model.module or model._orig_mod) "
                    "rather than the "
                    "compiled one (docs/compile.md)")
FRAMES = 3  # the loop, and a helper or two it calls run.boundary from (as advice.py looks)
# dynamo's forward compile; AOT's lazy backward one
TIMED = ("_compile.compile_inner", "backward._backward_impl")
_state: dict[str, Any] = {"ended": None, "cache": None}


class FirstBoundary(Protocol):
    """What :func:`at_first_boundary` reads of the run (a :class:`hpc_ddp.rank.loop.run.Run`, which
    calls it): named here, so that compiling need not import the run API that imports it."""

    @property
    def tracked(self) -> Mapping[str, Any]: ...

    @property
    def is_main(self) -> bool: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def run_dir(self) -> Path: ...


def compiled(model: torch.nn.Module, setting: Any) -> torch.nn.Module:
    """``torch.compile(model, **options)`` for a ``train.compile`` setting; the model itself when it
    is off."""
    import torch

    options = compile_options(setting)
    if options is None:
        return model
    log.info("compiling the model with torch.compile(%s), then wrapping it in DDP",
             ", ".join(f"{k}={v!r}" for k, v in options.items()))
    return torch.compile(model, **options)


def apply_cache_env(cfg: RunConfig, env: DistEnv, environ: Mapping[str, str]) -> CacheEnv:
    """Export the cache variables (where unset) before torch._inductor reads them; a node's first
    rank seeds a node-local cache from the run's copy (before the rendezvous: no rank of its node
    compiles before that)."""
    found = compile_cache.cache_env(cfg.train.compile_cache, cfg.run_dir, environ)
    os.environ.update(found.exported)
    _state.update(cache=found, ended=None)
    if found.kept and env.is_main:
        log.info("compile cache: keeping your %s (train.compile_cache=%s would set %s)",
                 ", ".join(f"{k}={v}" for k, v in found.kept.items()), found.place,
                 ", ".join(f"{k}={found.wanted[k]}" for k in found.kept))
    if found.place == "node" and found.folder is not None and CACHE_DIR_VAR not in found.kept:
        # before inductor makes it (0755): private and this user's, or refused
        node_local.ensure(found.folder)
    if (found.place == "node" and env.local_rank == 0 and found.folder is not None
            and not found.kept):
        copied = compile_cache.seed(cfg.run_dir, found.folder)
        log.info("compile cache: %d entries copied from the run's copy into %s", copied,
                 found.folder)
    return found


def _counts() -> tuple[int, int, int] | None:
    """(graphs, cache hits, cache misses) from dynamo's counters; None before torch._dynamo was
    imported."""
    if "torch._dynamo.utils" not in sys.modules:
        return None
    counters = sys.modules["torch._dynamo.utils"].counters
    graphs = int(counters["stats"].get("unique_graphs", 0))
    fx = counters["inductor"]
    hits, misses = int(fx.get("fxgraph_cache_hit", 0)), int(fx.get("fxgraph_cache_miss", 0))
    # a graph inductor could not cache compiles every time
    misses += int(fx.get("fxgraph_cache_bypass", 0))
    # a backend without inductor (aot_eager): the AOTAutograd cache's counts
    if not hits and not misses:
        aot = counters["aot_autograd"]
        hits, misses = int(aot.get("autograd_cache_hit", 0)), int(aot.get("autograd_cache_miss", 0))
    return graphs, hits, misses


def compile_report() -> dict[str, Any] | None:
    """What this process compiled: ``{"ended", "seconds", "cache", "graphs", "hits", "misses"}``;
    None when nothing was compiled.

    ``ended``: the wall-clock time (time.time()) of the first boundary after a compile, i.e. when
    the first compiled step had finished (the time of this call if no boundary came yet).
    ``seconds``: dynamo's own count of seconds spent compiling (forward and backward graphs), None
    if torch counted none. ``cache``: ``"hit"`` (every graph from inductor's FX graph cache),
    ``"miss"`` (none) or ``"partial"``; counted, never timed. ``graphs``: dynamo's unique graphs (a
    DDP model gives one per gradient bucket).
    """
    counts = _counts()
    if counts is None or not any(counts):
        return None
    graphs, hits, misses = counts
    metrics = sys.modules["torch._dynamo.utils"].compilation_time_metrics
    seconds = sum(sum(metrics.get(name, ())) for name in TIMED)
    return {"ended": _state["ended"] or time.time(), "seconds": round(seconds, 3) if seconds
            else None,
            "cache": "hit" if hits and not misses else "partial" if hits else "miss",
            "graphs": graphs,
            "hits": hits, "misses": misses}


def _compiled_modules(obj: Any) -> list[Any]:
    """The torch.compile'd modules (OptimizedModule) in a tracked object, itself included."""
    modules = getattr(obj, "modules", None)
    if not callable(modules) or not hasattr(obj, "_modules"):
        return []
    return [m for m in modules() if "_orig_mod" in getattr(m, "_modules", {})]


def loop_modules(frame: FrameType | None) -> dict[str, Any]:
    """The modules the loop holds (``model``, ``self.model``) in the frames that called
    run.boundary, outside hpc_ddp: a loop may track its DDP model and call a compiled wrapper of it
    that it never tracked."""
    import torch

    found: dict[str, Any] = {}
    for _ in range(FRAMES):
        if frame is None:
            break
        if not str(frame.f_globals.get("__name__", "")).startswith("hpc_ddp."):
            where = frame.f_code.co_name
            for name, value in frame.f_locals.items():
                found.update({f"`{name}` in {where}()": value} if isinstance(value, torch.nn.Module)
                             else {})
                if name == "self" and hasattr(value, "__dict__"):
                    found.update({f"`self.{attr}` in {where}()": inner
                                  for attr, inner in vars(value).items()
                                  if isinstance(inner, torch.nn.Module)})
        frame = frame.f_back
    return found


def order_problem(tracked: Mapping[str, Any], graphs: int,
                  held: Mapping[str, Any] | None = None) -> list[str]:
    """A finding per tracked model (or module the loop holds) compiled in the wrong order, whatever
    dynamo made of it, or wrapped for compiling while dynamo compiled nothing; the wrong order
    first."""
    from torch.nn.parallel import DistributedDataParallel

    named = {f"run.resume({name}=...)": obj for name, obj in tracked.items()}
    seen = {id(obj) for obj in named.values()}
    # each object once
    named.update({name: obj for name, obj in (held or {}).items() if id(obj) not in seen})
    wrong, nothing = [], []
    for name, obj in named.items():
        wrapped = _compiled_modules(obj)
        if any(isinstance(m._orig_mod, DistributedDataParallel) for m in wrapped):
            wrong.append(name)
        elif wrapped and not graphs:
            nothing.append(name)
    # nothing compiled (a plain module under DDP), or the module's own forward alone (nanoGPT's GPT)
    if wrong:
        return [(WRONG_ORDER if not graphs
                 else WRONG_ORDER_COMPILED).format(name=" and ".join(wrong))]
    return [NOTHING_COMPILED.format(name=" and ".join(nothing))] if nothing else []


def at_first_boundary(run: FirstBoundary, frame: FrameType | None = None) -> list[str]:
    """At an attempt's first boundary: note when the first compiled step ended, log the cache's hit
    or miss (rank 0), publish a node-local cache's new entries (node 0's first rank), and the
    wrong-order findings."""
    report = compile_report()
    if report is None:
        return order_problem(run.tracked, 0, loop_modules(frame))
    _state["ended"] = report["ended"]
    timeline.mark("compiled", report["ended"], compile_cache=report["cache"],
                  compile_s=report["seconds"])
    cache: CacheEnv | None = _state["cache"]
    where = (cache.folder if cache is not None and cache.folder is not None
             else "torch's default place")
    if run.is_main:
        log.info("compile: cache %s (%d of %d FX graphs from the cache), %d graph(s), %s s "
                 "compiling; cache in %s",
                 report["cache"], report["hits"], report["hits"] + report["misses"],
                 report["graphs"],
                 report["seconds"], where)
    if cache is not None and cache.place == "node" and not cache.kept and cache.folder is not None \
            and run.node_rank == 0 and run.local_rank == 0 and report["misses"]:
        copied = compile_cache.publish(cache.folder, run.run_dir)
        log.info("compile cache: %d new entries published to the run's copy for the other nodes",
                 copied)
    return order_problem(run.tracked, report["graphs"], loop_modules(frame))
