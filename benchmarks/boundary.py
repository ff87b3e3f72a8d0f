"""B15: what one ``run.boundary(step)`` costs a loop, alone, call by call (issue 47).

Each case is a real attempt: ``python -m hpc_ddp.worker`` per rank, as srun starts it (simulated Slurm
variables, no rehearsal hooks: the launcher's progress lines are off, as on a cluster), the worker's
session (process group, the control group, watchdog, liveness thread, checkpointer, stop flag). The
program is a ``train.loop`` of this module that times every ``run.boundary`` with ``perf_counter_ns``:

- ``gpt``: examples/own_loop_gpt.py's objects (DDP GPT, AdamW, ShardSampler over the text, DataLoader),
  tracked by ``run.resume(model=..., optimizer=..., sampler=...)``, ``snapshot.jit`` on and
  ``train.rng: derived`` (both defaults). Two real training steps first (AdamW's state exists), then
  thousands of boundaries with a trivial step between them: the learning rate set in every group and
  the step's micro-batches drawn through ``sampler.iterate`` (the sampler's position moves), no forward,
  backward or optimizer update;
- ``trainer``: hpc_ddp's Trainer on examples/mlp.py's task (model, AdamW, LambdaLR, GradScaler, data
  position tracked), each of its steps real (the MLP is tiny).

No snapshot is due in the timed calls (``snapshot.every_steps`` null; ``every_minutes`` 30 is asked at every
boundary and never due): a snapshot's write is B3's figure. At world size 2 every call also waits for the stop
agreement started at the previous boundary (a one-element gloo all_reduce with nothing to overlap here) and
starts the next: the time in ``_agreed`` and ``start_max`` is reported apart, so what our own Python costs
per call is visible beside it. Then ``PROFILED`` more boundaries run under cProfile on rank 0, in runs of
``CHUNK``; the run whose boundaries took least is kept (a stall of the shared machine inflates every average of
its run), and its top entries (by own time per boundary, the Timer's wrappers left out) are reported.

``python -m benchmarks.boundary OUT.json [--calls N] [--cases gpt:1,gpt:2,trainer:1,trainer:2]`` writes
every case's figures; ``benchmarks.run --only B15`` (or ``--only boundary``) calls :func:`b15`. On a machine
with CUDA the ``gpt`` and ``trainer`` cases also run on the GPU at world size 1 (NCCL); elsewhere their
rows say "not yet measured".
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_VAR = "HPC_DDP_B15_OUT"  # where rank 0 writes its figures (the worker passes the environment on)
SPEC_VAR = "HPC_DDP_B15_SPEC"  # "calls,warmup,profiled"
WARMUP, PROFILED = 50, 500
CHUNK = 100  # profiled calls per cProfile run; the calmest run is kept (one stall inflates its run's averages)
TOP = 12  # profile entries kept per case


# -- in the rank: the timed loops ------------------------------------------------------------------------
class Timer:
    """Wraps one run's boundary: every call's time, and the time spent in the stop agreement within it."""

    def __init__(self, run: Any) -> None:
        from hpc_ddp.rank.group import control, tiers

        calls, warmup, profiled = (int(x) for x in os.environ[SPEC_VAR].split(","))
        self.run, self.calls, self.warmup, self.profiled = run, calls, warmup, profiled
        self.total: list[int] = []
        self.agree: list[int] = []
        self._agree_ns = 0
        self.profiles: list[tuple[int, int, cProfile.Profile]] = []  # (ns its boundaries took, calls, profile)
        self._real = run.boundary
        run.boundary = self.boundary
        agreed = run._agreed
        run._agreed = lambda: self._timed(agreed)
        for owner in (control, tiers.Tiers):  # whichever carries the agreement (tiers: two levels)
            start = owner.start_max
            if owner is control:
                owner.start_max = lambda values, start=start: self._timed(start, values)
            else:
                owner.start_max = lambda me, values, start=start: self._timed(start, me, values)
        self.count = 0

    def _timed(self, function: Any, *args: Any) -> Any:
        begin = time.perf_counter_ns()
        try:
            return function(*args)
        finally:
            self._agree_ns += time.perf_counter_ns() - begin

    @property
    def needed(self) -> int:
        return self.warmup + self.calls + self.profiled

    def boundary(self, step: int) -> bool:
        index, self.count = self.count, self.count + 1
        profiling = self.warmup + self.calls <= index < self.needed and self.run.is_main
        self._agree_ns = 0
        if profiling and (index - self.warmup - self.calls) % CHUNK == 0:
            self.profiles.append((0, 0, cProfile.Profile()))
        if profiling:
            self.profiles[-1][2].enable()
        begin = time.perf_counter_ns()
        stop = self._real(step)
        took = time.perf_counter_ns() - begin
        if profiling:
            spent, count, profile = self.profiles[-1]
            profile.disable()
            self.profiles[-1] = (spent + took, count + 1, profile)
        elif self.warmup <= index < self.warmup + self.calls:
            self.total.append(took)
            self.agree.append(self._agree_ns)
        return stop

    def write(self) -> None:
        if not self.run.is_main:
            return
        import torch

        calmest = min(self.profiles, key=lambda run: run[0] / run[1], default=(0, 0, None))
        figures = {"total_ns": self.total, "agree_ns": self.agree, "world_size": self.run.world_size,
                   "device": str(self.run.device), "profile": top_entries(calmest[2], calmest[1]),
                   "gpu": torch.cuda.get_device_name() if self.run.device.type == "cuda" else None}
        Path(os.environ[OUT_VAR]).write_text(json.dumps(figures))


def top_entries(profile: cProfile.Profile | None, calls: int) -> list[dict[str, Any]]:
    """cProfile's entries with the most own time, per boundary (µs), with their cumulative time."""
    if profile is None or not calls:
        return []
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_, count, own, cumulative, _) in stats.items():
        if "/benchmarks/" in path:
            continue  # the Timer's own wrappers
        where = path.split("/hpc_ddp/", 1)[1] if "/hpc_ddp/" in path else Path(path).name if path != "~" else ""
        name = name.split(" at 0x", 1)[0] + (">" if " at 0x" in name else "")  # no addresses: rows compare across runs
        rows.append({"function": f"{where}:{line}({name})" if where else name, "calls": round(count / calls, 2),
                     "own_us": round(own / calls * 1e6, 2), "cumulative_us": round(cumulative / calls * 1e6, 2)})
    return sorted(rows, key=lambda r: -r["own_us"])[:TOP]


