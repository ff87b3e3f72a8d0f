"""Own-loop functions for the bad-input tests of ``train.loop`` (fault injection: each misbehaves one way)."""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.tasks.faults import inject


def _tiny(run: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def ignores_stop(run: Any) -> None:
    """Goes on after run.boundary returned True (as if the loop had no `return` there). Rank 0 copies the ledger
    as it is when the first True comes back to ``seen_at_stop.jsonl``: the line is there before the program lets go."""
    model, optimizer = _tiny(run)
    step = run.resume(model=model, optimizer=optimizer)
    while step < 10_000:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if run.boundary(step) and run.is_main:
            ledger = run.run_dir / "attempts.jsonl"
            (run.run_dir / "seen_at_stop.jsonl").write_text(ledger.read_text() if ledger.exists() else "")
        time.sleep(0.05)


def no_argument() -> None:
    """train.loop must accept the run."""


class _Net(torch.nn.Module):
    """A small regression net with dropout (per-rank RNG) and no buffers, like nanoGPT's GPT with flash attention."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                        torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def nanogpt_shaped(run: Any) -> None:
    """nanoGPT train.py's shape, which our examples never had: every rank seeds its own data stream
    (``seed + rank``) and prefetches its next batch before the step, rank 0 alone evaluates the DDP model under
    no_grad before the first step, a per-rank counter, a per-rank module that is not wrapped in DDP, and the loss
    logged as a 0-d tensor. DONE.json gets every rank's counter and probe, so a test compares them too.
    ``HPC_DDP_TEST_FAULT`` (as for tests.tasks.Faulty: kill or stop RANK in STEP) injects a fault on the real cluster."""
    import hpc_ddp
    import torch.distributed as dist
    from torch.nn import functional as F

    cfg = run.config.train
    torch.manual_seed(cfg.seed)  # the same initial parameters on every rank
    model = torch.nn.parallel.DistributedDataParallel(_Net())
    if run.config.user.get("compile_ddp"):  # the wrong order, torch.compile(DDP(model)) (the eager backend: cheap)
        model = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    torch.manual_seed(cfg.seed + 1 + run.rank)  # nanoGPT's seed_offset: each rank draws its own batches
    fixed = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    probe = torch.nn.Linear(16, 1)  # each rank's own, never all-reduced

    def get_batch() -> dict[str, torch.Tensor]:
        x = torch.randn(cfg.batch_size, 16)
        return {"x": x, "y": x.sum(1, keepdim=True).sin()}

    batch, counters = get_batch(), {"seen": 0.0, "steps": 0}
    step = run.resume(model=model, optimizer=optimizer, batch=hpc_ddp.per_rank(batch),
                      counters=hpc_ddp.per_rank(counters), probe=hpc_ddp.per_rank(probe))
    while step < cfg.max_steps:
        inject(run.rank, step + 1, run)
        if step % 5 == 0 and run.is_main:  # nanoGPT: estimate_loss() on the master process only
            model.eval()
            with torch.no_grad():
                model(fixed)
            model.train()
        loss = F.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        batch.update(get_batch())  # prefetch the next batch from this rank's RNG, as nanoGPT does
        counters["seen"] += float(batch["x"].sum())
        counters["steps"] += 1
        with torch.no_grad():
            probe.weight.add_(batch["x"].mean(0) * 0.01)
        step += 1
        run.log_metrics(step, loss=loss.detach())  # a 0-d tensor
        if run.boundary(step):
            return
    mine = (counters["seen"], counters["steps"], float(probe.weight.detach().sum()))
    every: list[Any] = [None] * run.world_size
    dist.all_gather_object(every, mine)
    run.finish(per_rank=every)


def derived_prefetch(run: Any) -> None:
    """A per-rank prefetched batch the loop rebuilds from (seed, rank, step), tracked with
    ``per_rank(batch, mirror="derive")`` (never sent to a buddy), beside a per-rank counter mirrored at every
    step. After a survivors' snapshot (which holds no batch) the loop sees a batch of another step and rebuilds it;
    after a periodic one the batch comes back as it was. DONE.json gets every rank's counter and batch sum."""
    import hpc_ddp
    import torch.distributed as dist
    from torch.nn import functional as F

    cfg = run.config.train
    torch.manual_seed(cfg.seed)
    model = torch.nn.parallel.DistributedDataParallel(_Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def make(step: int) -> dict[str, Any]:
        drawn = torch.Generator().manual_seed(((cfg.seed * 65_536 + run.rank) << 32) + step)
        x = torch.randn(cfg.batch_size, 16, generator=drawn)
        return {"x": x, "y": x.sum(1, keepdim=True).sin(), "step": step}

    batch, counters = make(0), {"seen": 0.0}
    step = run.resume(model=model, optimizer=optimizer, batch=hpc_ddp.per_rank(batch, mirror="derive"),
                      counters=hpc_ddp.per_rank(counters))
    if batch["step"] != step:  # not in the snapshot (a survivors' one): rebuilt from what it holds
        batch.update(make(step))
    while step < cfg.max_steps:
        inject(run.rank, step + 1, run)
        loss = F.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        batch.update(make(step))  # the next step's, prefetched
        counters["seen"] += float(batch["x"].sum())
        run.log_metrics(step, loss=loss.detach())
        if run.boundary(step):
            return
    every: list[Any] = [None] * run.world_size
    dist.all_gather_object(every, (counters["seen"], float(batch["x"].sum())))
    run.finish(per_rank=every)


class _BatchNormNet(torch.nn.Module):
    """A regression net with BatchNorm (running statistics: buffers) and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                                        torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def batchnorm(run: Any) -> None:
    """A DDP model with BatchNorm and broadcast_buffers (DDP's default): each rank draws its own batches (the
    derived RNG differs by rank), so between two forwards every rank's running statistics differ, and the step's
    are rank 0's (DDP broadcasts them at the next forward). An evaluation of all ranks under no_grad every 10
    steps, its output logged; DONE.json's params_sha256 covers the buffers."""
    from torch.nn import functional as F

    cfg = run.config.train
    torch.manual_seed(cfg.seed)
    model = torch.nn.parallel.DistributedDataParallel(_BatchNormNet())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    fixed = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    step = run.resume(model=model, optimizer=optimizer)
    while step < cfg.max_steps:
        x = torch.randn(cfg.batch_size, 16) * (1 + run.rank)  # this rank's own data: its own statistics
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        values = {"loss": loss.detach()}
        if step % 10 == 0:
            model.eval()
            with torch.no_grad():
                values["eval"] = float(model(fixed).sum())
            model.train()
        run.log_metrics(step, **values)
        if run.boundary(step):
            return
    run.finish(running_mean=float(model.module.body[1].running_mean.sum()))


def replicated_differs(run: Any) -> None:
    """A DDP model with BatchNorm (its running stats differ by rank until DDP's next forward broadcasts rank
    0's: not a mismatch) and a dict of per-rank values tracked as if it were replicated (a mismatch)."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                                          torch.nn.BatchNorm1d(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = {"rank_loss": 0.0, "steps": 0}
    step = run.resume(model=model, optimizer=optimizer, stats=stats)
    torch.manual_seed(run.rank)
    while step < 20:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats["rank_loss"] = loss.item()
        stats["steps"] += 1
        step += 1
        if run.boundary(step):
            return


def wrong_loader(run: Any) -> None:
    """sampler.iterate() on a loader built with another sampler: a usage error (exit 2), not a crash."""
    import hpc_ddp
    from torch.utils.data import DataLoader

    model, optimizer = _tiny(run)
    sampler = hpc_ddp.ShardSampler(16, run.rank, run.world_size)
    run.resume(model=model, optimizer=optimizer, sampler=sampler)
    for _ in sampler.iterate(DataLoader(list(range(16)), batch_size=2)):
        pass


def never_calls_boundary(run: Any) -> None:
    """Trains 30 short steps and returns, never calling run.boundary: a stop signal cannot be acted on."""
    model, optimizer = _tiny(run)
    run.resume(model=model, optimizer=optimizer)
    for _ in range(30):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.05)


def _four_steps(run: Any, model: Any, optimizer: Any, step: int, batches: Any) -> None:
    """Train on ``batches`` to a stop or step 4: what the mistakes' loops share (the mistakes are in what they built;
    an iterator, not the loader, so that the loop's own variable is the one named)."""
    for batch in batches:
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if run.boundary(step) or step == 4:
            return


def distributed_sampler(run: Any) -> None:
    """The DDP tutorial's DistributedSampler and DataLoader, kept (run.resume refuses the sampler): a few steps."""
    from torch.utils.data import DataLoader, DistributedSampler

    model, optimizer = _tiny(run)
    sampler = DistributedSampler(list(range(64)), num_replicas=run.world_size, rank=run.rank)
    loader = DataLoader(torch.ones(64, 4), batch_size=2, sampler=sampler)
    step = run.resume(model=model, optimizer=optimizer)
    _four_steps(run, model, optimizer, step, iter(loader))


def shuffled_loader(run: Any) -> None:
    """A plain DataLoader(shuffle=True) and no sampler: every rank reads the whole dataset, no position kept."""
    from torch.utils.data import DataLoader

    model, optimizer = _tiny(run)
    train_loader = DataLoader(torch.ones(64, 4), batch_size=2, shuffle=True)
    evaluation = DataLoader(torch.ones(8, 4), batch_size=2)  # not shuffled: not named
    assert len(evaluation) == 4
    step = run.resume(model=model, optimizer=optimizer)
    _four_steps(run, model, optimizer, step, iter(train_loader))


def sampler_outside_iterate(run: Any) -> None:
    """A tracked ShardSampler whose loader is iterated directly (`for batch in loader`), not through iterate()."""
    import hpc_ddp
    from torch.utils.data import DataLoader

    model, optimizer = _tiny(run)
    sampler = hpc_ddp.ShardSampler(64, run.rank, run.world_size)
    loader = DataLoader(torch.ones(64, 4), batch_size=2, sampler=sampler)
    step = run.resume(model=model, optimizer=optimizer, sampler=sampler)
    _four_steps(run, model, optimizer, step, iter(loader))


def one_epoch(run: Any) -> None:
    """A newcomer's loop over one epoch of sampler.iterate (no `while step < max_steps` around it): it returns at
    the epoch's end, short of train.max_steps."""
    import hpc_ddp
    from torch.utils.data import DataLoader

    model, optimizer = _tiny(run)
    sampler = hpc_ddp.ShardSampler(8, run.rank, run.world_size)
    loader = DataLoader(torch.ones(8, 4), batch_size=2, sampler=sampler)
    step = run.resume(model=model, optimizer=optimizer, sampler=sampler)
    for batch in sampler.iterate(loader):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if run.boundary(step):
            return


def inits_twice(run: Any) -> None:
    """Starts the process group itself, as the tutorial it came from did."""
    import torch.distributed as dist

    dist.init_process_group("gloo")


def positional_resume(run: Any) -> None:
    """Hands run.resume its objects without names."""
    model, optimizer = _tiny(run)
    run.resume(model, optimizer)


def rank0_only_all_reduce(run: Any) -> None:
    """A newcomer's evaluation on rank 0 alone with a collective in it (an all_reduce of its counts) at step 3.

    No DDP and no snapshot here, so nothing else of the program's is on the training group: if our stop
    agreement shared that group, rank 0's all_reduce would be matched with the other ranks' agreement (same
    size: three int32), and rank 1 would read rank 0's counts as "stop". On a group of its own, the user's
    all_reduce waits for partners that never come: a hang in the user's collective, which the watchdog names.
    """
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)  # the same on every rank, no gradient all_reduce
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = run.resume(model=model, optimizer=optimizer)
    while step < 10:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == 3 and dist.get_rank() == 0:
            counts = torch.tensor([7, 9, 1], dtype=torch.int32)  # correct, total, batches of an evaluation
            dist.all_reduce(counts)  # the mistake: a collective only rank 0 takes
        if run.boundary(step):
            return
        time.sleep(0.05)


LOADER_VAR = "HPC_DDP_TEST_LOADER"  # "CONTEXT" or "CONTEXT:shield": the loader of loader_workers (fork, spawn, ...)


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Samples that are a pure function of their index (picklable for spawn and forkserver workers); each takes
    a few milliseconds, so a step waits on its loader workers as a real pipeline does."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.002)
        x = torch.sin(torch.arange(16, dtype=torch.float32) * (index % 97 + 1) / 97)
        return x, x.sum(dim=0, keepdim=True).cos()


def loader_workers(run: Any) -> None:
    """A newcomer's own loop (issue 43): BatchNorm, dropout, AdamW, a cosine schedule and a DataLoader with two
    workers in the context ``HPC_DDP_TEST_LOADER`` names (PyTorch's default fork unless it says otherwise),
    shielded with hpc_ddp.worker_init() only when it says ``:shield``. 0.05 s a step."""
    import os

    import hpc_ddp

    cfg = run.config.train
    context, _, shield = os.environ.get(LOADER_VAR, "fork").partition(":")
    torch.manual_seed(cfg.seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(),
                              torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    max_steps = cfg.max_steps or 100
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_steps)
    sampler = hpc_ddp.ShardSampler(4096, run.rank, run.world_size, seed=cfg.seed, global_batch=run.batch.global_batch)
    loader = torch.utils.data.DataLoader(Windows(), batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                                         num_workers=2, multiprocessing_context=None if context == "fork" else context,
                                         worker_init_fn=hpc_ddp.worker_init() if shield == "shield" else None)
    step = run.resume(model=model, optimizer=optimizer, scheduler=schedule, sampler=sampler)

    def batches() -> Any:
        while True:
            yield from sampler.iterate(loader)

    stream = batches()
    while step < max_steps:
        inputs, targets = next(stream)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        step += 1
        run.log_metrics(step, loss=loss.item())
        time.sleep(0.05)
        if run.boundary(step):
            return


def reads_user_section(run: Any) -> None:
    """Records what run.config.user holds, read by attribute and as a mapping, nested too, to
    RUN_DIR/user-RANK.json; trains two steps so the run finishes as any loop does."""
    import json

    user = run.config.user
    seen = {"attr": user.eval_every, "item": user["eval_every"], "nested": user.data.name,
            "mapping": dict(user), "get": user.get("absent", "default")}
    (run.run_dir / f"user-{run.rank}.json").write_text(json.dumps(seen))
    model, optimizer = _tiny(run)
    step = run.resume(model=model, optimizer=optimizer)
    while step < 2:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if run.boundary(step):
            return


def rank0_only_eval_with_ddp(run: Any) -> None:
    """A newcomer's evaluation on rank 0 alone at step 3 that all-reduces its counts, beside a DDP model: rank 0's
    all_reduce of 3 numbers meets the other rank's gradient all_reduce of 5. gloo aborts rank 0 on the size
    mismatch (``gloo::EnforceNotMet``, SIGABRT, no Python traceback); rank 1 fails with "Connection reset by
    peer". (A rank-0-only forward of a DDP model with buffers broadcasts them instead: with gloo that may
    hang rather than abort, which the watchdog names.)"""
    import torch.distributed as dist

    model, optimizer = _tiny(run)
    step = run.resume(model=model, optimizer=optimizer)
    while step < 10:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == 3 and run.is_main:
            dist.all_reduce(torch.tensor([7, 9, 1], dtype=torch.float32))  # the mistake: only rank 0 takes it
        if run.boundary(step):
            return
        time.sleep(0.05)


def cadenced_counter(run: Any) -> None:
    """A per-rank counter of the steps taken, tracked with ``per_rank(counters, mirror=100)``: packed and sent to
    its buddy about every 100 steps (the resume's boundary, then none in a 30-step run). After a survivors'
    snapshot every rank's count is of the step it was last packed; the batches come from (seed, rank, step), so
    the losses are those of a run never stopped. DONE.json gets every rank's count."""
    import hpc_ddp
    import torch.distributed as dist
    from torch.nn import functional as F

    cfg = run.config.train
    torch.manual_seed(cfg.seed)
    model = torch.nn.parallel.DistributedDataParallel(_Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    counters = {"steps": 0}
    step = run.resume(model=model, optimizer=optimizer, counters=hpc_ddp.per_rank(counters, mirror=100))
    while step < cfg.max_steps:
        inject(run.rank, step + 1, run)
        drawn = torch.Generator().manual_seed(((cfg.seed * 65_536 + run.rank) << 32) + step)
        x = torch.randn(cfg.batch_size, 16, generator=drawn)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        counters["steps"] += 1
        run.log_metrics(step, loss=loss.detach())
        if run.boundary(step):
            return
    every: list[Any] = [None] * run.world_size
    dist.all_gather_object(every, counters["steps"])
    run.finish(per_rank=every)


def slow_node(run: Any) -> None:
    """A straggler (issue 60): every rank sleeps 20 ms a step (waiting, not busy); the ranks of the node
    ``user.slow_node`` names (default 1), or of the host ``user.slow_host`` names, spin a CPU for 40 ms more each
    step from ``user.slow_from`` (default 20), and every rank waits for them at each all-reduce (15 ms stood out
    too little in a CI run: the whole machine busy, every rank waits for a CPU too). It logs the loss every 10
    steps."""
    model, optimizer = _tiny(run)
    user = run.config.user
    host = run.env.nodelist[run.node_rank] if run.node_rank < len(run.env.nodelist) else ""
    slow = host == user.slow_host if user.get("slow_host") else run.node_rank == int(user.get("slow_node", 1))
    step = run.resume(model=model, optimizer=optimizer)
    while step < run.config.train.max_steps:
        if slow and step >= int(user.get("slow_from", 20)):
            end = time.monotonic() + 0.04
            while time.monotonic() < end:
                pass
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        time.sleep(0.02)
        if step % 10 == 0:
            run.log_metrics(step, loss=0.0)
        if run.boundary(step):
            return
