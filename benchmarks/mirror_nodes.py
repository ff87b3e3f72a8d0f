"""B2-MIRROR-NODES: the per-rank mirror's cost between machines, against the same geometry on one.

B2-MIRROR measures the mirror with two ranks of one node, where the buddy is the next rank and every
byte crosses loopback. On a cluster the buddy is the same local rank on the next node
(:func:`hpc_ddp.rank.salvage.mirror.buddy_of`), so every mirrored byte crosses the network. Here the
same loop (``benchmarks.training``'s own loop, B2's model) runs at 2 nodes x 2 ranks twice:

- **between machines**: one job of the local Slurm cluster of machines (``python -m
  hpc_ddp.slurm_local start``): each node a network namespace joined to a bridge by a veth pair, so
  rank 0's state goes to rank 2 over veth -> bridge -> veth, through each namespace's TCP stack;
  the ranks take their places from Slurm's variables, as a job's do;
- **on one machine**: the same 2 x 2 as simulated nodes on loopback (the reference, measured beside it).

At each size (256 KB, 8 MB, 64 MB a rank) the variants are interleaved in every round: the loop
rewriting an untracked buffer of the size at every step (the reference), the same buffer tracked with
``per_rank`` (a state that changes: sent whole every step), one of the size that never changes,
tracked (sent as a header), the changing one tracked with ``per_rank(..., mirror="derive")`` (never
sent: the policy for state the loop rebuilds), and with ``mirror=10`` (copied and sent at about every
tenth boundary). The cost per MB is what a step gains in milliseconds per MB of per-rank
state sent whole, so a user can price their own state: (1 / rate_mirrored - 1 / rate_reference) / MB.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.common import per_round

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("256k", "8m", "64m")
GEOMETRY = (2, 2)
SAME_TARGET = 0.98  # an unchanged state between machines, against the loop without it (a header a step)
# a state that changes, per MB between machines against per MB on loopback: the veth path may add copies
# through two TCP stacks, not a multiple of the cost
PER_MB_TARGET = 1.5
PLACES = ("nodes", "loopback")


def variants(size: str) -> tuple[str, str, str, str, str]:
    """``benchmarks.training``'s variants at ``size``: the reference, changing, unchanged, the changing one
    tracked with ``mirror="derive"`` (never sent), and with ``mirror=10`` (sent about every 10 steps)."""
    return (f"own_fill{size}", f"own_mirror_fill{size}", f"own_mirror_same{size}", f"own_derive_fill{size}",
            f"own_every10_fill{size}")


def link_bytes(veths: list[str]) -> int:
    """Bytes the nodes' links carried so far (the host's ends of their veths, both ways): what crossed
    between the machines, the mirror's and the training's all-reduce alike."""
    total = 0
    for name in veths:
        for way in ("rx_bytes", "tx_bytes"):
            stats = Path(f"/sys/class/net/{name}/statistics/{way}")
            total += int(stats.read_text()) if stats.exists() else 0
    return total


def on_slurm(scratch: Path, size: str, rounds: int, steps: int, environ: dict[str, str],
             veths: list[str]) -> dict[str, Any]:
    """One job of 2 nodes x 2 tasks on the local cluster: ``benchmarks.training --slurm``; rank 0's JSON, with
    the bytes the nodes' links carried during the job (``link_mb``: through the bridge, so counted at both the
    sending and the receiving node's link)."""
    folder = scratch / f"b2m-nodes-{size}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    out, script = folder / "b2m.json", folder / "b2m.sbatch"
    script.write_text("\n".join([
        "#!/bin/bash", f"#SBATCH --nodes={GEOMETRY[0]}", f"#SBATCH --ntasks-per-node={GEOMETRY[1]}",
        "#SBATCH --time=30", f"#SBATCH --output={folder}/job.out", f"cd {ROOT}",
        f"srun {sys.executable} -m benchmarks.training --slurm {out} {rounds} {steps} 40 "
        f"{','.join(variants(size))}", ""]))
    before = link_bytes(veths)
    done = subprocess.run(["sbatch", "--wait", str(script)], env=environ, capture_output=True, text=True,
                          timeout=2400)
    carried = link_bytes(veths) - before
    if done.returncode or not out.exists():
        log = (folder / "job.out").read_text(errors="replace") if (folder / "job.out").exists() else ""
        raise RuntimeError(f"B2-MIRROR-NODES at {size} failed (sbatch {done.returncode}): {done.stderr[-500:]} "
                           f"{log[-3000:]}")
    return {**json.loads(out.read_text()), "link_mb": round(carried / 2**20, 1)}


