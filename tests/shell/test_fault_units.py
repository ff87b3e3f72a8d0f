"""Pure parts of the fault handling: the watchdog's verdict, the run-dir lock, settling an attempt,
tampered snapshots, and hygiene (permissions, secrets, no user code on the login node)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir import snapshot
from hpc_ddp.rundir.snapshot import verify as snapshot_verify, write as snapshot_write
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.rundir.runlock import LOCK, RunLockedError, acquire, holder_alive, holder_record, release
from hpc_ddp.shell.settle import pick_config, settle
from hpc_ddp.rank.watch.watchdog import UNREADABLE, Position, Watchdog, describe_hang, laggards, never_entered, verdict

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"max_timeouts": 5, "max_preemptions": 5, "max_failures": 1}


class FakeStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def test_the_ranks_behind_are_the_stuck_ones() -> None:
    assert laggards([(7, "backward"), (7, "backward"), (7, "forward"), (7, "backward")]) == [2]
    assert laggards([(8, "data"), (7, "boundary"), (8, "data")]) == [1]
    assert laggards([(3, "backward")] * 4) == []  # all at one place: a collective itself hangs
    assert laggards([(3, "backward"), None]) == [1]  # never beat at all
    message = describe_hang(0, 30, [(7, "backward"), (7, "forward")])
    assert "Stuck: rank 1 at step 7 forward" in message and "HINT" in message
    assert "a collective itself is stuck" in describe_hang(0, 30, [(3, "backward")] * 2)


def test_watchdog_fires_once_the_beat_is_older_than_the_timeout() -> None:
    now = [100.0]
    store, fired = FakeStore(), []
    other = Watchdog(10, 1, 2, store=store, clock=lambda: now[0], collectives=None)
    other.beat(5, "backward")
    other.check()  # publishes rank 1's beat
    dog = Watchdog(10, 0, 2, store=store, clock=lambda: now[0], stream=io.StringIO(), collectives=None,
                   on_hang=lambda message, stuck: fired.append((message, stuck)))
    dog.beat(5, "forward")
    now[0] += 9
    assert dog.check() is False and fired == []
    now[0] += 2
    assert dog.check() is False  # rank 1 has not been waiting as far as its published position says
    assert other.check() is False  # now it has: its final position, and it waits for rank 0's verdict
    assert dog.check() is True
    assert fired[0][1] == [0] and "Stuck: rank 0 at step 5 forward" in fired[0][0]
    assert store.data["hpc_ddp/beat/0"] == b"5:forward:final:{}"  # where rank 0 stays: rank 1 is past it


def test_rank_0_names_the_stuck_rank_from_final_positions_whatever_the_timing() -> None:
    """Who is stuck must not depend on which rank's thread looked first or published last (test_heal_slurm (d)
    recorded stuck_ranks [] on a busy machine): a rank that looks behind is named once its position is final and the
    ranks ahead of it are final too (they wait for it)."""
    def final(step: int, phase: str, issued: dict[str, int] | None = None) -> Position:
        return Position(step, phase, True, issued)

    # rank 1 sleeps in step 23's forward; the others wait in its backward all-reduce (rank 2's final position is
    # published at its next poll: rank 0 waits for it)
    assert verdict([final(23, "backward"), final(23, "forward"), Position(23, "backward")], 5.5, 5) is None
    # rank 2's thread has not published its newest beat yet: it looks behind, so rank 0 waits for its final one
    assert verdict([final(23, "backward"), final(23, "forward"), Position(23, "data")], 5.5, 5) is None
    assert verdict([final(23, "backward"), final(23, "forward"), final(23, "backward")], 6, 5) == [1]
    assert verdict([final(9, "forward"), final(9, "backward")], 5.5, 5) == [0]  # rank 0 is the one stuck
    # a CI run of 2026-11-27: a heal's rank 0 spent 5.5 s (> dist.timeout_s=5) in its start-up, the others passed the last
    # collective of the restore and beat the step after it a moment before rank 0 would; rank 0 named itself stuck
    # (twice, and the run failed). A rank ahead that is not quiet waits for nobody yet: no verdict
    assert verdict([final(0, "start"), Position(40, "finish"), Position(23, "data")], 5.5, 5) is None
    assert verdict([final(0, "start"), final(23, "data"), final(23, "data")], 5.5, 5) == [0]  # they wait: named
    assert verdict([final(0, "start"), Position(23, "data")], 10, 5) == [0]  # no progress for twice the timeout
    assert verdict([final(5, "backward"), UNREADABLE, final(5, "forward")], 5.5, 5) == [2]  # the store went away
    # every rank at one place (a slow start-up, a snapshot write): said only after twice the timeout
    assert verdict([final(0, "start")] * 3, 6, 5) is None and verdict([final(0, "start")] * 3, 10, 5) == []
    # an own loop beats at its boundaries only: the phases are alike, the flight recorder says who never entered
    alike = [final(7, "snapshot", {"0": 40}), final(7, "snapshot", {"0": 39}), final(7, "snapshot", {"0": 40, "1": 3})]
    assert verdict(alike, 5.5, 5) == [1]
    assert never_entered({0: {"0": 4, "2": 1}, 1: {"0": 4}, 2: {"0": 4, "2": 0}}) == [2]
    assert Position.decode(final(7, "snapshot", {"0": 40}).encode()) == final(7, "snapshot", {"0": 40})
    assert Position.decode("5:forward") == Position(5, "forward")


def test_a_start_up_every_rank_is_slow_in_is_no_hang_and_a_quiet_rank_waits_for_rank_0() -> None:
    """Rank 0's watchdog fired at (step 0, start) while DDP imported torch._dynamo (no one stuck: stuck_ranks []);
    and a stuck rank exited after a fixed 2 x poll + 2 s, so a rank 0 slower than that recorded a failure."""
    import threading

    now, store, fired = [0.0], FakeStore(), []
    dogs = [Watchdog(5, rank, 2, store=store, clock=lambda: now[0], stream=io.StringIO(), collectives=None,
                     poll_s=0.01, on_hang=lambda message, stuck, rank=rank: fired.append((rank, stuck, message)))
            for rank in range(2)]
    now[0] = 6  # both still at (0, start) after the timeout: every rank is slow there
    assert not dogs[1].check() and not dogs[0].check() and fired == []
    for dog in dogs:
        dog.beat(1, "data")  # it was a slow start-up
    now[0] = 9
    assert not dogs[0].check() and not dogs[1].check()
    dogs[1].beat(17, "forward")  # rank 1 stops in its forward; rank 0 waits in the backward all-reduce
    dogs[0].beat(17, "backward")
    now[0] = 14.5
    assert not dogs[1].check()  # quiet first: it says where it stays and waits for rank 0's verdict
    other = threading.Thread(target=dogs[1]._run)  # rank 1's thread: it fires once rank 0's verdict is out
    other.start()
    assert dogs[0].check()
    other.join()
    assert sorted((rank, stuck) for rank, stuck, _ in fired) == [(0, [1]), (1, [1])]
    assert all("Stuck: rank 1 at step 17 forward" in message for _, _, message in fired)


def test_the_lock_names_a_live_holder_and_is_taken_over_from_a_dead_one(tmp_path: Path) -> None:
    first = holder_record("100", local=False, pid=11, host="n1", now=0)
    acquire(tmp_path, first, alive=lambda h: True)
    second = holder_record("200", local=False, pid=22, host="n2")
    with pytest.raises(RunLockedError) as info:
        acquire(tmp_path, second, alive=lambda h: True)
    assert "is in use by job 100 (host n1, pid 11" in str(info.value) and info.value.key == "run_dir"
    assert f"delete {tmp_path / LOCK}" in str(info.value)
    acquire(tmp_path, second, alive=lambda h: False)  # job 100 is gone: take over
    assert json.loads((tmp_path / LOCK).read_text())["job"] == "200"
    release(tmp_path, first)  # not the holder any more: nothing happens
    assert (tmp_path / LOCK).exists()
    acquire(tmp_path, holder_record("200", local=False, pid=33), alive=lambda h: True)  # the same job, requeued
    release(tmp_path, holder_record("200", local=False, pid=33))
    assert not (tmp_path / LOCK).exists()


def test_a_local_holder_is_alive_while_its_process_is() -> None:
    assert holder_alive(holder_record("1", local=True, pid=os.getpid()))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not holder_alive(holder_record("1", local=True, pid=dead.pid))


def test_settles_line_says_how_far_a_silently_killed_run_got_and_from_what(tmp_path: Path) -> None:
    """A rank SIGKILLed at step ~60 left `"last_step": null` (issue 27): the newest committed snapshot was the
    only source, and a run that had none yet said nothing though its metrics knew."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 50, "loss": 1.0}\n{"step": 60, "loss": 0.9}\n{"step": 7')
    settle(tmp_path, job_id=7, restart_count=0, exit_code=137, limits=LIMITS, requeue_job=None, now=5.0)
    [line] = read_attempts(tmp_path)
    assert (line["last_step"], line["last_step_from"], line["snapshot"]) == (60, "metrics.jsonl", None)


