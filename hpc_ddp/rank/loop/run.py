"""The public run object: what any training loop calls to survive preemption and time limits.

A loop gets a :class:`Run` (from ``train.loop``, ``hpc_ddp.session()`` or our Trainer) and
adds two calls::

    step = run.resume(model=model, optimizer=optimizer, sampler=sampler)   # 0 on a fresh start
    while step < max_steps:
        ...one optimizer step...
        step += 1
        if run.boundary(step):     # True once every rank agreed to stop; the snapshot is committed
            return

Everything else is the stop protocol, in this one place: the stop flag agreed by all ranks one
boundary after a signal (the all_reduce overlaps the next step), periodic snapshots by step count or
by rank 0's clock (sync, or async with the copy in the step), the stop snapshot, every rank's RNG
captured and restored, the hang watchdog's heartbeat, the final model and DONE marker. Its pieces
with a job of their own sit beside it: the resume's tracking and loading
(:mod:`~hpc_ddp.rank.loop.resuming`), what a failure would take, kept current
(:mod:`~hpc_ddp.rank.loop.holding`), how ranks agree (:mod:`~hpc_ddp.rank.loop.agreement`), what a
snapshot holds (:mod:`~hpc_ddp.rank.loop.step_state`), the end of a finished run
(:mod:`~hpc_ddp.rank.loop.finish`), a loop's wrong calls (:mod:`~hpc_ddp.rank.loop.misuse`). Who
writes which file is the checkpointer's business; what happens after the loop returns (ledger,
requeue, exit code) is the session's (:mod:`hpc_ddp.rank.attempt.session`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.core.batching import BatchPlan, plan
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.core.stopping import StopFlag
from hpc_ddp.rank.loop import agreement, holding, pace
from hpc_ddp.rank.loop.advice import Advice, unkept_samplers
from hpc_ddp.rank.loop.compiling import at_first_boundary
from hpc_ddp.rank.loop.finish import finish_run
from hpc_ddp.rank.loop.misuse import check_resume, check_step
from hpc_ddp.rank.loop.resuming import load_newest, track
from hpc_ddp.rank.loop.step_state import checked_state
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.rank.metrics.run_metrics import MetricsLog
from hpc_ddp.rank.salvage import jit, mirror
from hpc_ddp.rank.state.checkpointer import STEP, Checkpointer
from hpc_ddp.rank.state.ddp_settle import settle_buckets_on_first_forward
from hpc_ddp.rank.state.replication import params_sha256  # noqa: F401  (public: docs/reference.md)
from hpc_ddp.rank.state.rng import reseed
from hpc_ddp.rank.state.tracked import PerRank, state_of
from hpc_ddp.rank.stop.broken_step import stop_came_first
from hpc_ddp.rank.stop.child_deaths import ChildDeaths


class Run:
    """One rank's view of one attempt of a run; the session builds it inside the process group.

    Attributes a loop uses: ``rank``, ``local_rank``, ``world_size``, ``local_world_size``,
    ``node_rank``, ``is_main``, ``device``, ``device_ids`` (for DDP), ``run_dir``,
    ``restart_count``, ``config`` (the run's :class:`RunConfig`; your own settings are
    ``config.user``, a mapping that also reads by attribute), ``step`` (the last
    boundary's), ``resumed_from`` (the snapshot's step, or None), ``stopped``.
    """

    def __init__(self, cfg: RunConfig, env: DistEnv, device: torch.device, *,
                 checkpointer: Checkpointer | None,
                 stop: StopFlag | None, beat: Callable[[int, str], None] | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.config, self.env, self.device = cfg, env, device
        self.run_dir = Path(cfg.run_dir)
        self.checkpointer, self.stop, self.on_step = checkpointer, stop, on_step
        self._beat = beat or (lambda step, phase: None)
        # replicated: one copy in the snapshot, checked alike on every rank
        self.tracked: dict[str, Any] = {}
        self.per_rank: dict[str, PerRank] = {}  # saved and restored per rank, like the RNG
        # run.boundary calls in this attempt: a loop that makes none cannot honour a stop
        self.boundaries = 0
        self.per_rank_checked = False  # per_rank's unloadable objects refused once (step_state.py)
        self.step = 0
        self.resumed_from: int | None = None
        self.resume_read: dict[str, Any] | None = None  # rank 0: bytes the resume read
        self.resumed_world_size: int | None = None  # that of the snapshot resumed from
        self.stopped = False
        self.finished: dict[str, Any] | None = None
        self._resumed = False
        self._agreeing: tuple[Any, Any] | None = None  # the agreement in flight (one rank: flags)
        self._derived = cfg.train.rng == "derived"  # every boundary reseeds (rank/state/rng.py)
        self.metrics = MetricsLog(cfg, self.run_dir)  # rank 0's metrics.jsonl, TensorBoard, W&B
        # the state a just-in-time snapshot would take now (snapshot.jit)
        self.held: jit.Held | None = None
        # DDP modules whose buffers rank 0 sends (rank/loop/holding.py)
        self.broadcasts_buffers: list[DistributedDataParallel] = []
        # per_rank objects sent to a buddy at every boundary (rank/salvage/mirror.py)
        self.mirror: mirror.Mirror | None = None
        self.child_deaths = ChildDeaths(stop, stop_came_first)  # acted on at a boundary
        # the session's ledger line at the agreed stop
        self.on_stop: Callable[[int], None] | None = None
        # what makes a stop impossible or a resume inexact (rank/loop/advice.py)
        self.advice = Advice(env.is_main)
        slow = cfg.slurm.straggler  # a slow node named (rank/loop/pace.py)
        self.pace = pace.Pace(slow.ratio, slow.windows, slow.window_steps, slow.action != "off",
                              env, self.run_dir)

    rank = property(lambda self: self.env.rank)
    local_rank = property(lambda self: self.env.local_rank)
    world_size = property(lambda self: self.env.world_size)
    local_world_size = property(lambda self: self.env.local_world_size)
    node_rank = property(lambda self: self.env.node_rank)
    is_main = property(lambda self: self.env.is_main)
    restart_count = property(lambda self: self.env.restart_count)

    @property
    def batch(self) -> BatchPlan:
        """This world size's share of the global batch: ``batch_size`` per micro-step,
        ``grad_accum`` micro-steps.

        With ``train.global_batch_size`` set, ``grad_accum`` follows the world size, so a loop that
        accumulates ``run.batch.grad_accum`` micro-steps keeps the same global batch on any node
        count.
        """
        return plan(self.config.train, self.world_size)

    @property
    def device_ids(self) -> list[int] | None:
        """What DDP's ``device_ids`` wants: this rank's GPU, or None on CPU."""
        return [self.device.index] if self.device.type == "cuda" else None

    def beat(self, step: int, phase: str) -> None:
        """Tell the hang watchdog where this rank is (optional: every boundary is a beat)."""
        self._beat(step, phase)

    # -- resume
    # --------------------------------------------------------------------------------------
    def resume(self, *positional: object, **objects: object) -> int:
        """Track these objects and load them from the newest committed snapshot; return its step (0:
        fresh).

        Collective: call it on every rank, once, before the first step. Anything with
        ``state_dict()``/``load_state_dict()`` can be tracked, and a dict (restored in place). State
        that differs by rank goes in as ``name=hpc_ddp.per_rank(obj)``: it is saved and restored per
        rank. This rank's RNG states (Python, NumPy, torch, CUDA) are restored too. A DDP model's
        gradient buckets are settled before its first step (see
        :mod:`hpc_ddp.rank.state.ddp_settle`), so a resumed run sums gradients in
        the same order as one that never stopped.
        """
        check_resume(positional, self._resumed)
        track(self, objects)  # rank/loop/resuming.py
        self._resumed = True
        load_newest(self)
        self.beat(self.step, "start")  # a hang before the first step names the resumed step, not 0
        ddps = holding.open_holding(self)  # what a failure would take (rank/loop/holding.py)
        for ddp in ddps if self.world_size > 1 else []:
            settle_buckets_on_first_forward(ddp)
        if self.on_step is not None:
            # "started": the local rehearsal may inject a signal before the first step
            self.on_step(self.step)
        return self.step

    # -- boundary
    # ------------------------------------------------------------------------------------
    def boundary(self, step: int) -> bool:
        """Call after every optimizer step with the step count; True once every rank agreed to stop.

        Collective and cheap: it acts on the agreement started at the previous boundary
        (stop? a snapshot due by rank 0's clock? a writer busy?) and starts the next one,
        which runs while the next step computes. So a stop takes effect one step after its
        signal, at the same step on every rank. A due snapshot is written here (copied in
        the step and written in the background with ``snapshot.async_write``); the stop
        snapshot is always synchronous and committed when this returns True.
        """
        check_step(step, self.step, self._resumed, self.stopped)
        ckpt = self.checkpointer
        self.step = step
        self.boundaries += 1
        if self.held is not None:
            holding.mark(self, step)
        # a loader worker that died since the last boundary (rank/stop/child_deaths.py)
        self.child_deaths.at_boundary()
        # a DistributedSampler or a shuffling loader among the loop's variables: no position kept
        if self.boundaries == 1:
            self.advice.add(unkept_samplers(sys._getframe(1)))
            # compile: hit or miss, the order (compiling.py)
            self.advice.add(at_first_boundary(self, sys._getframe(1)))
            # after "compiled", which at_first_boundary marks where the loop compiled
            timeline.mark("first_step")
        if self.boundaries == 1 and self.world_size > 1 and (ckpt is not None
                                                             or self.held is not None):
            # what snapshots will hold is checked now, not at the first one (none may come before a
            # failure, and a survivors' snapshot would then be refused for it)
            doing = f"stopped at the first run.boundary of this attempt (step {step})"
            checked_state(self, step, doing)
        if self.on_step is not None:
            self.on_step(step)
        self.beat(step, "boundary")
        stop = False
        # else nothing to agree on or save (a bare run object)
        if ckpt is not None or self.stop is not None:
            stop, due_time, busy = self._agreed()
            if not stop:
                self._start_agreement(ckpt)
            if ckpt is not None:
                self._snapshot(ckpt, step, stop, due_time or ckpt.due_by_steps(step), busy)
        if self._derived:  # also without a checkpointer: every boundary, as the resume derives it
            # the next step's randomness, known to every rank
            reseed(self.config.train.seed, step, self.rank)
        self.stopped = stop
        if stop and self.mirror is not None:
            # every rank stops here: nothing in flight when the process group goes
            self.mirror.close()
        if stop and self.on_stop is not None:
            # before the program lets go: its teardown may outlast Slurm's KillWait
            self.on_stop(step)
        return stop

    def _snapshot(self, ckpt: Checkpointer, step: int, stop: bool, due: bool, busy: bool) -> None:
        if ckpt.pending is not None and (stop or not busy):
            ckpt.finish_async()  # every node's file is durable (or we wait for it on stop): commit
        self.beat(step, "snapshot")
        if stop or (due and (not self.config.snapshot.async_write or ckpt.pending is None)):
            state, rng = checked_state(self, step)
            if stop or not self.config.snapshot.async_write:
                ckpt.save(step, state, rng)  # the stop snapshot is always synchronous
            else:
                ckpt.save_async(step, state, rng)

    def _start_agreement(self, ckpt: Checkpointer | None) -> None:
        """Start agreeing on (stop? a snapshot due by rank 0's clock? a writer busy?); read at the
        next boundary (rank/loop/agreement.py)."""
        flags = [int(self.stop is not None and self.stop.is_set),
                 int(self.is_main and ckpt is not None and ckpt.due_by_time()),
                 int(ckpt is not None and ckpt.busy)]
        self._agreeing = agreement.start(flags + self.pace.figures(self.step), self.world_size)

    def _agreed(self) -> tuple[bool, bool, bool]:
        """The result of the agreement started at the previous boundary (none yet: nothing
        agreed)."""
        in_flight, self._agreeing = self._agreeing, None
        flags, paces = agreement.read(in_flight)
        if paces:  # and a stop to replace a slow node (rank/loop/pace.py)
            self.pace.heard(self.step, paces)
        return flags[0] or self.pace.agreed, flags[1], flags[2]

    def state(self) -> dict[str, Any]:
        """What a snapshot holds besides the RNG: every tracked object's state_dict, and the
        step."""
        state: dict[str, Any] = {name: state_of(obj) for name, obj in self.tracked.items()}
        state[STEP] = self.step
        return state

    # -- metrics and the end
    # ---------------------------------------------------------------------------
    def log_metrics(self, step: int, **values: object) -> None:
        """Log numbers for a step: call it on every rank or on rank 0 alone; only rank 0 writes
        anything.

        Rank 0 appends ``{"step": step, **values, "time": unix time}`` to the run's metrics.jsonl,
        and sends the numbers to TensorBoard and W&B where ``metrics.*`` switches them on. A value
        may be a number, a string, or a one-element tensor or NumPy scalar (logged as its number).

        Every call is written: ``train.log_every`` is the Trainer's interval, which a loop reads
        from ``run.config.train.log_every`` itself (an evaluation logged at another step is kept).
        The values are rank 0's: a loss is not averaged over ranks unless the loop all-reduces it
        first.

        The first call of an attempt opens those sinks: TensorBoard drops what an earlier attempt
        logged after this attempt's snapshot, and both get an ``attempt`` marker at its first step.
        """
        if self.is_main:  # with a slow node's figures when one was named (rank/loop/pace.py)
            self.metrics.log(step, {**values, **self.pace.metrics_due()}, self.resumed_from)

    def close_metrics(self) -> None:
        """Flush and close TensorBoard and W&B for this attempt (the session calls it on every exit
        path)."""
        self.metrics.close(self.stopped)

    def model(self) -> torch.nn.Module | None:
        """The tracked model (named ``model``, else the first module tracked)."""
        modules = {n: o for n, o in self.tracked.items() if isinstance(o, torch.nn.Module)}
        return modules.get("model", next(iter(modules.values()), None))

    def finish(self, **result: object) -> dict[str, Any]:
        """Collective: the run is complete (the session calls it when the loop returns without a
        stop).

        Drains the agreement and any async write; rank 0 writes model.pt. The DONE record (step,
        world size, params_sha256, and ``result``) is kept in ``finished``: the session writes
        DONE.json after the ledger's finished line."""
        if self.finished is not None:
            return self.finished
        self.beat(self.step, "finish")
        # the last agreement in flight: collectives stay in the same order on every rank
        self._agreed()
        self.finished = finish_run(self, result)
        return self.finished
