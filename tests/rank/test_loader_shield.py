"""Issue 43: a stop reaches every process of the step, and the loader workers outlive it.

Real DataLoader workers in the three multiprocessing contexts, signalled as Slurm signals a step (every
process, the workers first); the pure pieces as tables."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_ddp.core.stopping import StopFlag
from hpc_ddp.rank.stop import shield as loader_shield
from hpc_ddp.rank.stop.broken_step import child_killed, pipe_broke, stop_came_first
from hpc_ddp.rank.stop.child_deaths import ChildDeaths

ROOT = Path(__file__).resolve().parents[2]


def test_the_stop_signals_are_term_int_usr2_and_the_runs_warning_signal() -> None:
    base = [signal.SIGINT, signal.SIGUSR2, signal.SIGTERM]
    assert loader_shield.stop_signals({}) == sorted(base)
    assert loader_shield.stop_signals({loader_shield.STOP_SIGNALS_VAR: "URG"}) == sorted([*base, signal.SIGURG])
    assert loader_shield.stop_signals({loader_shield.STOP_SIGNALS_VAR: "SIGUSR2,NOPE,KILL"}) == sorted(base)


def test_sigign_is_read_from_proc_status(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "status").write_text("Name:\tpython\nSigIgn:\t0000000000004002\n")  # SIGINT and SIGTERM
    assert loader_shield.ignores(7, signal.SIGTERM, tmp_path) is True
    assert loader_shield.ignores(7, signal.SIGINT, tmp_path) is True
    assert loader_shield.ignores(7, signal.SIGUSR2, tmp_path) is False
    assert loader_shield.ignores(8, signal.SIGTERM, tmp_path) is None


def test_the_scontrol_a_stop_asks_outlives_the_steps_sigterm() -> None:
    """Rank 0 asks Slurm why a SIGTERM came (scontrol show job) while srun may be ending the step with a SIGTERM
    to every process in it: the child starts with the stop signals blocked, and this process's mask is restored."""
    from hpc_ddp.rank.attempt.conclude import _shielded_run

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    asks = ("import os, signal; os.kill(os.getpid(), signal.SIGTERM); "
            "print([line for line in open('/proc/self/status') if line.startswith('SigBlk')][0])")
    proc = _shielded_run([sys.executable, "-c", asks], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc  # the TERM it sent itself stayed pending
    assert int(proc.stdout.split()[1], 16) & (1 << (signal.SIGTERM - 1))
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def _seen(worker_id: int) -> None:
    os.environ["SEEN_WORKER"] = str(worker_id)


def test_worker_init_pickles_and_calls_the_users_own_init_after_the_shield() -> None:
    init = pickle.loads(pickle.dumps(loader_shield.worker_init(_seen)))  # spawn and forkserver workers unpickle it
    assert repr(init).startswith("hpc_ddp.worker_init(<function _seen")
    old = {s: signal.getsignal(s) for s in loader_shield.stop_signals(os.environ)}
    try:
        init(3)
        assert os.environ.pop("SEEN_WORKER") == "3"
        assert all(signal.getsignal(s) == signal.SIG_IGN for s in old)
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


def test_a_stop_explains_a_childs_death_that_comes_first_within_the_wait() -> None:
    flag, now = StopFlag(), [0.0]
    died = RuntimeError("DataLoader worker (pid 12) is killed by signal: Terminated.")
    assert child_killed(died) and not child_killed(RuntimeError("CUDA out of memory"))
    # a loader's queue from a worker that died: its pipe broke (the ledger's child_killed, and the HINT, say so)
    assert pipe_broke(ConnectionResetError(104, "Connection reset by peer")) and pipe_broke(EOFError())
    assert not pipe_broke(RuntimeError("Connection reset by peer"))  # a peer's gloo socket is not a child's pipe

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] >= 0.5:
            flag._handle(signal.SIGTERM, None)  # the rank's own SIGTERM, half a second after its worker's
    assert stop_came_first(flag, died, wait_s=2.0, clock=lambda: now[0], sleep=sleep)
    assert 0.5 <= now[0] < 1.0
    quiet, now[0] = StopFlag(), 0.0
    assert not stop_came_first(quiet, died, wait_s=2.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert not stop_came_first(StopFlag(), RuntimeError("CUDA out of memory"), wait_s=2.0)  # no wait for an OOM


def test_a_peers_failed_collective_is_a_stop_only_when_a_peer_marked_its_step_broken_by_one(tmp_path: Path) -> None:
    """srun's --kill-on-bad-exit (and the rehearsal) SIGTERM the survivors of a lost rank: a failure, not a stop."""
    peer = RuntimeError("[../gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:4455")
    flag, mark = StopFlag(), tmp_path / "jit" / "stopped-mid-step"
    flag._handle(signal.SIGTERM, None)
    assert not stop_came_first(flag, peer, mark, wait_s=0.2)  # nobody marked: the peer died
    from hpc_ddp.rundir import jit_files

    jit_files.prepare_mark(mark)  # rank 0 made it before the rendezvous (issue 57: read by content, by name)
    assert not stop_came_first(flag, peer, mark, wait_s=0.2)
    assert stop_came_first(flag, RuntimeError("DataLoader worker (pid(s) 9) exited unexpectedly"), mark, wait_s=0.2)
    assert mark.exists() and stop_came_first(flag, peer, mark, wait_s=0.2)  # marked: the peer left for the stop
    assert stop_came_first(flag, EOFError(), tmp_path / "other", wait_s=0.2)  # the stop's signal came first


def test_rank_zero_whose_peer_stopped_before_its_own_signal_came_waits_for_it(tmp_path: Path) -> None:
    """Slurm signals node by node (2.5 s apart in a CI run): a peer's stop closed rank 0's collective before
    rank 0's SIGTERM came, and the stop lost its ledger line (the batch shell wrote a bare one). Rank 0 reads
    the mark and waits for its signal; the other survivors neither wait nor read the mark without their signal
    (a failure's run-dir work flat in the ranks), and a real failure (no mark) costs rank 0 no wait."""
    from hpc_ddp.rundir import jit_files

    peer = RuntimeError("[../gloo/pair.cc:553] Connection closed by peer [10.77.0.2]:17104")
    mark, now, reads = tmp_path / "jit" / "stopped-mid-step", [0.0], []
    jit_files.prepare_mark(mark)

    def marked(path: Path) -> bool:
        reads.append(path)
        return jit_files.marked(path)

    def waits(flag: StopFlag, signal_at: float | None, **kw: object) -> tuple[bool, float]:
        now[0] = 0.0

        def sleep(seconds: float) -> None:
            now[0] += seconds
            if signal_at is not None and now[0] >= signal_at:
                flag._handle(signal.SIGTERM, None)
        return stop_came_first(flag, peer, mark, wait_s=2.0, clock=lambda: now[0], sleep=sleep, marked=marked,
                               **kw), now[0]
    assert waits(StopFlag(), 0.3, writes_the_line=True) == (False, 0.0)  # nobody marked: a failure, no wait
    assert waits(StopFlag(), 0.3) == (False, 0.0) and len(reads) == 1  # another survivor: no read, no wait
    mark.write_text("broken by a stop signal\n")  # the peer's stop, written before its sockets closed
    stopped, waited = waits(StopFlag(), 0.3, writes_the_line=True)
    assert stopped and 0.3 <= waited < 0.4, waited
    stopped, waited = waits(StopFlag(), None, writes_the_line=True)
    assert not stopped and 2.0 <= waited < 2.1, waited  # no signal within the wait: a failure after all
    assert waits(StopFlag(), 0.3) == (False, 0.0) and len(reads) == 3  # without its signal a survivor goes on


def test_a_childs_death_is_held_to_the_boundary_and_passed_over_for_a_stop() -> None:
    """PyTorch's SIGCHLD handler raises wherever the rank is; from the first boundary ours only notes it."""
    calls: list[int] = []

    def torch_like(signum: int, frame: object) -> None:
        calls.append(signum)
        raise RuntimeError("DataLoader worker (pid 5) is killed by signal: Terminated.")
    old = signal.signal(signal.SIGCHLD, torch_like)
    try:
        flag = StopFlag()
        deaths = ChildDeaths(flag, lambda f, err: f.is_set)
        deaths.at_boundary()  # stands in for torch_like from now on
        subprocess.run(["true"], check=True)  # a child exits: SIGCHLD
        assert deaths.pending and not calls  # noted, not raised mid-step
        with pytest.raises(RuntimeError, match="killed by signal"):
            deaths.at_boundary()  # no stop: the death is a failure, raised at the boundary
        subprocess.run(["true"], check=True)
        flag._handle(signal.SIGTERM, None)
        deaths.at_boundary()  # a stop explains it: passed over
        assert len(calls) == 2 and signal.getsignal(signal.SIGCHLD) == deaths._noted
    finally:
        signal.signal(signal.SIGCHLD, old)


LOADER = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import hpc_ddp
    from tests.rank.test_loader_shield import Ready, Slow

    if __name__ == "__main__":
        import multiprocessing.forkserver
        from hpc_ddp.rank.stop.shield import FORKSERVER_PRELOAD, at_exit_kill_workers
        multiprocessing.forkserver.set_forkserver_preload(["torch", FORKSERVER_PRELOAD])  # as the session does
        context, shield, uncalled, folder = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4]
        got = []
        for signum in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            signal.signal(signum, lambda n, f: got.append(n))
        if uncalled:
            at_exit_kill_workers()  # as the session does
        init = (hpc_ddp.worker_init if uncalled else hpc_ddp.worker_init(Ready(folder))) if shield else None
        loader = torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=2, worker_init_fn=init,
                                             multiprocessing_context=None if context == "fork" else context)
        batches = iter(loader)
        next(batches)
        from hpc_ddp.rank.stop.shield import unshielded_workers
        while shield and (unshielded_workers() if uncalled else len(os.listdir(folder)) < 2):
            time.sleep(0.05)  # every worker ran its init (a spawn worker imports torch for seconds first)
        print("ready", flush=True)
        sys.stdin.readline()  # the test signals every process of this one's group, children first
        try:
            for _ in range(20):
                next(batches)
            print("delivered", sorted(got), flush=True)
        except Exception as err:
            print("broke", type(err).__name__, err, [(w.pid, w.exitcode) for w in batches._workers], flush=True)
