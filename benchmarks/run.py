"""``python -m benchmarks.run``: every figure of docs/performance.md, as ratios measured side by side.

Writes ``benchmarks/results.json`` (sections B1..B10, B10-REAL and B2-GPU: raw medians, the ratio, the
target, met or not) and prints the markdown table; ``--write-docs`` puts the
table into docs/performance.md. Medians over interleaved repeats: this machine
is noisy (2 cores, hypervisor steal), so only ratios from one run mean much.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import interleaved, median, per_round, wall
from hpc_ddp.rundir import metrics_file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
SCRATCH = ROOT / "runs"  # the repo's filesystem, and ignored by git (a late job write can outlive the cleanup)
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- results: begin -->", "<!-- results: end -->"
ALIASES = {"BOUNDARY": "B15"}  # --only takes a figure's name too


def b1_cli(repeats: int) -> dict[str, Any]:
    """The login-node CLI against a bare interpreter importing its dependencies, and torch."""
    cmds = {"dry_run_s": [sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--dry-run",
                          "--no-preflight"],
            "import_submitit_omegaconf_s": [sys.executable, "-c", "import submitit, omegaconf"],
            "import_torch_s": [sys.executable, "-c", "import torch"]}
    samples = interleaved({name: (lambda c=cmd: wall(c, cwd=str(ROOT))) for name, cmd in cmds.items()}, repeats)
    med = {name: median(v) for name, v in samples.items()}
    ratio = med["dry_run_s"] / med["import_submitit_omegaconf_s"]
    return {**_round(med), "ratio": round(ratio, 3), "target": "dry-run <= 1.3 x import submitit+omegaconf",
            "met": ratio <= 1.3, "torch_vs_dry_run": round(med["import_torch_s"] / med["dry_run_s"], 2),
            "repeats": repeats}


def b2_training(rounds: int, steps: int, every: int) -> dict[str, Any]:
    """B2 on the CPU: each figure is the median over rounds of a per-round ratio (each round runs every variant
    once, in turn), with the quartiles of those ratios (IQR) beside it; raw2 / raw is the noise floor."""
    from hpc_ddp.rehearsal.local import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b2.json"
        subprocess.run([sys.executable, "-m", "benchmarks.training", str(out), str(rounds), str(steps), str(every),
                        str(free_port())], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    samples = data["samples"]
    rates = {name: median(values) for name, values in samples.items()}
    ratio = {name: per_round(samples, name, "raw") for name in samples if name != "raw"}
    stop_cost, own_group = per_round(samples, "stop", "bare"), per_round(samples, "stop", "shared")
    trainer, own = ratio["stop"][0], ratio["own"][0]
    return {"steps_per_s": _round(rates), "trainer_vs_raw": round(trainer, 3), "trainer_iqr": ratio["stop"][1],
            "own_loop_vs_raw": round(own, 3), "own_loop_iqr": ratio["own"][1],
            **({"own_mirror_vs_raw": round(ratio["own_mirror"][0], 3), "own_mirror_iqr": ratio["own_mirror"][1],
                "own_mirror_vs_own": round(per_round(samples, "own_mirror", "own")[0], 3),
                "own_mirror_vs_own_iqr": per_round(samples, "own_mirror", "own")[1],
                "mirror_target": "own loop with per-rank state mirrored >= 0.99 x raw (issue 35)",
                "mirror_met": ratio["own_mirror"][0] >= 0.99} if "own_mirror" in ratio else {}),
            "raw_vs_raw": round(ratio["raw2"][0], 3), "raw_vs_raw_iqr": ratio["raw2"][1],
            "bare_trainer_vs_raw": round(ratio["bare"][0], 3),
            "stop_flag_cost": round(1 - stop_cost[0], 3), "stop_vs_bare_iqr": stop_cost[1],
            "own_group_vs_shared": round(own_group[0], 3), "own_group_vs_shared_iqr": own_group[1],
            "sync_snapshots_vs_raw": round(ratio["sync"][0], 3),
            "async_snapshots_vs_raw": round(ratio["async"][0], 3),
            "target": "trainer and own loop + run API (with the per-step stop agreement, no snapshots) >= 0.98 x "
                      "raw DDP loop (median of per-round ratios)",
            "met": trainer >= 0.98 and own >= 0.98, "rounds": rounds, "steps": steps, "snapshot_every": every,
            "workload": "3 x Linear(1024,1024), MSE, SGD, batch 64/rank, 2 gloo ranks, 1 thread each"}


def _either(row: dict[str, Any], key: str) -> Any:
    """A B9 row's every_node figure, or every_rank's in a row measured before issue 45."""
    return row.get(f"every_node_{key}", row.get(f"every_rank_{key}", "-"))


MIRROR_SIZES = ("256k", "8m", "64m")  # per-rank state per rank, in B2-MIRROR
SAME_TARGET = 0.98  # an unchanged state mirrored, against the same loop without it (issue 45: a header a step)


def b2_mirror(rounds: tuple[int, int, int], steps: int) -> dict[str, Any]:
    """B2-MIRROR: the per-rank mirror's cost alone, at 256 KB, 8 MB and 64 MB of per-rank state a rank, for a
    state that changes at every step (a prefetched batch: sent whole) and one that never does (sent as a header).
    One run of ``benchmarks.training`` a size, its variants interleaved in each round (``rounds``: a size's, fewer
    at the larger sizes). At 256 KB: raw, the raw loop again (the noise floor), the own loop with the run API, the
    same with a counter and the step's 256 KB batch mirrored (B2's ``own_mirror``), and with 256 KB that never
    changes. At 8 and 64 MB: the own loop rewriting a buffer of the size at every step (untracked), the same
    tracked, and the first with another buffer of the size that never changes, tracked. Each ratio is against
    the same loop without the mirror (the own loop; at 8 and 64 MB the one rewriting its buffer), measured in the
    same round."""
    from hpc_ddp.rehearsal.local import free_port

    runs = {"256k": ("raw", "raw2", "own", "own_mirror", "own_mirror_same256k"),
            **{size: (f"own_fill{size}", f"own_mirror_fill{size}", f"own_mirror_same{size}")
               for size in MIRROR_SIZES[1:]}}
    sizes: dict[str, Any] = {}
    for (size, variants), count in zip(runs.items(), rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "b2m.json"
            subprocess.run([sys.executable, "-m", "benchmarks.training", str(out), str(count), str(steps), "40",
                            str(free_port()), ",".join(variants)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            data = json.loads(out.read_text())
        samples = data["samples"]
        changing = ("own_mirror", "own") if size == "256k" else (f"own_mirror_fill{size}", f"own_fill{size}")
        moving, same = per_round(samples, *changing), per_round(samples, f"own_mirror_same{size}", changing[1])
        sizes[size] = {"changing_vs_own": round(moving[0], 3), "changing_iqr": moving[1],
                       "same_vs_own": round(same[0], 3), "same_iqr": same[1], "rounds": count,
                       "sent": {"changing": data["mirrored"].get(changing[0]),
                                "same": data["mirrored"].get(f"own_mirror_same{size}")},
                       "steps_per_s": _round({k: median(v) for k, v in samples.items()})}
        if size == "256k":
            first = samples
    mirror, own = per_round(first, "own_mirror", "raw"), per_round(first, "own_mirror", "own")
    floor, plain = per_round(first, "raw2", "raw"), per_round(first, "own", "raw")
    met_same = all(sizes[s]["same_vs_own"] >= SAME_TARGET for s in MIRROR_SIZES)
    return {"steps_per_s": sizes["256k"]["steps_per_s"],
            "own_mirror_vs_raw": round(mirror[0], 3), "own_mirror_iqr": mirror[1],
            "own_mirror_vs_own": round(own[0], 3), "own_mirror_vs_own_iqr": own[1],
            "own_vs_raw": round(plain[0], 3), "own_iqr": plain[1], "raw_vs_raw": round(floor[0], 3),
            "raw_vs_raw_iqr": floor[1], "sizes": sizes,
            "target": f"own loop with per-rank state mirrored >= 0.99 x raw (issue 35); an unchanged state mirrored "
                      f">= {SAME_TARGET} x the loop without it at 256 KB, 8 MB and 64 MB (issue 45)",
            "met": mirror[0] >= 0.99 and met_same, "mirror_met": mirror[0] >= 0.99, "same_met": met_same,
            "rounds": rounds[0], "steps": steps,
            "workload": "B2's: 3 x Linear(1024,1024), batch 64/rank, 2 gloo ranks; per_rank: a counter and the "
                        "step's 256 KB batch; or a buffer of 8 or 64 MB rewritten at every step (fill_), or one never "
                        "rewritten"}


def b2_gpu(quick: bool) -> dict[str, Any]:
    """B2-GPU (benchmarks/gpu.py): measured only where CUDA is; elsewhere the section says so."""
    from benchmarks.gpu import b2_gpu as measure

    return measure(quick)


def b2_gpu_pipeline(quick: bool) -> dict[str, Any]:
    """B2-GPU-PIPELINE (benchmarks/gpu.py): a CUDA state's snapshot alone; measured only where CUDA is."""
    from benchmarks.gpu import b2_gpu_pipeline as measure

    return measure(quick)