def test_settle_records_a_silent_failure_once_and_requeues_under_the_cap(tmp_path: Path) -> None:
    calls: list[int] = []
    outcome = settle(tmp_path, job_id=7, restart_count=0, exit_code=137, limits=LIMITS,
                     requeue_job=lambda: calls.append(1), now=5.0)
    assert "requeued" in outcome and calls == [1]
    assert read_attempts(tmp_path) == [{"job_id": 7, "restart_count": 0, "reason": "failed", "exit_code": 137,
                                        "end": 5.0, "last_step": None, "last_step_from": None, "snapshot": None,
                                        "capped": False}]
    settle(tmp_path, job_id=7, restart_count=0, exit_code=137, limits=LIMITS, requeue_job=lambda: calls.append(1))
    assert len(read_attempts(tmp_path)) == 1  # idempotent (but a failure it already knows is requeued again)
    outcome = settle(tmp_path, job_id=7, restart_count=1, exit_code=1, limits=LIMITS, requeue_job=calls.clear)
    assert "not requeued" in outcome and "more than slurm.max_failures=1" in outcome and calls == [1, 1]


def test_settle_leaves_what_the_workers_recorded_and_a_locked_out_job_alone(tmp_path: Path) -> None:
    (tmp_path / "attempts.jsonl").write_text(json.dumps({"job_id": 7, "restart_count": 0,
                                                         "reason": "timeout"}) + "\n")
    assert "recorded by the workers: timeout" in settle(tmp_path, job_id=7, restart_count=0, exit_code=0,
                                                         limits=LIMITS, requeue_job=None)
    assert "another job holds the run dir" in settle(tmp_path, job_id=8, restart_count=0, exit_code=5,
                                                     limits=LIMITS, requeue_job=None)
    assert len(read_attempts(tmp_path)) == 1