""")


class Slow:
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> int:
        import time

        time.sleep(0.005)
        return index


class Ready:
    """A worker_init_fn of the user's (picklable): says that this worker's init ran, after hpc_ddp's shield."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        Path(self.folder, f"ready-{worker_id}").touch()


def _signalled_loader(context: str, shield: bool, uncalled: bool = False, folder: Path | None = None) -> str:
    """A DataLoader with two workers; once they run, SIGUSR2 then SIGTERM to every process of its group,
    the children first, as Slurm signals a step; what its next 20 batches did."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if uncalled:
        env[loader_shield.STOP_SIGNALS_VAR] = "USR2"  # as the session sets it for the rank's children
    proc = subprocess.Popen([sys.executable, "-c", LOADER, context, "1" if shield else "0", "1" if uncalled else "0",
                             str(folder)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        members = [int(p) for p in subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        for signum in (signal.SIGUSR2, signal.SIGTERM):
            for pid in sorted(members, key=lambda p: p == proc.pid):  # the workers and servers first, the rank last
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out.strip() + err[-2000:]


@pytest.mark.parametrize("context", ["fork", "forkserver", "spawn"])
def test_shielded_loader_workers_outlive_the_stop_signals_in_every_context(context: str, tmp_path: Path) -> None:
    assert _signalled_loader(context, shield=True, folder=tmp_path).startswith("delivered [12, 15]")


def test_worker_init_passed_uncalled_shields_the_worker_all_the_same() -> None:
    """A newcomer's `worker_init_fn=hpc_ddp.worker_init` (no parentheses): the loader calls it with the worker id;
    in a rank of a run (its session kills the workers at exit) it shields as well, elsewhere it says the fix."""
    assert _signalled_loader("spawn", shield=True, uncalled=True).startswith("delivered [12, 15]")
    from hpc_ddp.core.errors import UsageError

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(loader_shield.STOP_SIGNALS_VAR, raising=False)
        with pytest.raises(UsageError, match=r"worker_init_fn=hpc_ddp.worker_init\(\)"):
            loader_shield.worker_init(0)


def test_unshielded_fork_workers_die_of_slurms_sigterm() -> None:
    """What the shield is for: PyTorch's worker dies of a SIGTERM its parent did not send."""
    out = _signalled_loader("fork", shield=False)  # PyTorch's SIGCHLD handler raises wherever the process is
    assert not out.startswith("delivered") and "RuntimeError: DataLoader worker" in out.replace("broke RuntimeError",
                                                                                              "RuntimeError:"), out


