"""A compiled own loop healed on the real local cluster (issue 47): the heal's timeline has every phase,
the compiled one included, and the healed attempt compiles nothing: inductor's FX graph cache in the run
dir (``train.compile_cache=run``, the default) holds every graph the first attempt compiled.

One job of 2 nodes x 1 task with a spare; rank 1 is SIGKILLed in step 5. The uninterrupted local
rehearsal (the reference) compiles cold too, so it runs beside the Slurm job, not before it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core import timeline as tl
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import finished, losses, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.compile]
LOOP = ["examples/own_loop_gpt.yaml", "train.loop=tests.tasks.compiled_loop:train", "slurm.nodes=2",
        "slurm.tasks_per_node=1", "train.grad_accum=1", "train.max_steps=8", "train.log_every=1",
        "snapshot.every_steps=null", "snapshot.every_minutes=null"]


def submit(run_dir: Path, *options: str, fault: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *LOOP, *options, f"run_dir={run_dir}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "HPC_DDP_TEST_FAULT": fault})


def ended(proc: subprocess.Popen[str], timeout: float) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_a_compiled_own_loop_heals_on_the_spare_from_a_warm_cache_bit_identical(slurm_cluster: ClusterSpec,
                                                                                  tmp_path: Path) -> None:
    healed_dir, reference = tmp_path / "healed", tmp_path / "reference"
    rehearsal = submit(reference, "--local")  # compiles cold while the Slurm job does: two cold compiles at once
    ended(submit(healed_dir, "slurm.spare_nodes=1", fault="kill:1:5"), 300)
    status = lambda: subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(healed_dir)],  # noqa: E731
                                    cwd=tmp_path, capture_output=True, text=True, timeout=120,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert wait_until(lambda: finished(healed_dir), 400), status()
    ended(rehearsal, 400)

    failed, healed = read_attempts(healed_dir)
    assert (failed["reason"], healed["in_job"], healed["healed"]["how"]) == ("failed", 1, "replaced"), healed
    assert healed["resumed_from"] == failed["jit_snapshot"]["step"] == 4  # the survivors' snapshot of step 4
    timeline = healed["timeline"]
    assert timeline["kind"] == "heal" and [p for p in tl.PHASES if p in timeline] == list(tl.PHASES), timeline
    assert tl.out_of_order(timeline) == [] and timeline["detected"] >= 0, timeline  # one machine: one clock
    assert timeline["compile_cache"] == "hit", timeline  # counted: every FX graph came from the run's cache
    # the first attempt compiled cold: rank 0 compiled at least one graph itself (partial: rank 1, compiling the
    # same graphs into the same cache at the same time, may have saved one first)
    first_log = "\n".join(p.read_text(errors="replace") for p in (healed_dir / "slurm").glob("*_0_log.err"))
    verdicts = re.findall(r"compile: cache (\w+) \(", first_log)
    assert verdicts and verdicts[0] in ("miss", "partial"), first_log[-3000:]

    assert losses(healed_dir) == losses(reference)  # every step once, the same numbers
    done = [json.loads((d / "DONE.json").read_text()) for d in (healed_dir, reference)]
    assert done[0]["params_sha256"] == done[1]["params_sha256"]

    shown = status()
    assert "timeline of attempt #1 (heal), seconds after the failure" in shown, shown
    assert re.search(r"  compiled .*\(cache hit", shown), shown