def on_loopback(size: str, rounds: int, steps: int) -> dict[str, Any]:
    """The same 2 x 2 as simulated nodes of this machine, every byte over loopback."""
    from hpc_ddp.rehearsal.local import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "b2m.json"
        subprocess.run([sys.executable, "-m", "benchmarks.training", str(out), str(rounds), str(steps), "40",
                        str(free_port()), ",".join(variants(size)), "x".join(map(str, GEOMETRY))],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def summary(data: dict[str, Any], size: str) -> dict[str, Any]:
    """One place's figures at one size: the ratios against the reference, per round; the cost per MB."""
    from benchmarks.training import size_of

    samples = data["samples"]
    reference, changing, same, derive, every10 = variants(size)
    moving, kept = per_round(samples, changing, reference), per_round(samples, same, reference)
    derived = per_round(samples, derive, reference) if derive in samples else None
    sparse = per_round(samples, every10, reference) if every10 in samples else None
    rates = {k: median(v) for k, v in samples.items()}
    megabytes = size_of(size) / 2**20
    per_mb = (1 / rates[changing] - 1 / rates[reference]) * 1000 / megabytes
    return {"changing_vs_own": round(moving[0], 3), "changing_iqr": moving[1], "same_vs_own": round(kept[0], 3),
            "same_iqr": kept[1], "ms_per_step_per_mb": round(per_mb, 3),
            **({"derive_vs_own": round(derived[0], 3), "derive_iqr": derived[1]} if derived else {}),
            **({"every10_vs_own": round(sparse[0], 3), "every10_iqr": sparse[1],
                "every10_ms_per_mb": round((1 / rates[every10] - 1 / rates[reference]) * 1000 / megabytes, 3)}
               if sparse else {}),
            "steps_per_s": {k: round(v, 3) for k, v in rates.items()},
            "sent": {"changing": data["mirrored"].get(changing), "same": data["mirrored"].get(same),
                     **({"every10": data["mirrored"].get(every10)} if sparse else {})}}


def b2_mirror_nodes(scratch: Path, rounds: tuple[int, ...], steps: int, environ: dict[str, str],
                    veths: list[str]) -> dict[str, Any]:
    """B2-MIRROR-NODES at each size, between machines and on loopback one after the other."""
    sizes: dict[str, Any] = {}
    for size, count in zip(SIZES, rounds):
        between = on_slurm(scratch, size, count, steps, environ, veths)
        sizes[size] = {"rounds": count, "nodes": {**summary(between, size), "link_mb": between["link_mb"]},
                       "loopback": summary(on_loopback(size, count, steps), size)}
    same_met = all(s["nodes"]["same_vs_own"] >= SAME_TARGET for s in sizes.values())
    # the per-MB comparison where the cost is measurable above the noise (8 and 64 MB)
    per_mb = {size: round(s["nodes"]["ms_per_step_per_mb"] / s["loopback"]["ms_per_step_per_mb"], 3)
              for size, s in sizes.items() if size != "256k" and s["loopback"]["ms_per_step_per_mb"] > 0}
    per_mb_met = bool(per_mb) and all(ratio <= PER_MB_TARGET for ratio in per_mb.values())
    return {"sizes": sizes, "steps": steps, "geometry": "x".join(map(str, GEOMETRY)),
            "per_mb_nodes_vs_loopback": per_mb, "same_met": same_met, "per_mb_met": per_mb_met,
            "met": same_met and per_mb_met,
            "target": f"between machines an unchanged state mirrored >= {SAME_TARGET} x the loop without it at "
                      f"every size; a changing state's cost per MB between machines <= {PER_MB_TARGET} x on "
                      "loopback (8 and 64 MB)",
            "where": "the local Slurm cluster of machines (a namespace, a veth pair and a bridge per node), one "
                     "job a size; the loopback rows: the same 2 x 2 simulated on this machine",
            "workload": "B2's: 3 x Linear(1024,1024), batch 64/rank, 4 gloo ranks on 2 CPUs; per_rank: a buffer "
                        "of the size rewritten at every step (fill_), or one never rewritten"}


def row(s: dict[str, Any]) -> str:
    """B2-MIRROR-NODES's row of the performance table."""
    parts = []
    for size, f in s["sizes"].items():
        n, lo = f["nodes"], f["loopback"]
        parts.append(f"{size.upper()}B ({f['rounds']} rounds; the links carried {n['link_mb'] / 1024:.0f} GB, "
                     "mostly the all-reduce's): changing "
                     f"{n['changing_vs_own']} x (IQR "
                     f"{'-'.join(map(str, n['changing_iqr']))}; loopback {lo['changing_vs_own']} x), "
                     f"{n['ms_per_step_per_mb']} ms a step per MB (loopback {lo['ms_per_step_per_mb']}); "
                     f"unchanged {n['same_vs_own']} x (IQR {'-'.join(map(str, n['same_iqr']))}; loopback "
                     f"{lo['same_vs_own']} x)"
                     + (f"; tracked with mirror='derive' {n['derive_vs_own']} x (IQR "
                        f"{'-'.join(map(str, n['derive_iqr']))})" if "derive_vs_own" in n else "")
                     + (f"; mirror=10 {n['every10_vs_own']} x (IQR {'-'.join(map(str, n['every10_iqr']))}; "
                        f"loopback {lo['every10_vs_own']} x), {n['every10_ms_per_mb']} ms a step per MB "
                        f"(loopback {lo['every10_ms_per_mb']})" if "every10_vs_own" in n else ""))
    ratio = ", ".join(f"{k.upper()}B {v} x" for k, v in s["per_mb_nodes_vs_loopback"].items())
    mark = "-" if s.get("met") is None else "yes" if s["met"] else "**no**"
    return (f"| B2-MIRROR-NODES ({s['geometry']}, {s['steps']} steps a variant; between two machines of the local "
            f"cluster, against the same on loopback) | against the same loop without the mirror: "
            f"{'; '.join(parts)}. Cost per MB, between machines / loopback: {ratio or '-'} | {s['target']} | "
            f"{mark} |")