def test_array_elements_settle_their_own_config() -> None:
    assert pick_config(["a.yaml", "b.yaml"], {"SLURM_ARRAY_TASK_ID": "1"}) == "b.yaml"
    assert pick_config(["a.yaml"], {}) == "a.yaml"


def _commit_bytes(run_dir: Path, step: int, data: bytes) -> Path:
    directory = snapshot.step_dir(run_dir, step)
    directory.mkdir(parents=True)
    path = directory / snapshot.node_file_name(0)
    path.write_bytes(data)
    snapshot.commit(directory, step, [{"name": path.name, "size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}], 1, "x")
    return path


def test_altered_bytes_fall_back_to_the_previous_step_then_fail_naming_the_file(tmp_path: Path) -> None:
    older = _commit_bytes(tmp_path, 10, b"a" * 64)
    newer = _commit_bytes(tmp_path, 20, b"b" * 64)
    newer.write_bytes(b"b" * 63 + b"c")  # same size, one byte changed
    assert snapshot.choose(tmp_path).step == 10  # type: ignore[union-attr]
    older.write_bytes(b"x" * 64)
    with pytest.raises(snapshot.SnapshotError) as info:
        snapshot.choose(tmp_path)
    assert f"{newer} (sha256 differs from the manifest)" in str(info.value) and str(older) in str(info.value)
    assert "move" in str(info.value) and "snapshots" in str(info.value)


def test_files_are_created_with_the_umask_and_never_world_writable(tmp_path: Path) -> None:
    code = ("import os, sys; os.umask(int(sys.argv[2], 8)); from pathlib import Path\n"
            "from hpc_ddp.core.atomic import write_atomic; from hpc_ddp.rundir.runlock import acquire, holder_record\n"
            "from hpc_ddp.core.config import load_config, save_config\n"
            "d = Path(sys.argv[1]); save_config(load_config([], ['name=u', 'train.task=a:B', 'train.max_steps=1']),"
            " d / 'run' / 'config.yaml'); write_atomic(d / 'run' / 'f', b'x')\n"
            "acquire(d / 'run', holder_record('1', local=True))\n")
    for umask, expected in (("022", 0o644), ("077", 0o600)):
        target = tmp_path / umask
        subprocess.run([sys.executable, "-c", code, str(target), umask], check=True, cwd=ROOT)
        for path in (target / "run" / "config.yaml", target / "run" / "f", target / "run" / LOCK):
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == expected, (path, oct(mode))
        assert not stat.S_IMODE((target / "run").stat().st_mode) & stat.S_IWOTH


def test_the_login_node_path_never_runs_the_task_module(tmp_path: Path) -> None:
    (tmp_path / "evilpkg").mkdir()
    marker = tmp_path / "ran"
    (tmp_path / "evilpkg" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "evilpkg" / "task.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass T: ...\n")
    (tmp_path / "c.yaml").write_text(f"train: {{task: 'evilpkg.task:T', max_steps: 1}}\nrun_dir: {tmp_path}/r\n")
    for args in (["--dry-run"], ["--emit-sbatch", str(tmp_path / "job.sbatch")], ["--dry-run", "--multirun",
                                                                                 "train.lr=1,2"]):
        proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", str(tmp_path / "c.yaml"), *args],
                              cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert not marker.exists()


def test_each_slice_has_a_digest_of_its_own_and_a_changed_byte_is_named_where_it_is(tmp_path: Path) -> None:
    """Issue 45: a node file's manifest entry carries a digest per slice (over its pieces, found in torch.save's
    stream by their memory) and one of the rest; a resume checks the size first and hashes only what it reads.
    A piece torch had to copy first (here a view of a larger tensor, saved whole) is covered by the rest."""
    import torch

    from hpc_ddp.rundir import slicing

    state = {"model": {"w": torch.randn(600_000), "b": torch.randn(10), "empty": torch.empty(0)},
             "optimizer": {"step": 3, "m": torch.randn(300_000)}}
    content, layout, held = slicing.node_content(state, 0, 2, 2, {0: {"seed": torch.arange(5)}})
    entry = snapshot_write.write_node_file(tmp_path, 0, content, split=layout)
    path, digests = tmp_path / entry["name"], entry["digests"]
    assert set(digests["slices"]) == {"0", "1"} and "sha256" not in entry
    assert snapshot_verify.file_problem(tmp_path, path.name, entry) is None
    assert sorted(i for i, *_ in digests["spans"]) == sorted(content["pieces"])  # every piece found in the stream
    for slice_, bit in ((0, 5), (1, 7)):
        offset = next(o + n // 2 for _, o, n, s in digests["spans"] if s == slice_ and n)
        data = bytearray(path.read_bytes())
        data[offset] ^= 1 << bit
        path.write_bytes(bytes(data))
        assert snapshot_verify.file_problem(tmp_path, path.name, entry) == f"sha256 of slice {slice_} differs from the manifest"
        assert snapshot_verify.file_problem(tmp_path, path.name, entry, deep=False) is None  # same size: the reader's job
        assert snapshot_verify.rest_problem(path, entry) is None
        data[offset] ^= 1 << bit
        path.write_bytes(bytes(data))
    data = bytearray(path.read_bytes())
    data[40] ^= 1  # inside the zip's first record, outside every piece
    path.write_bytes(bytes(data))
    assert "outside the state's pieces" in (snapshot_verify.rest_problem(path, entry) or "")
    pieces = {0: torch.arange(10.0)[2:8]}  # a view: torch.save writes its whole storage, from a copy
    entry = snapshot_write.write_node_file(tmp_path, 1, {"pieces": pieces}, split={"pieces": [[0, 0, 6, 0]]})
    assert entry["digests"]["spans"] == [] and entry["digests"]["slices"] == {}
    assert snapshot_verify.file_problem(tmp_path, entry["name"], entry) is None
    assert snapshot_verify.slice_problem(entry, 0, ["00" * 32]) is None  # in the rest: verified with it


def test_a_finished_runs_job_still_listed_is_said_to_be_ending(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm lists the job for a moment after DONE.json: submit refuses (the batch script still runs) and says
    why, not "wait for it, or cancel it" as for a run still training."""
    from hpc_ddp.core import slurm_jobs
    from hpc_ddp.login.guards import live_holder

    (tmp_path / "job.json").write_text(json.dumps({"job_id": 49}))
    monkeypatch.setattr(slurm_jobs, "job_state", lambda spec: "RUNNING" if spec == "49" else None)
    assert live_holder(tmp_path) == ("job 49 (RUNNING)", "wait for it, or cancel it: scancel 49")
    (tmp_path / "DONE.json").write_text("{}")
    who, hint = live_holder(tmp_path)
    assert who.startswith("job 49 (RUNNING: its run has finished") and "try again in a few seconds" in hint


def test_one_commit_per_attempt_and_the_batch_shell_seals_it_when_the_step_ended(tmp_path: Path) -> None:
    """Fencing (issue 55): the survivors' commit takes the attempt's one commit claim, exclusively; a second
    survivor (the other side of a partition) cannot commit in that attempt. Once the step ended the batch shell
    seals every failed attempt, so a process of it that wakes up later never commits into a run gone on."""
    from hpc_ddp.rundir import jit_claims, jit_files

    committed = jit_files.folder(tmp_path, 7, 0)
    assert jit_claims.claim_commit(committed, 22) and not jit_claims.claim_commit(committed, 22)
    assert jit_claims.seal(committed) == "step 22"  # the batch shell finds the survivors' commit
    settle(tmp_path, job_id=8, restart_count=0, exit_code=137, limits=LIMITS, requeue_job=None, now=5.0)
    late = jit_files.folder(tmp_path, 8, 0)
    assert (late / jit_claims.COMMIT_CLAIM).read_text() == "sealed\n"
    assert not jit_claims.claim_commit(late, 30)  # a late survivor of job 8's attempt commits nothing
    settle(tmp_path, job_id=9, restart_count=0, exit_code=0, limits=LIMITS, requeue_job=None, now=5.0)
    assert not jit_files.folder(tmp_path, 9, 0).exists()  # a clean step leaves no folder behind


def test_tasks_that_found_no_job_refuse_each_others_lock(tmp_path: Path) -> None:
    """Issue 57: a container with --cleanenv hides every SLURM_* variable; each task is rank 0 of a world of
    one and names job "None". The second no longer takes the first's lock over as "our own job, requeued" (N
    trainings wrote one run dir): refused while the first lives, taken over once it is gone."""
    first = holder_record("None", local=False, pid=os.getpid())
    acquire(tmp_path, first)
    with pytest.raises(RunLockedError, match="is in use by job None"):
        acquire(tmp_path, holder_record("None", local=False, pid=os.getpid() + 1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK).unlink()
    acquire(tmp_path, holder_record("None", local=False, pid=dead.pid))
    acquire(tmp_path, holder_record("None", local=False, pid=os.getpid()))  # its holder is gone: taken over
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()


def test_settle_adds_to_a_hung_line_how_far_it_got_and_the_survivors_snapshot_committed_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 57: rank 0's hung line is written as its watchdog fires; status showed "-" for its steps, and "no
    survivors' snapshot" stayed after another survivor committed one. Settle amends both once the step ended."""
    from hpc_ddp.rundir import losses
    from hpc_ddp.rundir.ledger import append_attempt

    (tmp_path / "metrics.jsonl").write_text('{"step": 16, "loss": 1.0}\n{"step": 17, "loss": 0.9}\n')
    append_attempt(tmp_path, {"job_id": 7, "restart_count": 0, "reason": "hung", "end": 1.0, "stuck_ranks": [1],
                              "jit_fallback": "no survivor had written a state file yet"})
    committed = {"jit_snapshot": {"step": 17, "writer": 0, "host": "n1", "took_s": 0.5}}
    monkeypatch.setattr(losses, "jit_fields", lambda *args, **kw: committed)  # the commit that came after
    outcome = settle(tmp_path, job_id=7, restart_count=0, exit_code=4, limits=LIMITS, requeue_job=None)
    assert outcome.startswith("hung")
    [line] = read_attempts(tmp_path)
    assert (line["last_step"], line["last_step_from"]) == (17, "metrics.jsonl")
    assert line["jit_snapshot"]["step"] == 17 and line["jit_fallback"] is None


def test_a_chained_job_takes_the_lock_over_from_the_job_it_was_chained_from(tmp_path: Path) -> None:
    """Issue 57: afterany lets the chained job start while its predecessor is still COMPLETING, its lock not
    yet released: the chained job takes it over (any other live job's lock still refuses it)."""
    acquire(tmp_path, holder_record("100", local=False, pid=11, host="n1"), alive=lambda h: True)
    with pytest.raises(RunLockedError):
        acquire(tmp_path, holder_record("101", local=False, pid=22), alive=lambda h: True, predecessor="99")
    acquire(tmp_path, holder_record("101", local=False, pid=22), alive=lambda h: True, predecessor="100")
    assert json.loads((tmp_path / LOCK).read_text())["job"] == "101"
