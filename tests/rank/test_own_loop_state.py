"""Own loops shaped like the ones people have, not like our examples (issue 22), through the real local
simulation (gloo, CPU, real signals): per-rank state, an eval forward on rank 0 only, replicated state that is
not, sampler misuse, a 0-d tensor as a metric, and a loop that never calls run.boundary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hpc_ddp.rundir import snapshot
from hpc_ddp.rundir.snapshot import steps as snapshot_steps
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.rundir.snapshot.steps import committed_steps
from tests.helpers import ROOT, done, losses, submit

pytestmark = pytest.mark.slow
LOOPS = "tests.tasks.loops"
NANO = ["examples/own_loop_gpt.yaml", "--local", f"train.loop={LOOPS}:nanogpt_shaped", "train.max_steps=18",
        "train.batch_size=4", "train.log_every=1", "snapshot.every_steps=4"]
SMALL = ["examples/own_loop_gpt.yaml", "--local", "slurm.nodes=1", "slurm.tasks_per_node=2"]


def test_a_nanogpt_shaped_loop_stopped_three_times_at_2x2_ends_bit_identical(tmp_path: Path) -> None:
    """Rank 0 evaluates the DDP model alone before the first step (this hung: the bucket-settling hook was spent
    on that eval forward); each rank's prefetched batch, counter and un-wrapped probe module come back to that
    rank (they came back as one rank's copy); the loss is logged as a 0-d tensor (it killed the job)."""
    stopped = submit(*NANO, f"run_dir={tmp_path / 'stopped'}", "--preempt-at", "3,8", "--timeout-at", "13")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    straight = submit(*NANO, f"run_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert [a["reason"] for a in read_attempts(tmp_path / "stopped")] == ["preemption", "preemption", "timeout",
                                                                          "finished"]
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 18
    ends = done(tmp_path / "stopped"), done(tmp_path / "straight")
    assert ends[0]["params_sha256"] == ends[1]["params_sha256"]
    assert ends[0]["per_rank"] == ends[1]["per_rank"]  # every rank's counter and probe, rank by rank
    assert len({json.dumps(r) for r in ends[1]["per_rank"]}) == 4  # and they do differ by rank


def test_per_rank_state_at_another_world_size_is_refused_and_so_is_a_changed_global_batch(tmp_path: Path) -> None:
    run_dir = tmp_path / "elastic"
    first = submit(*NANO, f"run_dir={run_dir}", "--preempt-at", "3", "slurm.max_preemptions=0")
    # at 4, or 5 when the signal lands during that boundary (as the quickstart says)
    assert first.returncode != 0 and re.search(r"STOPPED at step [45] ", first.stdout), first.stdout[-2000:]
    # a loop's global batch would change (train.global_batch_size unset): refused on the login node, as for a task
    batch = submit(*NANO, f"run_dir={run_dir}", "--resume", "slurm.nodes=1", "slurm.max_preemptions=1")
    assert batch.returncode == 2 and "train.global_batch_size=32" in batch.stderr, batch.stderr[-2000:]
    assert len(read_attempts(run_dir)) == 1
    # with the batch kept, the per-rank state has no owner at 2 ranks: the snapshot's manifest says so, so the
    # login node refuses it before config.yaml is rewritten (every rank refused it once the allocation came)
    config = (run_dir / "config.yaml").read_bytes()
    ranks = submit(*NANO, f"run_dir={run_dir}", "--resume", "slurm.nodes=1", "train.global_batch_size=32",
                   "train.grad_accum=1", "slurm.max_preemptions=1")
    assert ranks.returncode == 2, ranks.stderr[-3000:]
    assert "was written by 4 ranks, and the per-rank state 'batch'" in ranks.stderr, ranks.stderr
    assert "elastic='fresh'" in ranks.stderr and "resume at 4 ranks" in ranks.stderr
    assert [a["reason"] for a in read_attempts(run_dir)] == ["preemption"]
    assert (run_dir / "config.yaml").read_bytes() == config


def test_a_shrink_that_per_rank_state_refuses_is_a_failure_and_the_requeue_finishes_the_run(tmp_path: Path) -> None:
    """slurm.nodes=1-2 and a node lost: the batch shell healed by shrinking to one node, every rank refused the
    per-rank state at 2 ranks with exit 2 (an `error`, never requeued) and the run ended. Every manifest now says
    the run refuses a resize (the healer then never shrinks it); where a shrink happens all the same (here: a
    snapshot from before manifests said so), the refusal is `failed`, and the requeue gets both nodes back."""
    run_dir = tmp_path / "shrunk"
    ranged = [*NANO, f"run_dir={run_dir}", "slurm.nodes=1-2", "train.global_batch_size=32", "train.grad_accum=1"]
    first = submit(*ranged, "--preempt-at", "3", "slurm.max_preemptions=0")
    assert read_attempts(run_dir)[0]["reason"] == "preemption", first.stderr[-3000:]
    assert "'batch', 'counters', 'probe'" in str(snapshot_steps.refuses_resize(run_dir))  # what the healer reads
    for step in committed_steps(run_dir):  # as an hpc_ddp from before wrote them
        manifest = snapshot.step_dir(run_dir, step) / snapshot.MANIFEST
        manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items()
                                        if k != snapshot_steps.REFUSES_RESIZE}))
    # snapshot.jit=false: the survivors' snapshot of step 6 would be a manifest of today, which says it refuses
    proc = submit(*ranged, "--resume", "slurm.max_preemptions=1", "slurm.max_failures=1", "--fail-at", "6",
                  "snapshot.jit=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a.get("in_job", 0), a.get("world_size")) for a in attempts][1:] == [
        ("failed", 0, None), ("failed", 1, 2), ("finished", 0, 4)], attempts
    refused = attempts[2]
    assert refused["exit_code"] == 1 and "cannot restore the per-rank state 'batch'" in refused["resize_refused"]
    assert "recorded as failed, not as a configuration error" in refused["message"]
    assert done(run_dir)["step"] == 18


