"""The DDP training loop: sharded data, accumulation, AMP, clipping, metrics, DONE marker.

Shape after pytorch/examples' ``multigpu_torchrun.py`` (``_run_step``, the
epoch loop), with what it lacks for resumable jobs: the sampler position is
part of the state (``epoch``, ``consumed``), steps end on a boundary that every
rank agrees on, and the results are written atomically by rank 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from hpc_ddp.atomic import write_atomic
from hpc_ddp.checkpointer import Checkpointer, capture_rng, reseed, restore_rng
from hpc_ddp.config import RunConfig, config_diff, describe_diff, flat_values
from hpc_ddp.distributed import all_mean
from hpc_ddp.preemption import StopFlag
from hpc_ddp.errors import ConfigError, explain
from hpc_ddp.sampler import ShardSampler
from hpc_ddp.slurm_env import DistEnv
from hpc_ddp.task import Task

log = logging.getLogger("hpc_ddp.trainer")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the state_dict: names in sorted order, each tensor's raw bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        # raw bytes in one copy (bytes(storage) walks element by element: 2 s for a small GPT)
        digest.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))
    return digest.hexdigest()


def base_lr(group: dict[str, Any]) -> float:
    """A param group's base learning rate: before any scheduler's factor (``initial_lr``) when it has one."""
    return float(group.get("initial_lr", group["lr"]))


def to_device(batch: Any, device: torch.device) -> Any:
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

    def __init__(self, task: Task, cfg: RunConfig, env: DistEnv, device: torch.device, run_dir: Path, *,
                 checkpointer: Checkpointer | None = None, stop: StopFlag | None = None,
                 on_step: Callable[[int], None] | None = None,
                 beat: Callable[[int, str], None] | None = None) -> None:
        self.task, self.cfg, self.env, self.device, self.run_dir = task, cfg, env, device, run_dir
        self.checkpointer, self.stop, self.on_step = checkpointer, stop, on_step
        self.beat = beat or (lambda step, phase: None)  # the hang watchdog's heartbeat (see watchdog.py)
        train = cfg.train
        torch.manual_seed(train.seed)  # the same initial parameters on every rank
        model = task.build_model(cfg)
        if train.sync_batchnorm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = model.to(device)
        self.ddp = DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                                           find_unused_parameters=train.find_unused_parameters)
        self.optimizer = task.build_optimizer(self.model, cfg)
        build_scheduler = getattr(task, "build_scheduler", None)
        self.scheduler = build_scheduler(self.optimizer, cfg) if callable(build_scheduler) else None
        self.scaler = torch.amp.GradScaler(device.type, enabled=train.amp == "fp16")
        dataset = task.build_dataset(cfg)
        self.sampler = ShardSampler(len(dataset), env.rank, env.world_size, seed=train.seed)
        # Workers come from a forkserver, never a fork of this process: forking a process whose
        # process group threads hold a lock can hang the child in os.fork() (seen here once in ~60 starts).
        self.loader = DataLoader(dataset, batch_size=train.batch_size, sampler=self.sampler,
                                 num_workers=train.num_workers, pin_memory=device.type == "cuda", drop_last=True,
                                 multiprocessing_context="forkserver" if train.num_workers else None,
                                 generator=torch.Generator().manual_seed(train.seed * 100003 + env.rank))
        self.samples_per_step = train.batch_size * train.grad_accum
        self.steps_per_epoch = self.sampler.per_rank // self.samples_per_step
        if self.steps_per_epoch == 0:
            raise ConfigError(explain(
                f"one optimizer step needs {self.samples_per_step} samples per rank, but each of the "
                f"{env.world_size} ranks gets {self.sampler.per_rank} of the {len(dataset)} samples",
                hint="lower train.batch_size or train.grad_accum, or use fewer ranks"), key="train.batch_size")
        self.step = self.epoch = self.consumed = 0  # consumed: samples of this rank's shard used this epoch
        self._agreeing: tuple[torch.Tensor, Any] | None = None  # the stop-flag all_reduce in flight
        self.resumed_from: int | None = None
        self._last_log = (time.monotonic(), 0)

    def done(self) -> bool:
        max_steps, epochs = self.cfg.train.max_steps, self.cfg.train.epochs
        return (max_steps is not None and self.step >= max_steps) or (epochs is not None and self.epoch >= epochs)

    def train(self) -> dict[str, Any]:
        """Train until max_steps or epochs, or until a stop signal; rank 0 writes metrics and results.

        Returns ``{"stopped": True, ...}`` when every rank agreed to stop (the
        snapshot of that step is committed), else the finished result.
        """
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._restore()
        self._settle_buckets()
        first_step = self.step
        if self.on_step is not None:
            self.on_step(self.step)  # "started": the local rehearsal can inject a signal before the first step
        while not self.done():
            micro_batches = self._epoch_batches()
            while True:
                self.beat(self.step + 1, "data")
                loss = self._run_step(micro_batches)
                self.step += 1
                self.consumed += self.samples_per_step
                epoch_end = self.consumed // self.samples_per_step >= self.steps_per_epoch
                if epoch_end:
                    self.epoch, self.consumed = self.epoch + 1, 0
                self._maybe_log(loss)
                if self.on_step is not None:
                    self.on_step(self.step)
                self.beat(self.step, "boundary")
                if self._boundary():
                    return {"stopped": True, "first_step": first_step, "step": self.step,
                            "resumed_from": self.resumed_from}
                if epoch_end or self.done():
                    break
        self.beat(self.step, "finish")
        self._agreed()  # the last agreement in flight: collectives stay in the same order on every rank
        if self.checkpointer is not None:
            self.checkpointer.finish_async()  # never leave a background write behind
        return {**self._finish(), "stopped": False, "first_step": first_step, "resumed_from": self.resumed_from}

    def _epoch_batches(self) -> Iterator[Any]:
        """This rank's remaining micro-batches of the current epoch, from the saved position."""
        self.sampler.resume(self.epoch, self.consumed)
        # DataLoader workers draw their seeds from this generator: same seeds after a resume
        self.loader.generator.manual_seed(self.cfg.train.seed * 100003 + self.env.rank * 1009 + self.epoch)
        left = (self.steps_per_epoch - self.consumed // self.samples_per_step) * self.cfg.train.grad_accum
        return iter(itertools.islice(self.loader, left))

    def _settle_buckets(self) -> None:
        """One forward/backward that trains nothing, so DDP rebuilds its gradient buckets now.

        DDP reorders its buckets after the first backward of a process. A resumed
        attempt would otherwise reduce its first step's gradients in the initial
        layout while the uninterrupted run used the rebuilt one: a different
        summation order, last-bit differences, no exact resume. Eval mode (no
        dropout, no BatchNorm statistics), RNG states restored, gradients dropped.
        """
        if self.env.world_size == 1:
            return
        rng = capture_rng()
        batch = to_device(next(iter(DataLoader(self.loader.dataset, batch_size=self.cfg.train.batch_size))),
                          self.device)
        self.ddp.eval()
        with self._autocast():
            loss = self.task.loss(self.ddp, batch)
        loss.backward()
        self.ddp.train()
        self.optimizer.zero_grad(set_to_none=True)
        restore_rng(rng)

    def state(self) -> dict[str, Any]:
        """The replicated training state a snapshot holds."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict(), "step": self.step, "epoch": self.epoch,
                "consumed": self.consumed}

    def _restore(self) -> None:
        restored = self.checkpointer.restore() if self.checkpointer is not None else None
        if restored is None:
            return
        state = restored.state
        self.model.load_state_dict(state["model"])  # copies into the live parameters
        built = [base_lr(group) for group in self.optimizer.param_groups]  # from this attempt's config
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._report_changes(restored, built)
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.consumed = state["step"], state["epoch"], state["consumed"]
        self.resumed_from = restored.step
        if restored.rng is not None:
            restore_rng(restored.rng)
        else:
            reseed(self.cfg.train.seed, self.step, self.env.rank)

    def _report_changes(self, restored: Any, built: list[float]) -> None:
        """Say which config keys differ from those that wrote the snapshot; apply a changed learning rate.

        The optimizer's state dict carries the learning rate it was built with, so loading it
        would silently undo ``--resume train.lr=...``. Where the optimizer this attempt built
        has another base rate than the snapshot's, every param group (and the scheduler's base)
        is rescaled to it: the schedule goes on from the snapshot's step at the new peak. An
        unchanged config builds the same rates, so an exact resume is untouched.
        """
        changed = config_diff(restored.config, flat_values(self.cfg)) if restored.config is not None else []
        changed = [c for c in changed if c[0] != "run_dir"]
        saved = [base_lr(group) for group in self.optimizer.param_groups]
        for i, (group, new, old) in enumerate(zip(self.optimizer.param_groups, built, saved)):
            if new != old and old:
                group["lr"] *= new / old
                if "initial_lr" in group:
                    group["initial_lr"] = new
                if self.scheduler is not None and i < len(getattr(self.scheduler, "base_lrs", [])):
                    self.scheduler.base_lrs[i] = new
        if changed and self.env.is_main:
            applied = (f"; the learning rate is now based on {built[0]:g} (the snapshot's optimizer had {saved[0]:g}), "
                       "the schedule continuing from this step" if built != saved else "")
            log.warning("resuming from the snapshot of step %d with a changed config: %s%s", restored.step,
                        describe_diff(changed), applied)

    def _boundary(self) -> bool:
        """Act on what all ranks agreed at the previous boundary; start agreeing on this one.

        The agreement (any rank stopping? a snapshot due by rank 0's clock? any writer busy?)
        is one small all_reduce that runs while the next step computes: waiting for it here
        cost 4.7% of a step (B2). So a stop takes effect one step after its signal, on every
        rank at the same step. Snapshots by step count need no agreement (every rank computes
        the same answer) and stay on their step.
        """
        ckpt = self.checkpointer
        if ckpt is None and self.stop is None:
            return False
        stop, due_time, busy = self._agreed()
        if not stop:
            flags = torch.tensor([int(self.stop is not None and self.stop.is_set),
                                  int(self.env.is_main and ckpt is not None and ckpt.due_by_time()),
                                  int(ckpt is not None and ckpt.busy)], dtype=torch.int32, device=self.device)
            self._agreeing = (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True))
        if ckpt is None:
            return stop
        due = due_time or ckpt.due_by_steps(self.step)
        if ckpt.pending is not None and (stop or not busy):
            ckpt.finish_async()  # every node's file is durable (or we wait for it on stop): commit
        self.beat(self.step, "snapshot")
        if stop:
            ckpt.save(self.step, self.state(), capture_rng())  # the stop snapshot is always synchronous
        elif due and self.cfg.snapshot.async_write and ckpt.pending is None:
            ckpt.save_async(self.step, self.state(), capture_rng())
        elif due and not self.cfg.snapshot.async_write:
            ckpt.save(self.step, self.state(), capture_rng())
        return stop

    def _agreed(self) -> tuple[bool, bool, bool]:
        """The result of the agreement started at the previous boundary (none yet: nothing agreed)."""
        if self._agreeing is None:
            return False, False, False
        flags, work = self._agreeing
        work.wait()
        self._agreeing = None
        stop, due, busy = (bool(v) for v in flags.tolist())
        return stop, due, busy

    def _autocast(self) -> torch.autocast:
        """bf16/fp16 autocast per train.amp (a disabled context when amp is off)."""
        amp = self.cfg.train.amp
        return torch.autocast(self.device.type, dtype=AMP_DTYPES.get(amp, torch.bfloat16), enabled=amp != "off")

    def _run_step(self, micro_batches: Any) -> torch.Tensor:
        train = self.cfg.train
        total = torch.zeros((), device=self.device)
        for i in range(train.grad_accum):
            batch = to_device(next(micro_batches), self.device)
            last = i == train.grad_accum - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():  # all-reduce once per step
                self.beat(self.step + 1, "forward")
                with self._autocast():
                    loss = self.task.loss(self.ddp, batch)
                self.beat(self.step + 1, "backward")
                self.scaler.scale(loss / train.grad_accum).backward()
            total += loss.detach().float()
        self.beat(self.step + 1, "optimizer")
        if train.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return total / train.grad_accum

    def _maybe_log(self, loss: torch.Tensor) -> None:
        last = self.done()
        if self.step % self.cfg.train.log_every and not last:
            return
        mean_loss = all_mean(float(loss.item()), self.device)  # every rank takes part
        now, (then, then_step) = time.monotonic(), self._last_log
        rate = (self.step - then_step) * self.samples_per_step * self.env.world_size / max(now - then, 1e-9)
        self._last_log = (now, self.step)
        if not self.env.is_main:
            return
        record = {"step": self.step, "epoch": self.epoch, "loss": mean_loss,
                  "lr": self.optimizer.param_groups[0]["lr"], "samples_per_s": round(rate, 2)}
        with open(self.run_dir / "metrics.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")
        total = self.cfg.train.max_steps or self.steps_per_epoch * (self.cfg.train.epochs or 1)
        log.info("step %d/%d loss %.6g lr %.3g %.1f samples/s", self.step, total, mean_loss, record["lr"], rate)

    def _finish(self) -> dict[str, Any]:
        result = {"step": self.step, "epoch": self.epoch, "world_size": self.env.world_size,
                  "params_sha256": params_sha256(self.model)}
        if self.env.is_main:
            buffer = io.BytesIO()
            torch.save(self.model.state_dict(), buffer)
            write_atomic(self.run_dir / "model.pt", buffer.getbuffer())
            write_atomic(self.run_dir / "DONE.json", json.dumps(result))  # last: the run is done
            log.info("done: step %d, params_sha256 %s", self.step, result["params_sha256"][:16])
        return result