def b3_snapshots(directory: Path, repeats: int, sizes: list[float]) -> dict[str, Any]:
    from benchmarks.snapshots import snapshot_figures

    figures = {f"{int(mb)}MB": snapshot_figures(mb, directory, repeats if mb < 500 else max(1, repeats - 1))
               for mb in sizes}
    for mb, f in zip(sizes, figures.values()):
        f["met"] = f["sync_vs_dd"] >= 0.8 and f["async_blocked_vs_sync"] <= 0.15 and (
            mb < 1000 or f["load_and_copy_s"] <= 0.2)
    return {**figures, "target": "sync >= 0.8 x dd; async blocked <= 0.15 x sync; 1 GB resume load <= 0.2 s",
            "met": all(f["met"] for f in figures.values())}


def b4_stop(directory: Path, repeats: int) -> dict[str, Any]:
    from benchmarks.snapshots import stop_latency, sync_write_probe

    probe_dir = directory / "b4-write"
    figures = stop_latency(directory, 100, repeats, sync_write_probe(probe_dir, 100))
    shutil.rmtree(probe_dir, ignore_errors=True)
    beyond = figures["signal_to_exit_s"] - figures["sync_write_s"]
    return {**figures, "beyond_write_s": round(beyond, 4),
            "target": "signal -> committed and exited <= 0.4 s beyond a sync snapshot write of the same state "
                      "(measured beside each stop); 0 steps lost",
            "met": beyond <= 0.4 and figures["steps_lost"] == 0}


def b5_slurm() -> dict[str, Any]:
    """sbatch -> first step, and requeue -> first resumed step, on the local test cluster."""
    from hpc_ddp.slurm_local import ClusterSpec, missing_pieces, start

    spec = ClusterSpec()
    missing = missing_pieces(spec)
    if missing:
        return {"skipped": f"needs {', '.join(missing)} (bash dev/test.sh installs them)", "met": None}
    start(spec)
    env = {**__import__("os").environ, "SLURM_CONF": str(spec.conf_path)}
    SCRATCH.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=SCRATCH, ignore_cleanup_errors=True) as tmp:
        run_dir = Path(tmp) / "b5"
        metrics = run_dir / "metrics.jsonl"
        begin = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "train.log_every=1",
                               "train.max_steps=5000", f"run_dir={run_dir}", "slurm.timeout_min=30"], cwd=ROOT,
                              env=env, capture_output=True, text=True, check=True)
        job = proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
        first = _wait(lambda: metrics.exists() and metrics.stat().st_size > 0, 180) - begin
        lines = lambda: metrics_file.entries(metrics.read_text().splitlines())  # noqa: E731  (whole lines only)
        _wait(lambda: len(lines()) >= 20, 120)
        signalled = time.perf_counter()
        subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
        _wait(lambda: (run_dir / "attempts.jsonl").exists(), 120)
        stopped = json.loads((run_dir / "attempts.jsonl").read_text().splitlines()[0])["last_step"]
        resumed = _wait(lambda: any(x["step"] > stopped for x in lines()), 300) - signalled
        subprocess.run(["scancel", job], env=env, check=False)  # the run dir goes; the job ends on its own
    return {"submit_to_first_step_s": round(first, 2), "signal_to_first_resumed_step_s": round(resumed, 2),
            "target": "(reported; no target)", "met": None,
            "note": "includes Slurm's scheduling and requeue delays on the local test cluster"}


def _wait(predicate: Callable[[], Any], timeout: float) -> float:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if predicate():
            return time.perf_counter()
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout}s")