def test_replicated_state_that_differs_by_rank_is_refused_before_any_snapshot_is_committed(tmp_path: Path) -> None:
    """A dict of per-rank values tracked as replicated; the DDP model's BatchNorm statistics (different on each rank
    after a step) are not a mismatch: DDP's next forward would broadcast rank 0's, and the snapshot holds those."""
    run_dir = tmp_path / "differs"
    proc = submit(*SMALL, f"train.loop={LOOPS}:replicated_differs", f"run_dir={run_dir}", "snapshot.every_steps=3",
                  "slurm.max_failures=2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "'stats' is tracked as replicated but differs between ranks (first at rank_loss: ranks [1]" in proc.stderr
    assert "run.resume(stats=hpc_ddp.per_rank(stats))" in proc.stderr
    assert committed_steps(run_dir) == []
    assert [a["reason"] for a in read_attempts(run_dir)] == ["error"]  # once: a requeue would fail the same way


def test_sampler_misuse_is_a_usage_error_recorded_once_and_never_requeued(tmp_path: Path) -> None:
    """A plain ValueError before: exit 1, the traceback twice, requeued under max_failures. (torch's
    DistributedSampler given to run.resume raises the same kind of error: test_run_api.)"""
    message, fix = "sampler.iterate(loader) needs a DataLoader built with sampler=this sampler", "sampler=sampler"
    run_dir = tmp_path / "wrong_loader"
    proc = submit(*SMALL, f"train.loop={LOOPS}:wrong_loader", f"run_dir={run_dir}", "slurm.max_failures=3")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and fix in proc.stderr
    assert proc.stderr.count(message) <= 2 and "Traceback" not in proc.stderr  # rank 0's error, rank 1's once
    assert [a["reason"] for a in read_attempts(run_dir)] == ["error"]
    assert "max_failures" not in proc.stderr


def test_a_stop_that_the_loop_never_acts_on_fails_the_rehearsal_and_the_ledger_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "deaf"
    proc = submit(*SMALL, f"train.loop={LOOPS}:never_calls_boundary", f"run_dir={run_dir}", "--preempt-at", "0")
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "FAILED: SIGTERM was sent but never acted on" in proc.stdout
    assert "HINT: call `if run.boundary(step): return`" in proc.stderr
    last = read_attempts(run_dir)[-1]
    assert last["stop_ignored"] == "SIGTERM" and "never called run.boundary" in last["note"]
    # a stop at a later step is never even sent: the loop reports no step (a newcomer's run said "finished")
    later = submit(*SMALL, f"train.loop={LOOPS}:never_calls_boundary", f"run_dir={tmp_path / 'later'}",
                   "--preempt-at", "5")
    assert later.returncode == 1 and "--preempt-at 5 never fired: rank 0 reported no step after the start" in \
        later.stderr


def test_the_own_loop_docs_diff_stops_at_max_steps() -> None:
    """The diff in docs/own-loop.md, read as a loop: the step count is checked where the step is counted, not
    only at the end of an epoch (copied literally with max_steps=40 it ran to step 64)."""
    text = (ROOT / "docs" / "own-loop.md").read_text()
    diff = text[text.index("```diff"):text.index("```", text.index("```diff") + 7)]
    new = [line[1:] for line in diff.splitlines()[1:] if not line.startswith("-")]
    body = new[next(i for i, line in enumerate(new) if "sampler.iterate(loader)" in line):]
    assert any("max_steps" in line and ("break" in line or "return" in line) for line in body) or any(
        "max_steps" in a and ("break" in b or "return" in b) for a, b in zip(body, body[1:])), "\n".join(body)