def gpt_loop(run: Any) -> None:
    """The GPT example's objects and its step's cheap part between timed boundaries (module docstring)."""
    import torch
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import hpc_ddp
    from examples.char_gpt import TEXT, CharWindows
    from examples.own_loop_gpt import GPT, lr_at

    cfg = run.config.train
    torch.manual_seed(cfg.seed)
    data = CharWindows(TEXT.read_text())
    model = DDP(GPT(len(data.vocab)).to(run.device), device_ids=run.device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sampler = hpc_ddp.ShardSampler(len(data), run.rank, run.world_size, seed=cfg.seed,
                                   global_batch=run.batch.global_batch)
    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    step = run.resume(model=model, optimizer=optimizer, sampler=sampler)
    timer = Timer(run)

    def batches():
        while True:
            yield from sampler.iterate(loader)

    micro = batches()
    for _ in range(2):  # real steps: AdamW's state exists, as in any step after the first
        for _ in range(run.batch.grad_accum):
            inputs, targets = (t.to(run.device) for t in next(micro))
            logits = model(inputs)
            F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        run.boundary(step)  # untimed: the Timer's warm-up counts from here
    while timer.count < timer.needed:
        lr = lr_at(step, 10**6, cfg.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(run.batch.grad_accum):
            next(micro)
        step += 1
        if timer.boundary(step):
            return
    timer.write()


def trainer_loop(run: Any) -> None:
    """hpc_ddp's Trainer on examples/mlp.py's task, its every boundary timed."""
    from examples.mlp import MLPTask
    from hpc_ddp.rank.loop.trainer import Trainer

    timer = Timer.__new__(Timer)  # made at the first boundary: run.resume comes inside train()
    real = run.boundary

    def first(step: int) -> bool:
        run.boundary = real
        Timer.__init__(timer, run)
        return timer.boundary(step)

    run.boundary = first
    Trainer(MLPTask(), run.config, run).train()
    timer.write()


# -- on the launcher: one case, one attempt ----------------------------------------------------------------
def measure(case: str, world: int, calls: int, cuda: bool = False, profiled: int = PROFILED) -> dict[str, Any]:
    """One case at one world size: its ranks started as srun would, rank 0's figures read back."""
    from hpc_ddp.core.config import load_config, save_config
    from hpc_ddp.core.slurm_env import simulated_environ
    from hpc_ddp.rehearsal.local import free_port

    (ROOT / "runs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="b15-", dir=ROOT / "runs", ignore_cleanup_errors=True) as tmp:
        run_dir, out = Path(tmp) / "run", Path(tmp) / "figures.json"
        steps = WARMUP + calls + profiled + 4
        base = ([ROOT / "examples" / "own_loop_gpt.yaml"], ["train.loop=benchmarks.boundary:gpt_loop"]) \
            if case == "gpt" else ([ROOT / "examples" / "mlp.yaml"], ["train.loop=benchmarks.boundary:trainer_loop",
                                                                    "train.task=null"])
        cfg = load_config(base[0], [*base[1], f"name=b15-{case}", f"run_dir={run_dir}", f"train.max_steps={steps}",
                                    "snapshot.every_steps=null", "train.log_every=1000000", "slurm.nodes=1",
                                    f"slurm.tasks_per_node={world}", f"dist.backend={'nccl' if cuda else 'gloo'}"])
        run_dir.mkdir(parents=True)
        save_config(cfg, run_dir / "config.yaml")
        port = free_port()
        procs = []
        for slurm in simulated_environ(1, world, job_id=4715):
            env = {**os.environ, **slurm, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "SLURM_CPUS_PER_TASK": "1", OUT_VAR: str(out), SPEC_VAR: f"{calls},{WARMUP},{profiled}",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            if not cuda:
                env["CUDA_VISIBLE_DEVICES"] = ""
            procs.append(subprocess.Popen([sys.executable, "-m", "hpc_ddp.worker", "--config",
                                           str(run_dir / "config.yaml")], cwd=ROOT, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs) or not out.exists():
            raise RuntimeError(f"B15 {case} x {world} failed:\n" + "\n".join(log[-3000:] for log in logs))
        return summary(json.loads(out.read_text()))


def summary(figures: dict[str, Any]) -> dict[str, Any]:
    """Median and p99 (µs) of the whole call, of the agreement in it, and of the rest (our own Python)."""
    total, agree = figures["total_ns"], figures["agree_ns"]
    rest = [t - a for t, a in zip(total, agree)]
    out = {"calls": len(total), "world_size": figures["world_size"], "device": figures["device"],
           "gpu": figures.get("gpu"), "profile": figures["profile"]}
    for name, values in (("total", total), ("agreement", agree), ("own", rest)):
        ordered = sorted(values)
        out[f"{name}_median_us"] = round(ordered[len(ordered) // 2] / 1e3, 1)
        out[f"{name}_p99_us"] = round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e3, 1)
    return out


CPU_CASES = ("gpt:1", "gpt:2", "trainer:1", "trainer:2")
CUDA_CASES = ("gpt:1:cuda", "trainer:1:cuda")
TARGET_US = 50.0  # the GPT example, CPU, world size 1: median per boundary


def b15(calls: int, cases: tuple[str, ...] = CPU_CASES + CUDA_CASES) -> dict[str, Any]:
    """Every case; the CUDA ones only where CUDA is (else their rows say so)."""
    import torch

    rows: dict[str, Any] = {}
    for spec in cases:
        case, world, *where = spec.split(":")
        if where and not torch.cuda.is_available():
            rows[spec] = {"skipped": "no CUDA device on this machine"}
            continue
        rows[spec] = measure(case, int(world), calls, cuda=bool(where))
    gpt = rows.get("gpt:1", {})
    met = gpt["total_median_us"] <= TARGET_US if "total_median_us" in gpt else None
    return {"rows": rows, "calls": calls, "target": f"GPT example, CPU, world size 1: median <= {TARGET_US:g} µs "
            "a boundary (snapshot.jit on, train.rng derived)", "met": met}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.boundary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--cases", default=",".join(CPU_CASES + CUDA_CASES))
    args = parser.parse_args(argv)
    result = b15(args.calls, tuple(c for c in args.cases.split(",") if c))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for spec, row in result["rows"].items():
        print(spec, {k: v for k, v in row.items() if k != "profile"})
        for entry in row.get("profile", [])[:8]:
            print("   ", entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