def _local_cluster() -> tuple[Any, dict[str, Any] | None]:
    """The local Slurm cluster, started here if it is not running: (its spec, None), or (None, the row that
    says what it lacks)."""
    from hpc_ddp.slurm_local import ClusterSpec, missing_pieces, start

    spec = ClusterSpec()
    missing = missing_pieces(spec)
    if missing:
        return None, {"skipped": f"needs {', '.join(missing)} (bash dev/test.sh installs them)", "met": None}
    start(spec)
    return spec, None


def b9_on_slurm(scratch: Path, megabytes: float) -> dict[str, Any]:
    """B9 as one job of 3 nodes x 2 tasks on the local Slurm cluster (started here if it is not running)."""
    from benchmarks.spread import b9_slurm

    spec, skipped = _local_cluster()
    if skipped:
        return skipped
    return b9_slurm(scratch, megabytes, 3, 2, {**__import__("os").environ, "SLURM_CONF": str(spec.conf_path)})


def b2_mirror_on_nodes(scratch: Path, quick: bool) -> dict[str, Any]:
    """B2-MIRROR-NODES (benchmarks/mirror_nodes.py): the mirror between two machines of the local cluster."""
    from benchmarks.mirror_nodes import b2_mirror_nodes
    from hpc_ddp.slurm_local.isolation import machines

    spec, skipped = _local_cluster()
    if skipped:
        return skipped
    return b2_mirror_nodes(scratch, (1, 1, 1) if quick else (4, 3, 3), 30 if quick else 80,
                           {**__import__("os").environ, "SLURM_CONF": str(spec.conf_path)},
                           [m.veth for m in machines(spec)])


def b11_lost(scratch: Path, trials: int, per_rank: bool = False, batchnorm: bool = False) -> dict[str, Any]:
    """B11 (benchmarks/lost.py): steps lost per failure at random points, with the survivors' snapshot (and with
    per_rank objects mirrored to a buddy, or a BatchNorm model losing node 0 or node 1)."""
    from benchmarks.lost import b11

    return b11(scratch, trials, per_rank=per_rank, compute_s=0.1 if per_rank else 0.0, batchnorm=batchnorm)


def b13_recovery(scratch: Path, sizes: tuple[int, ...]) -> dict[str, Any]:
    """B13 (benchmarks/recovery.py): a lost node to the first resumed step, survivors' snapshot against periodic."""
    from benchmarks.recovery import b13

    return b13(scratch, sizes)


def b13_split(scratch: Path, quick: bool) -> dict[str, Any]:
    """B13-SPLIT (benchmarks/recovery.py): the survivors' snapshot's write per node at 2 and 4 nodes."""
    from benchmarks.recovery import b13_split as figure

    return figure(scratch, 100 if quick else 1000)


def b14_ops(scratch: Path, quick: bool) -> dict[str, Any]:
    """B14 (benchmarks/run_dir_ops.py): run-dir operations per event, counted, at 1-8 nodes x 1-4 ranks a node."""
    from benchmarks.run_dir_ops import GRID, b14

    return b14(scratch, [(1, 1), (2, 1), (2, 2)] if quick else GRID)


def b14_failure(results: dict[str, Any], scratch: Path, quick: bool) -> dict[str, Any]:
    """B14's failure row alone, at 2-8 nodes x 1-4 ranks a node, merged into the B14 section (its other rows
    kept from their own run)."""
    from benchmarks.run_dir_ops import GRID, b14, merged

    fresh = b14(scratch, [(2, 1), (2, 2)] if quick else [g for g in GRID if g[0] >= 2], ("failure",))
    return merged(results.get("B14") or {}, fresh, ("failure",))


def b14_sim(quick: bool) -> dict[str, Any]:
    """B14-SIM (benchmarks/failure_sim.py): a failure's run-dir work at 16-512 nodes x 1 and 8, stand-in ranks."""
    from benchmarks.failure_sim import GRID, b14_sim as figure

    grid = [(16, 1), (16, 8), (64, 8)] if quick else GRID
    plain, with_per_rank = figure(grid), figure(grid, per_rank=True)
    # "met" is the plain rows' own (their table row's mark); the per-rank rows carry theirs
    return {**plain, "with_per_rank": with_per_rank}


def b10_healing() -> dict[str, Any]:
    from benchmarks.healing import b10_healing as figure

    return figure()


def b16_detection(trials: int, soak_minutes: float) -> dict[str, Any]:
    from benchmarks.detection import b16_detection as figure

    return figure(trials, soak_minutes=soak_minutes)


def b17_straggler(trials: int) -> dict[str, Any]:
    from benchmarks.straggler import b17_straggler as figure

    return figure(trials)


def b10_real(quick: bool) -> dict[str, Any]:
    from benchmarks.healing_real import b10_real as figure

    return figure(1 if quick else 4)


def b7_split(scratch: Path, megabytes: float, counts: tuple[int, ...]) -> dict[str, Any]:
    from benchmarks.split import b7_split as figure

    return figure(scratch, megabytes, counts)


def b9_spread(scratch: Path, megabytes: float, counts: tuple[int, ...]) -> dict[str, Any]:
    from benchmarks.spread import b9_spread as figure

    return figure(scratch, megabytes, counts)


def b8_replication(scratch: Path, megabytes: float, repeats: int) -> dict[str, Any]:
    from benchmarks.snapshots import replication_figures

    return replication_figures(megabytes, scratch, repeats)


def b12_control_plane(quick: bool) -> dict[str, Any]:
    """B12 (benchmarks/scale.py): the control plane at 2..48 real gloo ranks (4 a node), the stop agreement as a
    ring and in two levels, the commit in two levels and one, the descriptors against core.limits; and the model
    of 4,096 and 32,768 ranks from message counts, with the network's hop latency an input."""
    from benchmarks.scale import b12

    measured = b12([2, 4, 8] if quick else [2, 4, 8, 16, 32, 48], 4, "control")
    over = [r["world_size"] for r in measured["rows"] if r["fds_max"] > r["fds_budget"]]
    judged = measured["judged"]
    return {**measured, "fds_over_budget_at": over,
            "target": f"{judged['target']}; every rank's open files within core.limits at every measured size",
            "met": judged["met"] and not over}


def _b12_judged(s: dict[str, Any], row: dict[str, Any]) -> str:
    """What B12's measured targets say of one row (issue 59)."""
    judged = s.get("judged")
    if not judged:
        return ""
    said = ""
    if row["world_size"] in judged["two_level_slower_at"]:
        said += "; **two levels slower than the ring here**"
    if row is s["rows"][-1] and judged.get("tiers_init_exponent") is not None:
        said += f"; the agreement's groups' time grows as W^{judged['tiers_init_exponent']} over the multi-node rows"
    return said


