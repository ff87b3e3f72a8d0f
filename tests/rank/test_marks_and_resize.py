"""Two faults that must not end a run by mistake: a wrapped script's stop and crash marks on a filesystem whose
directory listings are stale (NFS), and a resume at another world size refused by the run's state on an attempt
nobody asked for (an in-job restart on fewer nodes, a requeue)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.rank.state.restore import load_per_rank
from hpc_ddp.rundir import snapshot
from hpc_ddp.rundir.snapshot import steps as snapshot_steps
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.shell.settle import settle

LIMITS = {"max_timeouts": 5, "max_preemptions": 5, "max_failures": 1}


@pytest.fixture
def stale_listing(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Freeze a directory's listing as an NFS client caches it (acdirmin 30 s): files created afterwards are
    missing from os.listdir, os.scandir and so from glob; opening them by name still works."""
    frozen: dict[str, set[str]] = {}
    real_listdir, real_scandir = os.listdir, os.scandir

    class Stale:
        def __init__(self, entries: Any, names: set[str]) -> None:
            self.entries, self.names = entries, names

        def __enter__(self) -> Stale:
            return self

        def __exit__(self, *exc: object) -> None:
            self.entries.close()

        def __iter__(self) -> Any:
            return (e for e in self.entries if e.name in self.names)

        def close(self) -> None:
            self.entries.close()

    def listdir(path: Any = ".") -> list[str]:
        names = real_listdir(path)
        return [n for n in names if n in frozen[os.fspath(path)]] if os.fspath(path) in frozen else names

    def scandir(path: Any = ".") -> Any:
        entries = real_scandir(path)
        return Stale(entries, frozen[os.fspath(path)]) if os.fspath(path) in frozen else entries

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "scandir", scandir)
    return lambda directory: frozen.__setitem__(os.fspath(directory), set(real_listdir(directory)))


def script_attempt(run_dir: Path, rank: int, world: int = 2) -> Any:
    """A train.script attempt's view on one rank of a 2-node job (no process group: the worker has none)."""
    from hpc_ddp.core.config import load_config
    from hpc_ddp.core.stopping import StopFlag
    from hpc_ddp.rank.attempt.context import Attempt
    from hpc_ddp.core.slurm_env import from_environ, simulated_environ

    environ = {**simulated_environ(world, 1, job_id=7)[rank], "HPC_DDP_LOCAL": "1"}
    cfg = load_config([], ["name=marks", f"run_dir={run_dir}", "train.task=null", "train.script=train.py"])
    return Attempt(cfg, from_environ(environ), environ, StopFlag(), [], LIMITS)


def test_script_marks_are_found_by_name_when_the_directory_listing_is_stale(tmp_path: Path,
                                                                            stale_listing: Any) -> None:
    """On NFS a glob over errors/ may list it as it was up to 30 s ago: rank 1's stop mark was missed, so rank 0,
    whose script died of the stop first, recorded a crash (and the reverse). Marks are read by name now."""
    import signal

    from hpc_ddp.rank.script import outcome
    from hpc_ddp.rundir.ledger import crash_marker

    (tmp_path / "errors").mkdir()
    stale_listing(tmp_path / "errors")  # cached while the directory was still empty
    rank0, rank1 = script_attempt(tmp_path, 0), script_attempt(tmp_path, 1)
    for attempt in (rank0, rank1):
        outcome.prepare_marks(attempt)  # each worker, as its attempt starts
    assert os.listdir(tmp_path / "errors") == []  # the listing a glob would see
    assert outcome.crashes(rank0, wait_s=0) == [] and not outcome.stopped_late(rank0, 1, wait_s=0)
    rank1.flag._handle(signal.SIGTERM, None)
    outcome.mark_stop(rank1)  # rank 1 forwards the stop; rank 0's script dies of it before the signal comes
    rank0.flag._handle(signal.SIGTERM, None)
    assert outcome.stopped_late(rank0, 1, wait_s=0)
    outcome.mark_crash(rank1, Path("train.py"), 1)
    assert outcome.crashes(rank0, wait_s=0) == ["train.script train.py exited with code 1 on rank 1"]
    # the rehearsal's --fail-at notes a killed rank's crash by crash_marker(run_dir, job, restart, step, rank)
    crash_marker(tmp_path, 7, 0, 0, 0).write_text("node0 was lost (--fail-at): rank 0 was killed\n")
    assert outcome.crashes(rank1, wait_s=0)[0] == "node0 was lost (--fail-at): rank 0 was killed"
    half = crash_marker(tmp_path, 7, 0, 0, 1)
    half.write_text("train.script train.py exited wi")  # caught mid-write: not a mark yet
    assert outcome.read_mark(half) is None


