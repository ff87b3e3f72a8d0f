"""The DDP training loop of a Task: sharded data, accumulation, AMP, clipping, metrics.

Shape after pytorch/examples' ``multigpu_torchrun.py`` (``_run_step``, the epoch loop), with what it
lacks for resumable jobs: the sampler position is part of the state (``epoch`` and
``sample_in_epoch``, a global position, so the run can resume on another world size with the same
global batch and data order). The stop protocol, snapshots and the DONE marker are not here: the
Trainer is a user of the public :class:`~hpc_ddp.rank.loop.run.Run`, like anyone's own loop
(``run.resume``, ``run.boundary``, ``run.finish``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from hpc_ddp.core.batching import batch_change_problem
from hpc_ddp.core.config import RunConfig
from hpc_ddp.rank.group.distributed import all_mean
from hpc_ddp.core.errors import ConfigError, explain
from hpc_ddp.rank.stop.shield import worker_init
from hpc_ddp.rank.loop.compiling import compiled
from hpc_ddp.rank.loop.run import Run
from hpc_ddp.rank.loop.sampler import ShardSampler, old_position
from hpc_ddp.rank.loop.task import Task, build_dataset

log = logging.getLogger("hpc_ddp.trainer")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def to_device(batch: object, device: torch.device) -> Any:
    """Move every tensor of a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class Trainer:
    """One rank's training loop; build it inside an initialised process group."""

    def __init__(self, task: Task, cfg: RunConfig, run: Run) -> None:
        self.task, self.cfg, self.run = task, cfg, run
        self.env, self.device, self.run_dir = run.env, run.device, run.run_dir
        env, device = self.env, self.device
        train = cfg.train
        torch.manual_seed(train.seed)  # the same initial parameters on every rank
        model = task.build_model(cfg)
        if train.sync_batchnorm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = model.to(device)
        # compile the module, then wrap it: DDP(torch.compile(model)) compiles; the other order does
        # not (compiling.py)
        self.ddp = DistributedDataParallel(compiled(self.model, train.compile),
                                           device_ids=[device.index] if device.type == "cuda"
                                           else None,
                                           find_unused_parameters=train.find_unused_parameters)
        self.optimizer = task.build_optimizer(self.model, cfg)
        build_scheduler = getattr(task, "build_scheduler", None)
        self.scheduler = build_scheduler(self.optimizer, cfg) if callable(build_scheduler) else None
        self.scaler = torch.amp.GradScaler(device.type, enabled=train.amp == "fp16")
        dataset = build_dataset(task, cfg)  # map-style, or a TaskError naming it
        # this world size's share of the global batch (a ConfigError if it cannot split it)
        self.plan = run.batch
        self.grad_accum, self.global_batch = self.plan.grad_accum, self.plan.global_batch
        if len(dataset) < self.global_batch:
            raise ConfigError(explain(
                f"one optimizer step needs {self.global_batch} samples ({self.plan}), but the "
                "dataset has "
                f"{len(dataset)}", hint="lower train.batch_size, train.grad_accum or "
                                        "train.global_batch_size, "
                "or use fewer ranks"), key="train.batch_size")
        self.sampler = ShardSampler(len(dataset), env.rank, env.world_size, seed=train.seed,
                                    global_batch=self.global_batch)
        # Workers come from a forkserver, never a fork of this process: forking a process whose
        # process group threads hold a lock can hang the child in os.fork() (seen here once in ~60
        # starts). (open_run has the server import torch once, so each epoch's new workers start
        # without importing it.)
        self.loader = DataLoader(dataset, batch_size=train.batch_size, sampler=self.sampler,
                                 num_workers=train.num_workers, pin_memory=device.type == "cuda",
                                 drop_last=True,
                                 # one start per attempt, not per epoch
                                 persistent_workers=train.num_workers > 0,
                                 multiprocessing_context="forkserver" if train.num_workers
                                 else None,
                                 # a stop spares them
                                 worker_init_fn=worker_init() if train.num_workers else None,
                                 generator=torch.Generator().manual_seed(train.seed * 100003
                                                                         + env.rank))
        self.steps_per_epoch = self.sampler.usable // self.global_batch
        self.step = 0
        # The data position is global (samples of the epoch taken by all ranks): any world size can
        # resume it
        self.progress = {"epoch": 0, "sample_in_epoch": 0, "global_batch": self.global_batch}
        self._last_log = (time.monotonic(), 0)

    @property
    def epoch(self) -> int:
        return int(self.progress["epoch"])

    def done(self) -> bool:
        max_steps, epochs = self.cfg.train.max_steps, self.cfg.train.epochs
        return (max_steps is not None and self.step >= max_steps) or (epochs is not None
                                                                      and self.epoch >= epochs)

    def train(self) -> dict[str, Any]:
        """Train until max_steps or epochs, or until every rank agreed to stop.

        Returns ``{"stopped": True, ...}`` when the run stopped (the snapshot of that step
        is committed), else the finished result (DONE.json written by rank 0).
        """
        run = self.run
        self.step = first_step = run.resume(model=self.ddp, optimizer=self.optimizer,
                                            scheduler=self.scheduler,
                                            scaler=self.scaler, progress=self.progress)
        self._check_position()
        # samples/s counts this attempt's steps only
        self._last_log = (time.monotonic(), first_step)
        while not self.done():
            micro_batches = self._epoch_batches()
            while True:
                run.beat(self.step + 1, "data")
                loss = self._run_step(micro_batches)
                self.step += 1
                self.progress["sample_in_epoch"] += self.global_batch
                epoch_end = (self.progress["sample_in_epoch"] + self.global_batch
                             > self.sampler.usable)
                if epoch_end:
                    self.progress.update(epoch=self.epoch + 1, sample_in_epoch=0)
                self._maybe_log(loss)
                if run.boundary(self.step):
                    return {"stopped": True, "first_step": first_step, "step": self.step,
                            "resumed_from": run.resumed_from}
                if epoch_end or self.done():
                    break
        return {**run.finish(epoch=self.epoch), "stopped": False, "first_step": first_step,
                "resumed_from": run.resumed_from}

    def _check_position(self) -> None:
        """A resumed position this world size can continue: global, and at the batch it was written
        with.

        Without ``train.global_batch_size`` the batch follows the world size, so a resume on another
        one would change it: refused with the setting that keeps it.
        """
        progress, run = self.progress, self.run
        if "sample_in_epoch" not in progress:
            raise old_position(progress)
        saved = int(progress.get("global_batch", self.global_batch))
        problem = batch_change_problem(run.resumed_world_size or self.env.world_size, saved,
                                       self.cfg.train,
                                       self.env.world_size)
        if problem:
            raise ConfigError(problem, key="train.global_batch_size")
        progress["global_batch"] = self.global_batch

    def _epoch_batches(self) -> Iterator[Any]:
        """This rank's remaining micro-batches of the current epoch, from the saved (global)
        position."""
        position = int(self.progress["sample_in_epoch"])
        self.sampler.resume(self.epoch, position)
        # DataLoader workers draw their seeds from this generator: same seeds after a resume
        self.loader.generator.manual_seed(self.cfg.train.seed * 100003 + self.env.rank * 1009
                                          + self.epoch)
        left = (self.sampler.usable - position) // self.global_batch * self.grad_accum
        return iter(itertools.islice(self.loader, left))

    def _autocast(self) -> torch.autocast:
        """bf16/fp16 autocast per train.amp (a disabled context when amp is off)."""
        amp = self.cfg.train.amp
        return torch.autocast(self.device.type, dtype=AMP_DTYPES.get(amp, torch.bfloat16),
                              enabled=amp != "off")

    def _run_step(self, micro_batches: Iterator[Any]) -> torch.Tensor:
        train = self.cfg.train
        total = torch.zeros((), device=self.device)
        for i in range(self.grad_accum):
            batch = to_device(next(micro_batches), self.device)
            last = i == self.grad_accum - 1
            # all-reduce once per step
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                self.run.beat(self.step + 1, "forward")
                with self._autocast():
                    loss = self.task.loss(self.ddp, batch)
                self.run.beat(self.step + 1, "backward")
                self.scaler.scale(loss / self.grad_accum).backward()
            total += loss.detach().float()
        self.run.beat(self.step + 1, "optimizer")
        if train.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return total / self.grad_accum

    def _maybe_log(self, loss: torch.Tensor) -> None:
        last = self.done()
        if self.step % self.cfg.train.log_every and not last:
            return
        mean_loss = all_mean(float(loss.item()), self.device)  # every rank takes part
        now, (then, then_step) = time.monotonic(), self._last_log
        rate = (self.step - then_step) * self.global_batch / max(now - then, 1e-9)
        self._last_log = (now, self.step)
        if not self.env.is_main:
            return
        lr = self.optimizer.param_groups[0]["lr"]
        self.run.log_metrics(self.step, epoch=self.epoch, loss=mean_loss, lr=lr,
                             samples_per_s=round(rate, 2))
        total = self.cfg.train.max_steps or self.steps_per_epoch * (self.cfg.train.epochs or 1)
        log.info("step %d/%d loss %.6g lr %.3g %.1f samples/s", self.step, total, mean_loss, lr,
                 rate)