def b15_boundary(quick: bool) -> dict[str, Any]:
    """B15 (benchmarks/boundary.py): one run.boundary alone, median and p99 over thousands of calls, the GPT own
    loop and the Trainer at world sizes 1 and 2 (and on CUDA where it is)."""
    from benchmarks.boundary import b15

    return b15(300 if quick else 3000)


B15_CASES = {"gpt": "GPT own loop (examples/own_loop_gpt.py: DDP model, AdamW, sampler tracked; snapshot.jit on, "
                    "train.rng derived)", "trainer": "Trainer (examples/mlp.py: model, AdamW, LambdaLR, GradScaler, "
                    "data position tracked)"}


def _b15_rows(s: dict[str, Any], mark: Callable[[dict[str, Any]], str]) -> list[str]:
    rows = []
    for spec, row in s["rows"].items():
        case, world, *where = spec.split(":")
        what = f"| B15 run.boundary alone, {B15_CASES[case]}, {'CUDA' if where else 'CPU'}, world size {world}"
        if row.get("skipped"):
            rows.append(f"{what} | **not yet measured**: {row['skipped']} | (reported) | - |")
            continue
        top = ", ".join(f"{e['function']} {e['own_us']:g}" for e in row["profile"][:4])
        target, met = (s["target"], mark(s)) if spec == "gpt:1" else ("(reported)", "-")
        rows.append(f"{what} ({row['calls']} calls{', ' + row['gpu'] if row.get('gpu') else ''}) | median "
                    f"{row['total_median_us']} µs, p99 {row['total_p99_us']} µs; the stop agreement in it: median "
                    f"{row['agreement_median_us']}, p99 {row['agreement_p99_us']} µs; the rest (our Python): median "
                    f"{row['own_median_us']}, p99 {row['own_p99_us']} µs; cProfile's top own times per call (µs): "
                    f"{top} | {target} | {met} |")
    return rows