def test_the_manifest_says_whether_the_run_may_resume_at_another_world_size(tmp_path: Path) -> None:
    """What the batch shell asks before it heals a failure with fewer nodes (no torch)."""
    import hpc_ddp
    from hpc_ddp.rank.state.tracked import resize_refusal

    assert snapshot_steps.refuses_resize(tmp_path) is None  # no snapshot: a fresh start runs at any size
    fixed = load_config([], ["name=x", "train.loop=a.b:c", "train.global_batch_size=32"]).train
    assert resize_refusal({}, fixed) is None
    assert resize_refusal({"rng": hpc_ddp.per_rank({}, elastic="fresh")}, fixed) is None
    refused = resize_refusal({"batch": hpc_ddp.per_rank({}), "rng": hpc_ddp.per_rank({}, elastic="fresh"),
                              "probe": hpc_ddp.per_rank({})}, fixed)
    assert refused is not None and "'batch', 'probe'" in refused and "'rng'" not in refused
    assert "global batch" in str(resize_refusal({}, load_config([], ["name=x", "train.loop=a.b:c"]).train))
    script = load_config([], ["name=x", "train.task=null", "train.script=t.py"]).train
    assert resize_refusal({}, script) is None  # a script sizes its own batch
    for step, reason in [(4, refused), (8, None), (12, refused)]:
        snapshot.step_dir(tmp_path, step).mkdir(parents=True)
        snapshot.commit(snapshot.step_dir(tmp_path, step), step, [], 4, "hash", refuses_resize=reason)
        assert snapshot_steps.refuses_resize(tmp_path) == reason  # the newest committed manifest decides


def load_config(paths: list[Path], overrides: list[str]) -> Any:
    from hpc_ddp.core.config import load_config as load

    return load(paths, overrides)


@pytest.mark.parametrize("environ,refused", [({}, "error"), ({"HPC_DDP_IN_JOB_RESTART": "1"}, "failed"),
                                             ({"SLURM_RESTART_COUNT": "2"}, "failed")])
def test_a_resize_refused_on_an_unattended_attempt_is_a_failure_not_an_error(
        tmp_path: Path, environ: dict[str, str], refused: str) -> None:
    """A shrink by the batch shell (or a requeue granted fewer nodes) that per-rank state refuses: the refusal was a
    configuration error (exit 2, never requeued) and the run ended; now rank 0 records `failed` with why (exit 1),
    and settle takes the requeue path. A person's --resume at another size stays an error."""
    import dataclasses

    import hpc_ddp
    import torch
    import torch.distributed as dist

    from hpc_ddp.rank.state.snapshot_load import Restored
    from hpc_ddp.rank.loop.run import Run
    from hpc_ddp.core.slurm_env import from_environ
    from hpc_ddp.rank.worker import _record

    cfg = load_config([], ["name=x", f"run_dir={tmp_path}", "train.loop=a.b:c"])
    env = dataclasses.replace(from_environ(environ), job_id=9)
    run = Run(cfg, env, torch.device("cpu"), checkpointer=None, stop=None)
    run.per_rank = {"batch": hpc_ddp.per_rank({"x": torch.ones(2)})}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(hpc_ddp.core.errors.HpcDdpError) as info:
            load_per_rank(run, None, Restored(step=4, state={"step": 4}, rng=None, config=None, world_size=2))
    finally:
        dist.destroy_process_group()
    err = info.value
    assert "cannot restore the per-rank state 'batch'" in str(err) and "elastic='fresh'" in str(err)
    assert err.retry_may_help is (refused == "failed")  # worker.main: exit 1 for a failure, 2 for an error
    _record(env, tmp_path, err)  # what the worker does with it
    [line] = read_attempts(tmp_path)
    assert line["reason"] == refused and (line["restart_count"], line.get("in_job", 0)) == (
        env.restart_count, env.in_job)
    if refused == "failed":
        assert "refused to resume at 1 ranks: recorded as failed" in line["message"] and line["snapshot"] == 4
        assert line["resize_refused"].startswith("cannot restore the per-rank state 'batch'")
        outcome = settle(tmp_path, job_id=9, restart_count=env.restart_count, exit_code=1, limits=LIMITS,
                         requeue_job=lambda: None, in_job=env.in_job)
        assert outcome == "failed; requeued (slurm.max_failures allows it)"
        assert len(read_attempts(tmp_path)) == 1  # the workers' line, not a second one


def test_a_stop_that_comes_as_the_script_exits_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop reached this worker in the same poll as its script's exit (the script died of a peer's stop
    a moment before): nothing was forwarded, and the log says why the script ended (seen in CI, torchrun).
    The script sends the stop and exits; the stop is held back (blocked) until the script has exited and let in
    between two polls, so the order is the one under test whatever the machine's load (a CI run polled between
    the script's kill and its exit, and forwarded the stop to it)."""
    import logging
    import signal
    import subprocess
    import sys
    import time

    from hpc_ddp.core.stopping import StopFlag
    from hpc_ddp.rank.script.child import supervise

    flag = StopFlag()
    cmd = [sys.executable, "-c", f"import os, signal; os.kill(os.getppid(), {int(signal.SIGUSR2)}); os._exit(3)"]
    started: list[subprocess.Popen[bytes]] = []
    popen, sleep = subprocess.Popen, time.sleep

    class Recorded(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    def between_polls(seconds: float) -> None:
        os.waitid(os.P_PID, started[0].pid, os.WEXITED | os.WNOWAIT)  # the script has exited (not reaped)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})  # its stop is let in now
        sleep(seconds)
    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setattr(time, "sleep", between_polls)
    flag.install([signal.SIGUSR2])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        with caplog.at_level(logging.INFO, logger="hpc_ddp.script"):
            code = supervise(cmd, os.environ, flag)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    assert code == 3 and flag.is_set
    said = [r.getMessage() for r in caplog.records]
    assert any("just before SIGUSR2 reached this rank (not forwarded" in m for m in said), said