# The newcomer's own loop (tests.tasks.loops:loader_workers) rehearsed as 2 nodes x 1 task
LOOP = ["examples/own_loop_gpt.yaml", "--local", "train.loop=tests.tasks.loops:loader_workers", "slurm.tasks_per_node=1",
        "train.grad_accum=1", "train.max_steps=30", "train.log_every=1", "snapshot.every_steps=10"]


def _rehearse(tmp_path: Path, name: str, loader: str, *extra: str) -> subprocess.CompletedProcess[str]:
    from tests.helpers import submit

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HPC_DDP_TEST_LOADER", loader)
        proc = submit(*LOOP, f"run_dir={tmp_path / name}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_the_rehearsals_stops_reach_the_loader_workers_and_cost_at_most_the_step_in_flight(tmp_path: Path) -> None:
    """--preempt-at and --timeout-at signal every process of a rank, as Slurm does. Unshielded fork workers die of
    the SIGTERM: the attempt is still a preemption that keeps the step every rank held, and the run ends
    bit-identical to one never stopped. Shielded spawn workers outlive both stops: a clean agreed stop, nothing
    in the ledger about a broken step."""
    from hpc_ddp.rundir.ledger import read_attempts
    from tests.helpers import assert_kept_the_step, done, losses

    straight = _rehearse(tmp_path, "straight", "fork")
    broken = _rehearse(tmp_path, "fork", "fork", "--preempt-at", "14")
    clean = _rehearse(tmp_path, "spawn", "spawn:shield", "--preempt-at", "14", "--timeout-at", "23")
    first = read_attempts(tmp_path / "fork")
    assert first[0]["reason"] == "preemption", first
    assert_kept_the_step(first[0], broken.stderr, 14)
    assert first[1]["resumed_from"] == first[0]["last_step"], first  # the stop's snapshot
    assert [a["reason"] for a in read_attempts(tmp_path / "spawn")] == ["preemption", "timeout", "finished"]
    assert not any("stopped_mid_step" in a for a in read_attempts(tmp_path / "spawn"))
    assert "sending SIGTERM to every rank" in clean.stderr and straight.returncode == 0
    for name in ("fork", "spawn"):
        assert losses(tmp_path / name) == losses(tmp_path / "straight")
        assert done(tmp_path / name)["params_sha256"] == done(tmp_path / "straight")["params_sha256"]


KILLED_RANK = textwrap.dedent("""
    import multiprocessing.forkserver, os, signal, sys
    import torch
    import hpc_ddp
    from hpc_ddp.rank.stop.shield import FORKSERVER_PRELOAD
    from tests.rank.test_loader_shield import Slow

    if __name__ == "__main__":
        multiprocessing.forkserver.set_forkserver_preload(["torch", FORKSERVER_PRELOAD])  # as the session does
        init = hpc_ddp.worker_init() if sys.argv[1] == "1" else None  # a user's own loader may have none
        loader = torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=2, worker_init_fn=init,
                                             multiprocessing_context="forkserver", persistent_workers=True)
        batches = iter(loader)
        next(batches)
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        print(server, *(w.pid for w in batches._workers), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the rank alone, as a fault or the OOM killer does
""")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped
    except (OSError, IndexError):
        return True


def test_a_killed_ranks_forkserver_and_loader_workers_end_with_it() -> None:
    """A rank killed with SIGKILL leaves its forkserver and loader workers behind, ignoring SIGTERM, unless they
    end by themselves: where Slurm tracks a step's processes by parent (proctrack/linuxproc, the local cluster)
    nothing else will. Each held the other alive before (the workers kept the server's alive pipe open). Two
    ranks side by side: one with hpc_ddp.worker_init(), one a user's own loader without it."""
    import time

    ranks = [subprocess.Popen([sys.executable, "-c", KILLED_RANK, shielded], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for shielded in ("1", "0")]
    pids: list[int] = []
    try:
        for rank in ranks:
            out, err = rank.communicate(timeout=120)
            assert rank.returncode == -signal.SIGKILL and len(out.split()) == 3, (out, err[-2000:])
            pids += [int(p) for p in out.split()]
        deadline = time.monotonic() + 60  # the server at once; a worker at its watchdog's next poll (5 s)
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in pids if not _gone(pid)] == [], f"left behind (server, worker, worker) x 2: {pids}"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_broken_stops_line_keeps_the_split_snapshot_another_node_commits_a_moment_later(tmp_path: Path) -> None:
    """Rank 0 wrote its share of step 21; the other node writes the last share and commits it after rank 0's
    offer (a CI run's ledger said "no snapshot" of a stop whose step 21 was committed then): rank 0 waits for
    newest.json to name it, within the bound; without a share of its own it does not wait."""
    from hpc_ddp.rank.stop.broken_step import kept_step
    from hpc_ddp.rundir import newest

    newest.create(tmp_path)
    now = [0.0]
    polls: list[float] = []

    def sleep(seconds: float) -> None:
        polls.append(now[0])
        now[0] += seconds
        if len(polls) == 3:
            newest.publish(tmp_path, 21)  # the other node's commit (its manifest: not on this node yet)

    offered = {"written": {"step": 21}}
    assert kept_step(tmp_path, offered, wait_s=2.0, clock=lambda: now[0], sleep=sleep) == 21
    assert len(polls) == 3
    polls.clear()
    assert kept_step(tmp_path / "other", {"outcome": "no source"}, clock=lambda: now[0], sleep=sleep) is None
    assert polls == []  # nothing written by this rank: nothing to wait for
    assert kept_step(tmp_path / "other", offered, wait_s=1.0, clock=lambda: now[0], sleep=sleep) is None
    assert 15 <= len(polls) <= 25  # bounded: the line is written without it