def b6_scale(ranks: int = 4096) -> dict[str, Any]:
    from hpc_ddp.core.slurm_env import from_environ, simulated_environ

    environs = simulated_environ(ranks // 8, 8, job_id=987654)
    start = time.perf_counter()
    envs = [from_environ(e) for e in environs]
    took = time.perf_counter() - start
    agree = len({(e.master_addr, e.master_port) for e in envs}) == 1 and sorted(e.rank for e in envs) == list(
        range(ranks))
    return {"ranks": ranks, "all_ranks_s": round(took, 4), "per_rank_us": round(took / ranks * 1e6, 1),
            "agree_on_address_and_port": agree, "target": "every rank agrees", "met": agree}


def _span(pair: list[float] | None) -> str:
    return "-" if not pair else f"{pair[0]}-{pair[1]}"


def _mirror_sizes(sizes: dict[str, Any] | None) -> str:
    """B2-MIRROR's figures per size of per-rank state, for its row (runs before issue 45 have none)."""
    if not sizes:
        return ""
    parts = []
    for size, f in sizes.items():
        sent = (f.get("sent") or {}).get("changing") or {}
        skipped = (f"; {sent['skipped']} of {sent['skipped'] + sent['whole'] + sent['delta'] + sent['unchanged']} "
                   "states skipped" if sent.get("skipped") else "")
        parts.append(f"{size.upper()}B ({f['rounds']} rounds): a state that changes {f['changing_vs_own']} x (IQR "
                     f"{_span(f['changing_iqr'])}{skipped}), one that does not {f['same_vs_own']} x (IQR "
                     f"{_span(f['same_iqr'])})")
    return ". Per rank, against the same loop without the mirror: " + "; ".join(parts)


def _round(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


def table(results: dict[str, Any]) -> str:
    def mark(section: dict[str, Any]) -> str:
        return "-" if section.get("met") is None else ("yes" if section["met"] else "**no**")

    rows = ["| figure | measured | target | met |", "|---|---|---|---|"]
    b = results
    if "B1" in b:
        rows.append(f"| B1 CLI | dry-run {b['B1']['dry_run_s']} s = {b['B1']['ratio']} x `import submitit, "
                    f"omegaconf` ({b['B1']['import_submitit_omegaconf_s']} s); `import torch` "
                    f"{b['B1']['import_torch_s']} s | {b['B1']['target']} | {mark(b['B1'])} |")
    if "B2" in b:
        s = b["B2"]
        vs_own = (f"; {s['own_mirror_vs_own']} x the same loop without it, IQR {_span(s.get('own_mirror_vs_own_iqr'))}"
                  if "own_mirror_vs_own" in s else "")  # runs before 2026-11-26 did not measure it
        rows.append(f"| B2 training ({s['rounds']} rounds) | trainer {s['trainer_vs_raw']} x raw (IQR "
                    f"{_span(s.get('trainer_iqr'))}; {s['steps_per_s']['stop']} vs {s['steps_per_s']['raw']} steps/s); "
                    f"own loop + run API {s.get('own_loop_vs_raw')} x raw (IQR {_span(s.get('own_loop_iqr'))}); "
                    f"with per-rank state mirrored to a buddy {s.get('own_mirror_vs_raw')} x raw (IQR "
                    f"{_span(s.get('own_mirror_iqr'))}{vs_own}; >= 0.99 x raw: "
                    f"{'met' if s.get('mirror_met') else 'not met'}); noise "
                    f"floor raw vs raw {s.get('raw_vs_raw')} x (IQR {_span(s.get('raw_vs_raw_iqr'))}); "
                    f"{_stop_cost(s['stop_flag_cost'])} (IQR of stop / bare {_span(s.get('stop_vs_bare_iqr'))}); "
                    f"the agreement on its own gloo group {s.get('own_group_vs_shared')} x on the training group "
                    f"(IQR {_span(s.get('own_group_vs_shared_iqr'))}); "
                    f"snapshots every {s['snapshot_every']} steps: sync {s['sync_snapshots_vs_raw']} x, async "
                    f"{s['async_snapshots_vs_raw']} x raw | {s['target']} | {mark(s)} |")
    for name in ("B2-MIRROR", "B2-MIRROR-DEVICE"):  # the second: the same code run on a lent machine's CPUs
        if name not in b:
            continue
        s = b[name]
        where = f", {s['machine']}" if s.get("machine") else ""
        counter = (f"; only a counter mirrored {s['counter_mirror_vs_own']} x the loop without it (IQR "
                   f"{_span(s['counter_mirror_iqr'])})" if "counter_mirror_vs_own" in s else "")
        rounds = "/".join(str(f["rounds"]) for f in s["sizes"].values()) if "sizes" in s else s["rounds"]
        rows.append(f"| {name} ({rounds} rounds of {s['steps']} steps{where}) | own loop with per-rank state "
                    f"mirrored {s['own_mirror_vs_raw']} x raw (IQR {_span(s['own_mirror_iqr'])}), "
                    f"{s['own_mirror_vs_own']} x the same loop without it (IQR {_span(s['own_mirror_vs_own_iqr'])})"
                    f"{counter}; own loop {s['own_vs_raw']} x raw; noise floor raw vs raw {s['raw_vs_raw']} x (IQR "
                    f"{_span(s['raw_vs_raw_iqr'])}){_mirror_sizes(s.get('sizes'))} | {s['target']} | {mark(s)} |")
    if "B2-MIRROR-NODES" in b:
        from benchmarks.mirror_nodes import row as nodes_row

        s = b["B2-MIRROR-NODES"]
        rows.append(nodes_row(s) if not s.get("skipped") else f"| B2-MIRROR-NODES | **not measured**: {s['skipped']} | "
                    "- | - |")
    if "B2-GPU" in b:
        s = b["B2-GPU"]
        if s.get("skipped"):
            rows.append(f"| B2-GPU | **not yet measured**: {s['skipped']} | own loop + run API >= 0.99 x raw; "
                        "async blocked <= 0.1 x sync | - |")
        else:
            rows.append(f"| B2-GPU ({s['device']} x {s['world_size']}, NCCL, bf16, {s['rounds']} rounds) | own "
                        f"loop + run API {s['own_loop_vs_raw']} x raw (IQR {_span(s.get('own_loop_iqr'))}; "
                        f"{s['steps_per_s']['own']} vs {s['steps_per_s']['raw']} steps/s); trainer "
                        f"{s['trainer_vs_raw']} x (IQR {_span(s.get('trainer_iqr'))}); noise floor raw vs raw "
                        f"{s.get('raw_vs_raw')} x (IQR {_span(s.get('raw_vs_raw_iqr'))}); snapshots every "
                        f"{s['snapshot_every']} steps: "
                        f"sync {s['sync_snapshots_vs_raw']} x, async {s['async_snapshots_vs_raw']} x raw; "
                        f"{s['state_mb']:.0f} MB CUDA state: sync {s['sync_gb_s']} GB/s (dd {s['dd_gb_s']} GB/s), "
                        f"async blocks {s['async_blocked_vs_sync']} x sync | {s['target']} | {mark(s)} |")
            for label, row in ((k, (s.get("replication") or {}).get(k)) for k in ("gpt", "large")):
                if row:
                    rows.append(f"| B8 replication check on CUDA, {label} ({row['leaves']} leaves, {row['tensors']} "
                                f"tensors, {row['state_mb']} MB) | {row['fingerprint_s'] * 1e3:.2f} ms = "
                                f"{row['fingerprint_vs_sync']} x a sync snapshot (IQR {_span(row['ratio_iqr'])}) | "
                                f"<= 0.02 x | {'yes' if row['fingerprint_vs_sync'] <= 0.02 else '**no**'} |")
    rows.extend(_pipeline_rows(b))
    if "B12" in b and "model" in b["B12"]:
        s = b["B12"]
        for r in s["rows"]:
            rows.append(f"| B12 control plane, {r['world_size']} gloo ranks ({r['nodes']} node(s) x "
                        f"{r['world_size'] // r['nodes']}), measured on 2 shared cores | agreement: ring "
                        f"{r['agreement_ring_ms']:.2f} ms, two levels {r['agreement_two_level_ms']:.2f} ms; commit: "
                        f"two levels {r['commit_ms']:.0f} ms, one level {r['commit_one_level_ms']:.0f} ms; control "
                        f"group made in {r['control_init_s'] * 1e3:.1f} ms, the agreement's groups in "
                        f"{r['tiers_init_s'] * 1e3:.1f} ms; open files {r['fds_max']} (budget {r['fds_budget']})"
                        f"{_b12_judged(s, r)} | {s['target']} | {mark(s)} |")
        m = s["model"]
        inputs = m["inputs"]
        for world in ("4096", "32768"):
            row = m[world]
            rows.append(f"| B12 **model** (not measured), {world} ranks ({inputs['ranks_per_node']} a node; network hop "
                        f"{inputs['net_hop_us']} us, node hop {inputs['node_hop_us']} us, store request "
                        f"{inputs['store_op_us']} us given; rank 0's {inputs['entry_us']} us an entry measured) | "
                        f"agreement: ring {row['agreement_ring_ms']} ms, two levels {row['agreement_two_level_ms']} ms; "
                        f"commit: one level {row['commit_one_level_s']} s, two levels {row['commit_two_level_s']} s; "
                        f"the agreement's groups made in {row['agreement_groups_s']} s | "
                        f"{m['target']} | {mark(m)} |")
    if "B3" in b:
        for f in b["B3"].values():
            if isinstance(f, dict):
                rows.append(f"| B3 snapshot {f['size_mb']} MB | sync {f['sync_mb_s']} MB/s = {f['sync_vs_dd']} x "
                            f"dd fsync ({f['dd_mb_s']} MB/s); plain torch.save {f['plain_mb_s']} MB/s; async "
                            f"blocks {f['async_blocked_vs_sync']} x sync; fresh load {f['load_mmap_s']} s (mmap), "
                            f"{f['load_and_copy_s']} s into the model | {b['B3']['target']} | {mark(f)} |")
    if "B4" in b:
        s = b["B4"]
        rows.append(f"| B4 stop ({s['size_mb']:.0f} MB) | signal to exit {s['signal_to_exit_s']} s = snapshot "
                    f"write {s['sync_write_s']} s + {s['beyond_write_s']} s; commit to exit "
                    f"{s['commit_to_exit_s']} s; stopped {s.get('steps_after_signal', '?')} steps after the "
                    f"signal; steps lost {s['steps_lost']:g} | {s['target']} | {mark(s)} |")
    if "B5" in b:
        s = b["B5"]
        text = s.get("skipped") or (f"sbatch to first step {s['submit_to_first_step_s']} s; signal to first "
                                    f"resumed step {s['signal_to_first_resumed_step_s']} s")
        rows.append(f"| B5 Slurm | {text} | {s.get('target', '-')} | {mark(s)} |")
    if "B6" in b:
        s = b["B6"]
        rows.append(f"| B6 scale | from_environ for {s['ranks']} ranks: {s['all_ranks_s']} s "
                    f"({s['per_rank_us']} us each); all agree: {s['agree_on_address_and_port']} | {s['target']} "
                    f"| {mark(s)} |")
    if "B7" in b:
        s = b["B7"]
        for nodes, row in s["nodes"].items():
            rows.append(f"| B7 split snapshot, {nodes} x 1, {s['state_mb']} MB state | bytes written / state: "
                        f"replicas 1 {row['r1']['bytes_per_state']}, 2 {row['r2']['bytes_per_state']}, every node "
                        f"{row['every']['bytes_per_state']}; busiest node (replicas 2) "
                        f"{row['r2']['busiest_per_state']}; save {row['r2']['save_s']} s = "
                        f"{row['r2_save_vs_every']} x every node's, restore {row['r2']['restore_s']} s = "
                        f"{row['r2_restore_vs_every']} x | {s['target']} | {mark(s)} |")
    for key, where in (("B9", "rehearsal"), ("B9-SLURM", "local Slurm cluster")):
        s = b.get(key, {})
        if s.get("skipped"):
            rows.append(f"| B9 resume reads, {where} | **not measured**: {s['skipped']} | - | - |")
        for shape, row in s.get("rows", {}).items():
            rows.append(
                f"| B9 resume reads, {where}, {shape}, {s['state_mb']:.0f} MB state | disk read / state (kernel): "
                f"spread {row.get('spread_disk_per_state', '-')}, every node {_either(row, 'disk_per_state')}; "
                f"copied out of files / state (loader): spread {row['spread_read_per_state']} (busiest node "
                f"{row['spread_busiest_per_state']}), every node {_either(row, 'read_per_state')}; resume: spread "
                f"{row['spread_s']} s, as before (one level) {row.get('flat_spread_s', '-')} s, every node "
                f"{_either(row, 's')} s; a save's object bytes per non-zero rank "
                f"{row['save_object_bytes_per_nonzero_rank']} | {s['target']} | {mark(s)} |")
    for key, what in (("B11", ""), ("B11-PER-RANK", ", per_rank objects mirrored to a buddy, 0.1 s of compute a step"),
                      ("B11-BN", ", DDP with BatchNorm (buffers in params_sha256), node 0 or node 1 lost in turn")):
        if key not in b:
            continue
        s = b[key]
        rows.append(f"| {key} steps lost per failure, 2 x 2 rehearsal{what}, a node SIGKILLed at {s['trials']} random "
                    f"points inside steps ({s['step_s']} s each), no periodic snapshot | lost: "
                    + ", ".join(f"{k} step(s) in {v}" for k, v in s["lost_histogram"].items())
                    + f" of {s['completed']} trials; survivors' snapshot written in {s['jit_written']}; bit-identical "
                    f"to the uninterrupted run in {s['exact']}; without it: every_steps=50 would have lost "
                    f"{s['periodic_every_50_mean_lost']} on average at these steps, the default 30 minutes about "
                    f"{s['periodic_30_min_mean_lost']} | {s['target']} | {mark(s)} |")
    if "B13" in b:
        s = b["B13"]
        for size, row in s["rows"].items():
            jit, periodic = row["jit"], row["periodic"]
            if "error" in jit or "error" in periodic:
                continue
            rows.append(f"| B13 a lost node to the first resumed step, {size} of state, 2 x 1 rehearsal, failure after "
                        f"step {jit['failed_at']} | survivors' snapshot: resumed from {jit['resumed_from']}, first step "
                        f"{jit['first_step_s']} s, the failed step regained {jit['regained_s']} s; periodic (every 5 "
                        f"steps): resumed from {periodic['resumed_from']}, first step {periodic['first_step_s']} s, "
                        f"regained {periodic['regained_s']} s; every 50 steps would regain it after about "
                        f"{row.get('periodic_every_50_regained_s')} s | {s['target']} | {mark(s)} |")
    if "B13-SPLIT" in b:
        s = b["B13-SPLIT"]
        cells = "; ".join(f"{n} nodes: {r['writers']} writer(s), the busiest wrote {r['mb_per_node_max']} MB in "
                          f"{r['write_s_max']} s ({r['mb_all']} MB in all)" if "error" not in r else f"{n} nodes: failed"
                          for n, r in s["rows"].items())
        bn = s.get("batchnorm")
        if bn:
            cells += (f"; BatchNorm model, {bn['nodes']} nodes: {bn['writers']} writer(s), the busiest wrote "
                      f"{bn['mb_per_node_max']} MB in {bn['write_s_max']} s" if "error" not in bn
                      else f"; BatchNorm model, {bn['nodes']} nodes: failed")
        rows.append(f"| B13-SPLIT the survivors' snapshot split over the surviving nodes, {s['megabytes']} MB of state, "
                    f"N x 1 rehearsal, node 1 lost | {cells} | {s['target']} | {mark(s)} |")
    if "B14" in b:
        s = b["B14"]
        names = {"run": "per run (start, final snapshot, DONE)", "step": "per step", "snapshot": "per periodic snapshot",
                 "failure": "per failure (a node SIGKILLed, healed, resumed)", "stop": "per stop (preempted, resumed)"}
        for event, name in names.items():
            cells = [f"{key}: {sum(row['events'][event].values()):g}" for key, row in s["rows"].items()
                     if event in row["events"]]
            writers = [k for r in s["rows"].values() for k in (r.get("failure_writers") or [])]
            if event == "failure" and writers:  # like with like: the runs with the usual number of writers
                unlike = [key for key, r in s["rows"].items() if r.get("failure_alike") is False]
                name = (f"{names[event]}, at each geometry the median of its runs (3-5) with the writer count most "
                        f"runs at that node count had ({len(writers)} runs"
                        + (f"; none with it at {', '.join(unlike)}: all its runs" if unlike else "") + ")")
            fit = s["fits"].get(event) or {}
            grows = [g for g in s["grows_with_ranks_per_node"] if g.startswith(f"{event}:")]
            rows.append(f"| B14 run-dir operations {name}, nodes x ranks a node (opens, creates, renames, unlinks, "
                        f"listings, mkdirs; beats apart) | {', '.join(cells)}; fit {fit.get('a', '-')} + "
                        f"{fit.get('per_node', '-')} x nodes + {fit.get('per_rank', '-')} x ranks"
                        + (f"; grows with ranks a node: {'; '.join(g.split(': ', 1)[1] for g in grows)}" if grows else "")
                        + f" | {s['target']} | {mark(s)} |")
    if "B14-SIM" in b:
        for s, what in ((b["B14-SIM"], ""), (b["B14-SIM"].get("with_per_rank"), ", every rank with a mirrored "
                                             "per_rank state")):
            if not s:
                continue
            cells = ", ".join(f"{k}: {r['total']} ({r['per_node']} a node"
                              + (f"; median of {'/'.join(map(str, r['runs']))}" if len(r.get("runs", [])) > 1
                                 else "") + ")" if "error" not in r else f"{k}: failed"
                              for k, r in s["rows"].items())
            fits = "; ".join(f"at {p} a node {f['a']} + {f['per_node']} x nodes + {f['per_node_squared']} x "
                             "nodes^2" for p, f in s["fits"].items() if f)
            rows.append(f"| B14-SIM run-dir operations per failure, stand-in ranks (the survivors' protocol only"
                        f"{what}), nodes x ranks a node | {cells}; fit {fits} | {s['target']} | {mark(s)} |")
    if "B15" in b:
        rows.extend(_b15_rows(b["B15"], mark))
    if "B10" in b and "skipped" not in b["B10"]:
        s = b["B10"]
        names = {"killed": "a killed rank", "node_down": "a node marked down", "frozen": "a frozen rank (SIGSTOP)",
                 "requeue": "a killed rank, requeue path"}
        for path, row in s.get("rows", {}).items():
            extra = (f"; {row['less_hold_s']} s less the local hold, {row['with_default_hold_s']} s with Slurm's "
                     "default hold (computed)") if path == "requeue" else ""
            rows.append(f"| B10 {names.get(path, path)}, 2 x 1 on the local cluster | failure to the first resumed "
                        f"step: median {row['median_s']} s (min {row['min_s']}, max {row['max_s']}, "
                        f"{len(row['runs'])} runs){extra} | {s['target']} | {mark(s)} |")
    if "B16" in b and "skipped" not in b["B16"]:
        rows.extend(_b16_rows(b["B16"], mark))
    if "B17" in b and "skipped" not in b["B17"]:
        s = b["B17"]
        rows.append(f"| B17 a slow node (CPU capped at {s['fraction']:g} of the machine from step {s['cap_at']}), "
                    f"{s['geometry']} on the local cluster of machines | named after median "
                    f"{s['steps_to_name_median']} steps (max {s['steps_to_name_max']}, {2 * s['trials']} capped runs; "
                    f"{s['missed']} missed); kept, the job ran {s['rate_after_over_before']} x its rate before the cap; "
                    f"with replace and a spare: stopped {s['replace_stopped_after']} steps after the cap, steps lost "
                    f"{s['steps_lost']}, then {s['replaced_rate_over_before']} x the rate before the cap; "
                    f"{s['false_namings']} nodes named in {s['trials']} uncapped runs | {s['target']} | {mark(s)} |")
    if "B10-REAL" in b and "skipped" not in b["B10-REAL"]:
        from benchmarks.healing_real import doc_rows

        rows.extend(doc_rows(b["B10-REAL"]))
    if "B8" in b:
        s = b["B8"]
        for label, row in (("GPT example", s.get("gpt")), (f"{s['state_mb']:.0f} MB state", s.get("large"))):
            if row:  # every element of every tensor read; the quartiles over interleaved rounds are the noise
                rows.append(f"| B8 replication check, {label} ({row['leaves']} leaves, {row['tensors']} tensors, "
                            f"{row['state_mb']} MB) | check {row['fingerprint_s']} s = {row['fingerprint_vs_sync']} x "
                            f"a sync snapshot ({row['sync_s']} s); per-round ratio IQR {row['ratio_iqr'][0]}-"
                            f"{row['ratio_iqr'][1]} over {row['rounds']} rounds | {s['target']} | {mark(s)} |")
    return "\n".join(rows)


def _b16_rows(s: dict[str, Any], mark: Callable[[dict[str, Any]], str]) -> list[str]:
    """B16: one row a failure class, seconds from the fault to the moment the job knew, and who knew first."""
    names = {"killed_rank": "a killed rank", "frozen_rank": "a frozen rank (SIGSTOP)",
             "frozen_node": "a frozen node (freezer cgroup)", "partitioned": "a partitioned node (link cut)",
             "killed_node": "a killed node (every process)"}
    rows = []
    for kind, r in s["rows"].items():
        runs = len(r["known"]) + r["missed"] + len(r["errors"])
        trouble = (f"; **{r['missed']} missed**" if r["missed"] else "") + (
            f"; **{len(r['errors'])} failed runs**" if r["errors"] else "")
        # a survivor's error text names a port each run; a declaration says how it was noticed
        first = "; ".join(sorted({w.split(";")[0].split(", while")[0] if w.startswith("declared")
                                  else "a survivor's collective failed" for w in r["who"]}))
        rows.append(f"| B16 {names.get(kind, kind)}, {s['geometry']} on the local cluster of machines | known after "
                    f"median {r['median_s']} s (max {r['max_s']}, {runs} runs); resumed after {r['resumed_median_s']}"
                    f" s; first known by: {first}{trouble} | {s['target']} | {mark(s)} |")
    soak = s.get("soak")
    if soak and "error" not in soak:
        cases = ", ".join(f"{name} x {n}" for name, n in soak["cases_done"].items())
        rows.append(f"| B16 soak, 2 x 2 with the defaults, {soak['minutes']:g} min of slow things ({cases}) | "
                    f"**{soak['false_alarms']} false alarms** (attempts: {', '.join(map(str, soak['reasons']))}); "
                    f"{soak['slow_file_server_warnings']} slow-file-server warnings | {s['target']} | {mark(s)} |")
    elif soak:
        rows.append(f"| B16 soak | failed to run: {soak['error'][:120]} | {s['target']} | {mark(s)} |")
    return rows


def _stop_cost(cost: float) -> str:
    """The stop agreement's cost; a negative one is noise (the run with it was faster), said as such."""
    if cost > 0:
        return f"stop agreement costs {cost:.1%}"
    return f"stop agreement: no measurable cost (the run with it was {-cost:.1%} faster: noise)"


def _pipeline_rows(b: dict[str, Any]) -> list[str]:
    """B2-GPU-PIPELINE: a CUDA state's snapshot through the device-to-host pipeline, with B2-GPU's async loop
    where B2-GPU was measured with the pipeline; 'not yet measured' where no GPU measured it."""
    from benchmarks.common import PIPELINE_TARGET

    s, loop = b.get("B2-GPU-PIPELINE") or {}, b.get("B2-GPU") or {}
    every = (f"async snapshots every {loop['snapshot_every']} steps {loop['async_snapshots_vs_raw']} x raw"
             if loop.get("pipeline") else "async snapshots every 50 steps vs raw: not yet measured with the pipeline")
    if not s or s.get("skipped"):
        why = s.get("skipped") or "not run yet (python -m benchmarks.gpu --pipeline, or dev/gpu_check.sh pipeline)"
        return [f"| B2-GPU-PIPELINE CUDA state snapshot | **not yet measured**: {why}; {every} | {PIPELINE_TARGET} "
                "| - |"]
    writers = s.get("writers") or {}
    return [f"| B2-GPU-PIPELINE {s['state_mb']:.0f} MB CUDA state snapshot ({s['device']}, {s['repeats']} rounds) | "
            f"sync {s['sync_gb_s']} GB/s = {s['sync_vs_dd']} x dd ({s['dd_gb_s']} GB/s); async blocks "
            f"{s['async_blocked_s']} s = {s['async_blocked_vs_sync']} x sync; first snapshot {s['first_sync_s']} s; "
            f"two writer threads {writers.get('two_vs_one')} x one's time; {every} | {PIPELINE_TARGET} | "
            f"{'-' if s.get('met') is None else ('yes' if s['met'] else '**no**')} |"]


def write_docs(results: dict[str, Any]) -> None:
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    machine = results["machine"]
    note = f" ({machine['note']})" if machine.get("note") else ""
    block = (f"{BEGIN}\nMeasured {machine['date']} on {machine['description']}, with `python -m benchmarks.run"
             f"{' ' + ' '.join(machine['args']) if machine['args'] else ''}`{note}:\n\n{table(results)}\n{END}")
    DOC.write_text(head + block + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="B1,B2,B2-MIRROR,B2-MIRROR-NODES,B2-GPU,B2-GPU-PIPELINE,B3,B4,B5,B6,B7,B8,B9,B9-SLURM,B10,B10-REAL,B11,B11-PER-RANK,B11-BN,B12,B13,B13-SPLIT,B14,B14-SIM,B15,B16,B17",
                        help="comma-separated figures, e.g. B1,B3 (B2-GPU is measured only where CUDA is; "
                        "'boundary' is B15; B14-FAILURE re-measures B14's failure row alone)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes (a smoke run)")
    parser.add_argument("--write-docs", action="store_true", help="put the table into docs/performance.md")
    args = parser.parse_args(argv)
    only = {ALIASES.get(x.strip().upper(), x.strip().upper()) for x in args.only.split(",")}
    quick = args.quick
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["machine"] = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
                          "description": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, "
                          f"{platform.system()} {platform.release()}", "args": (argv or sys.argv[1:])}
    everything = set(parser.get_default("only").split(","))
    if not everything <= only:
        results["machine"]["note"] = (f"{', '.join(sorted(only))} measured in this run; the other rows are kept "
                                      "from earlier runs, and results.json gives each section's run_at")
    SCRATCH.mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="hpc_ddp-bench-", dir=SCRATCH))
    try:
        steps = [("B1", lambda: b1_cli(4 if quick else 10)),
                 ("B2", lambda: b2_training(1 if quick else 9, 60 if quick else 160, 40)),
                 ("B2-MIRROR", lambda: b2_mirror((1, 1, 1) if quick else (6, 4, 3), 30 if quick else 80)),
                 ("B2-MIRROR-NODES", lambda: b2_mirror_on_nodes(scratch, quick)),
                 ("B2-GPU", lambda: b2_gpu(quick)),
                 ("B2-GPU-PIPELINE", lambda: b2_gpu_pipeline(quick)),
                 ("B3", lambda: b3_snapshots(scratch, 2 if quick else 3, [100] if quick else [100, 1000])),
                 ("B4", lambda: b4_stop(scratch, 1 if quick else 3)),
                 ("B5", b5_slurm), ("B6", b6_scale),
                 ("B7", lambda: b7_split(scratch, 50 if quick else 200, (1, 2) if quick else (1, 2, 4, 8))),
                 ("B8", lambda: b8_replication(scratch, 100 if quick else 1000, 2 if quick else 5)),
                 ("B9", lambda: b9_spread(scratch, 50 if quick else 200, (1, 2) if quick else (1, 2, 4, 8))),
                 ("B9-SLURM", lambda: b9_on_slurm(scratch, 50 if quick else 200)),
                 ("B10", b10_healing), ("B10-REAL", lambda: b10_real(quick)), ("B11", lambda: b11_lost(scratch, 4 if quick else 30)),
                 ("B11-PER-RANK", lambda: b11_lost(scratch, 4 if quick else 30, per_rank=True)),
                 ("B11-BN", lambda: b11_lost(scratch, 4 if quick else 20, batchnorm=True)),
                 ("B12", lambda: b12_control_plane(quick)),
                 ("B13", lambda: b13_recovery(scratch, (100,) if quick else (100, 1000))),
                 ("B13-SPLIT", lambda: b13_split(scratch, quick)),
                 ("B14", lambda: b14_ops(scratch, quick)),
                 ("B14-FAILURE", lambda: b14_failure(results, scratch, quick)),
                 ("B14-SIM", lambda: b14_sim(quick)), ("B15", lambda: b15_boundary(quick)),
                 ("B16", lambda: b16_detection(2 if quick else 5, 3 if quick else 20)),
                 ("B17", lambda: b17_straggler(1 if quick else 3))]
        for name, run in steps:
            if name in only:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                # B14-FAILURE re-measures one row of B14's section
                key = "B14" if name == "B14-FAILURE" else name
                results[key] = {**run(), "run_at": time.strftime("%Y-%m-%d %H:%M")}  # whose figures are whose
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(results))
    if args.write_docs:
        write_docs(results)
    return 0 if all(results[k].get("met") is not False for k in only if k in results) else 1


if __name__ == "__main__":
    sys.exit(main())
