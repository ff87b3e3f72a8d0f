"""Liveness: a frozen rank or node is found in seconds (hpc_ddp.liveness).

The pure parts with a fake clock (the judge, the beat format, the reader, the config rules),
then real rehearsals: a node frozen with SIGSTOP ends the job within dist.liveness_s plus
seconds (for our Trainer and for a wrapped torchrun script, whose worker beats), and a
rank-0-only evaluation longer than dist.liveness_s is slow, not lost.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpc_ddp.rundir import beats, layout
from hpc_ddp.core import codes
from hpc_ddp.rank.watch import liveness, liveness_start
from hpc_ddp.rundir import losses
from hpc_ddp.core.config import load_config
from hpc_ddp.core.errors import ConfigError
from hpc_ddp.rank.watch.liveness import Beat, Judge, Liveness, decode, encode
from hpc_ddp.rank.watch.liveness_start import effective
from hpc_ddp.rundir.losses import lost_ranks
from hpc_ddp.rehearsal.local_inject import freeze_problem, unfired
from hpc_ddp.rundir.ledger import read_attempts
from tests.helpers import alive_with, wait_until
from tests.helpers import losses as logged_losses

ROOT = Path(__file__).resolve().parents[2]
LIVENESS_S = 3
# dist.timeout_s far above the test's own limit: a job that waited for the hang watchdog fails the test
SLOW = ["dist.timeout_s=3600", f"dist.liveness_s={LIVENESS_S}", "slurm.max_restarts_in_job=0"]
TEST_TIMEOUT_S = 300


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beat(count: int, left: bool = False, tag: str = "job-7-restart-0") -> Beat:
    return Beat(tag, 1, "node1", count, left)


# --- the judge: one watcher's view of one peer, by its own clock ---

def test_a_peer_that_stops_beating_is_lost_after_liveness_s_of_silence_and_not_before() -> None:
    judge = Judge(3.0)
    assert judge.observe(beat(1), 0.0) is None
    assert judge.observe(beat(2), 0.5) is None
    silences = [judge.observe(beat(2), 0.5 + 0.5 * i) for i in range(1, 7)]  # the counter stays at 2
    assert silences[:5] == [None] * 5 and silences[5] == pytest.approx(3.0)
    assert judge.last == beat(2)


def test_a_peer_that_beats_however_slowly_it_trains_is_never_lost() -> None:
    judge = Judge(3.0)
    assert all(judge.observe(beat(i), 0.5 * i) is None for i in range(1, 200))


def test_a_peer_that_has_not_beaten_yet_is_not_judged() -> None:
    judge = Judge(3.0)
    assert all(judge.observe(None, 0.5 * i) is None for i in range(200))


def test_a_peer_that_left_is_never_lost() -> None:
    judge = Judge(3.0)
    judge.observe(beat(1), 0.0)
    judge.observe(beat(2, left=True), 0.5)
    assert all(judge.observe(None, 0.5 * i) is None for i in range(2, 100)) and judge.left


def test_silence_the_watcher_could_not_watch_is_not_counted() -> None:
    """Its own thread starved, the file server stalled, or the job suspended: the window starts again."""
    judge = Judge(3.0)
    judge.observe(beat(1), 0.0)
    judge.observe(beat(1), 0.5)
    assert judge.observe(beat(1), 60.0) is None  # 59.5 s unwatched
    later = [judge.observe(beat(1), 60.0 + 0.5 * i) for i in range(1, 7)]  # watched again, every 0.5 s
    assert later[:5] == [None] * 5 and later[5] == pytest.approx(3.0)


def test_an_unreadable_beat_after_good_ones_is_silence_not_a_reset() -> None:
    judge = Judge(3.0)
    judge.observe(beat(5), 0.0)
    results = [judge.observe(None, 0.5 * i) for i in range(1, 7)]
    assert results[-1] == pytest.approx(3.0)


# --- the beat file ---

def test_beats_have_one_width_and_decode_only_for_their_attempt() -> None:
    raw = encode(Beat("job-7-restart-0", 3, "node1", 12, wall=1.5))
    assert len(raw) == beats.WIDTH == len(encode(Beat("job-7-restart-0", 3, "node1", 10**9, left=True)))
    assert decode(raw, "job-7-restart-0") == Beat("job-7-restart-0", 3, "node1", 12, False, 1.5)
    assert decode(raw, "job-7-restart-1") is None  # an older attempt's beat: not this attempt's peer
    assert decode(raw[:40], "job-7-restart-0") is None and decode(b"", "job-7-restart-0") is None
    # a longer beat written over a shorter one leaves nothing that matters: the first JSON object counts
    assert decode(raw + b"}garbage", "job-7-restart-0") == decode(raw, "job-7-restart-0")


def test_the_period_and_when_liveness_is_off() -> None:
    assert liveness.period(30) == 5 and liveness.period(1) == liveness.MIN_PERIOD_S
    assert effective(30, 600) == 30 and effective(3, 6) == 3
    assert effective(None, 600) is None and effective(0, 600) is None
    assert effective(30, 40) is None  # more than half of dist.timeout_s: the watchdog would speak first


def test_liveness_needs_no_torch() -> None:
    """The batch shell reads lost_ranks, and a train.script's worker beats: neither imports torch."""
    code = "import sys, hpc_ddp.liveness, hpc_ddp.rehearsal.local; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == \
        "False"


def test_the_host_is_the_slurm_node_name() -> None:
    assert liveness_start.host_of({"SLURMD_NODENAME": "gpu7"}, ("a", "b"), 1) == "gpu7"
    assert liveness_start.host_of({}, ("a", "b"), 1) == "b"


# --- two ranks in one process, with a fake clock: the I/O through the run dir ---

def pair(run_dir: Path, clock: Clock, lost: list[str], in_job: int = 0) -> tuple[Liveness, Liveness]:
    return tuple(Liveness(run_dir, 7, 0, in_job, rank, 2, f"node{rank}", LIVENESS_S, on_lost=lost.append,
                          clock=clock, node_base=run_dir / "node-local") for rank in (0, 1))  # type: ignore[return-value]


def test_a_silent_peer_is_declared_lost_with_a_marker_that_names_it_and_its_host(tmp_path: Path) -> None:
    clock, lost = Clock(), []
    watcher, peer = pair(tmp_path, clock, lost)
    for _ in range(4):
        peer.beat()
        assert watcher.check() is None
        clock.now += 0.5
    silences = []
    while not lost and clock.now < 10:  # the peer freezes: no more beats
        silences.append(watcher.check())
        clock.now += 0.5
    assert lost and silences[-1] is not None and LIVENESS_S <= silences[-1] < LIVENESS_S + 1
    assert "rank 1 on node1 is lost: no liveness beat for 3s" in lost[0] and "HINT" in lost[0]
    assert lost_ranks(tmp_path, 7, 0, 0) == {1: "node1"}
    marker = json.loads(layout.lost_marker(tmp_path, "job-7-restart-0", 1).read_text())
    assert marker["by_rank"] == 0 and marker["silent_s"] >= LIVENESS_S and marker["last_beat"] == 4
    assert "rank 1 on node1 lost" in losses.describe(tmp_path, 7, 0)
    assert losses.ledger_fields(tmp_path, 7, 0) == {
        "lost_ranks": [1], "lost_hosts": ["node1"], "message": losses.describe(tmp_path, 7, 0),
        "lost_at": marker["time"]}  # when it was declared: status says it
    assert (tmp_path / "errors" / "job-7-restart-0-crash-rank-1.txt").exists()  # for a train.script's workers
    # the watcher said it leaves: its own watcher never takes it for lost
    assert decode(beats.node_beat(tmp_path, 0).read_bytes(), "job-7-restart-0").left  # type: ignore[union-attr]
    assert lost_ranks(tmp_path, 7, 1, 0) == {} and lost_ranks(tmp_path, 7, 0, 1) == {}  # other attempts


def test_a_peer_that_left_is_not_lost_and_nobody_is_watched_after(tmp_path: Path) -> None:
    clock, lost = Clock(), []
    watcher, peer = pair(tmp_path, clock, lost)
    peer.beat()
    watcher.check()
    peer.leave()
    peer.beat()  # a beat after leaving writes nothing
    for _ in range(40):
        clock.now += 0.5
        assert watcher.check() is None
    assert not lost and lost_ranks(tmp_path, 7, 0, 0) == {} and watcher.next_node.peer == watcher.place.node


def test_a_peer_of_an_earlier_attempt_is_not_judged(tmp_path: Path) -> None:
    clock, lost = Clock(), []
    _, old_peer = pair(tmp_path, clock, lost)
    watcher, _ = pair(tmp_path, clock, lost, in_job=1)
    old_peer.beat()  # rank 1's file holds the earlier attempt's beat; this attempt's rank 1 never starts
    for _ in range(40):
        clock.now += 0.5
        assert watcher.check() is None
    assert not lost


def test_the_thread_beats_and_declares_a_frozen_peer_lost(tmp_path: Path) -> None:
    """The real thread and clock: a peer whose thread stops without a last beat (as a frozen process's does)."""
    lost: list[str] = []
    found = threading.Event()
    watcher = Liveness(tmp_path, 8, 0, 0, 0, 2, "node0", 1, on_lost=lambda m: (lost.append(m), found.set()),
                       node_base=tmp_path / "node-local")
    peer = Liveness(tmp_path, 8, 0, 0, 1, 2, "node1", 1, on_lost=lost.append, node_base=tmp_path / "node-local")
    peer.start()
    watcher.start()
    assert wait_until(lambda: watcher.next_node.judge.count is not None and watcher.next_node.judge.count >= 3, timeout=30, poll=0.05)
    assert not lost
    peer._stopped.set()  # frozen: no more beats, no last one
    assert found.wait(timeout=30) and lost_ranks(tmp_path, 8, 0, 0) == {1: "node1"}
    watcher.leave()


def test_every_survivor_hears_the_declaration_and_writes_what_it_holds_before_it_exits(tmp_path: Path) -> None:
    """Only rank 3 watches rank 0; ranks 1 and 2 used to learn of the loss when a peer they waited on exited and
    gloo failed their collective (NCCL does not: they stayed blocked, and rank 0's buddy never wrote its state).
    The declaration reaches them by name, read once the rendezvous is done, never from another attempt or their
    own; each writes what it holds (before_exit) and exits. Rank 0, thawed, hears that it was declared lost, and
    writes nothing: a declared rank is fenced (issue 60: a partitioned node, a false alarm)."""
    clock = Clock()
    heard: dict[int, list[str]] = {0: [], 1: [], 2: [], 3: []}
    wrote: list[int] = []
    ranks = [Liveness(tmp_path, 7, 0, 0, r, 4, f"node{r}", LIVENESS_S, clock=clock, on_lost=heard.get(r, []).append,
                      on_heard=heard.get(r, []).append, node_base=tmp_path / "node-local") for r in range(4)]
    old = Liveness(tmp_path, 7, 0, 1, 3, 4, "node3", LIVENESS_S, clock=clock, node_base=tmp_path / "node-local")  # another attempt of the same run
    for rank in ranks:
        rank.before_exit = lambda message, r=rank.rank: wrote.append(r)  # type: ignore[misc]
        rank._thread.start = lambda: None  # type: ignore[method-assign]  # the test turns the periods
        rank.start()
    assert layout.declared(tmp_path).read_bytes() == b""  # created by rank 0 before the rendezvous
    for rank in ranks:
        rank.listen()
    for _ in range(4):
        for rank in ranks:
            assert rank.check() is None
        clock.now += 0.5
    while not heard[3]:  # rank 0 freezes; rank 3 watches it
        for rank in ranks[1:]:
            rank.check()
        clock.now += 0.5
    assert "rank 0 on node0 is lost" in heard[3][0] and wrote == [3]
    old.listening = True
    assert old._hear() is None  # another attempt's declaration is not this attempt's
    for rank in ranks[1:3]:
        rank.check()
    assert wrote == [3, 1, 2] and all("rank 3 declared rank 0 on node0 lost" in heard[r][0] for r in (1, 2))
    ranks[0].check()
    assert wrote == [3, 1, 2] and "This rank is among them" in heard[0][0], heard[0]
    assert all(decode(beats.node_beat(tmp_path, r).read_bytes(), "job-7-restart-0").left for r in (1, 2, 3))  # type: ignore[union-attr]


# --- the config ---

@pytest.mark.parametrize("value", ["-1", "0.5", "'abc'"])
def test_a_bad_liveness_s_names_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([ROOT / "examples" / "mlp.yaml"], [f"dist.liveness_s={value}"])
    assert "dist.liveness_s" in str(err.value)


def test_liveness_s_must_be_well_below_the_timeout_and_the_default_steps_aside() -> None:
    mlp = [ROOT / "examples" / "mlp.yaml"]
    with pytest.raises(ConfigError) as err:
        load_config(mlp, ["dist.liveness_s=20", "dist.timeout_s=30"])
    text = str(err.value)
    assert "dist.liveness_s=20 is not well below dist.timeout_s=30" in text and "recorded as hung" in text
    assert "HINT: lower it (dist.liveness_s=7)" in text
    small = load_config(mlp, ["dist.timeout_s=8"]).dist  # the default with a small timeout: off, not an error
    assert small.liveness_s == 30 and effective(small.liveness_s, small.timeout_s) is None
    assert load_config(mlp, ["dist.liveness_s=null"]).dist.liveness_s is None
    assert effective(load_config(mlp, ["dist.liveness_s=0"]).dist.liveness_s, 600) is None


# --- the rehearsal's --freeze-at ---

def test_freeze_at_names_only_training_nodes_and_says_when_it_never_fired() -> None:
    assert freeze_problem([(5, 1)], 2) is None and freeze_problem([(5, None)], 1) is None
    assert "HINT: --freeze-at 5:1" in (freeze_problem([(5, 2)], 2) or "")
    text = unfired([], {"step": 40}, None, freezes=[90])
    assert "--freeze-at 90 never fired" in text and "the failure was not rehearsed" in text
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--freeze-at", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "as does --freeze-at" in proc.stderr


def rehearse(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "--local", "slurm.nodes=2", "slurm.tasks_per_node=1",
           f"run_dir={run_dir}", *SLOW, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TEST_TIMEOUT_S,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("program", [
    ["examples/mlp.yaml", "train.max_steps=400", "train.log_every=10"],  # our Trainer, in the process group
    ["examples/torchrun_script.yaml"],  # a wrapped script: its worker beats for it
], ids=["trainer", "script"])
def test_a_frozen_node_is_declared_lost_and_the_job_ends_instead_of_waiting(tmp_path: Path,
                                                                            program: list[str]) -> None:
    run_dir = tmp_path / "run"
    proc = rehearse(run_dir, *program, "--freeze-at", "10:1")
    assert proc.returncode == codes.EXIT_LOST, proc.stderr[-3000:]
    assert "freezing node1 (--freeze-at 10): SIGSTOP to its rank 1" in proc.stderr
    # node 0's watcher: no answer over the training network, or its beats in the run dir (3 s both), first wins
    assert "rank 1 on node1 lost (no liveness beat for" in proc.stderr or \
        "rank 1 on node1 lost (no answer over the training network for 3s" in proc.stderr, proc.stderr[-3000:]
    [attempt] = read_attempts(run_dir)[:1]
    assert attempt["reason"] == "failed" and attempt["exit_code"] == codes.EXIT_LOST
    assert attempt["lost_ranks"] == [1] and attempt["lost_hosts"] == ["node1"]
    assert lost_ranks(run_dir, attempt["job_id"], 0, 0) == {1: "node1"}  # what the batch shell reads
    assert alive_with(str(run_dir)) == []  # the stopped ranks were SIGKILLed with the step


@pytest.mark.slow
def test_a_rank0_evaluation_longer_than_liveness_s_is_slow_not_lost(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = rehearse(run_dir, "examples/mlp.yaml", "train.task=null", "train.loop=tests.tasks.liveness:rank0_evaluates",
                    "train.max_steps=6", env={"HPC_DDP_TEST_EVAL_S": str(3 * LIVENESS_S)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [a["reason"] for a in read_attempts(run_dir)] == ["finished"]
    assert not list((run_dir / "errors").glob("*-lost-rank-*")) and "is lost" not in proc.stderr
    raw = [json.loads(beats.node_beat(run_dir, rank).read_text()) for rank in (0, 1)]
    assert [b["state"] for b in raw] == ["left", "left"]  # both left cleanly
    assert all(b["count"] > 3 * LIVENESS_S / liveness.period(LIVENESS_S) for b in raw)  # they beat all along


@pytest.mark.slow
def test_a_false_alarm_commits_nothing_torn_and_the_run_ends_as_if_uninterrupted(tmp_path: Path) -> None:
    """Issue 44: rank 2's beats stop at step 20 while it trains on (its beat thread starved), and its node's watcher
    process with them (stopped): rank 2, or its whole node, is declared lost (rank 3 watches it on the node, node 0's
    watcher the node's beat; whichever speaks first), and every rank writes what it holds from its liveness thread
    while its training thread still runs.
    Whatever is committed must be a whole step, equal to the uninterrupted run's state at that step: the resumed
    run's losses and final state (every rank's own included) are the reference's."""
    program = ["examples/own_loop_gpt.yaml", "train.loop=tests.tasks.loops:nanogpt_shaped", "train.max_steps=200",
               "train.log_every=1", "snapshot.every_steps=100", "snapshot.every_minutes=null",
               "slurm.tasks_per_node=2", "slurm.spare_nodes=1", "slurm.max_restarts_in_job=3"]
    reference = rehearse(tmp_path / "reference", *program, env={"HPC_DDP_TEST_FAULT": "mute:-1:-1"})
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_dir = tmp_path / "alarm"
    proc = rehearse(run_dir, *program, env={"HPC_DDP_TEST_FAULT": "mute:2:20"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = read_attempts(run_dir)
    assert attempts[0]["reason"] == "failed" and attempts[0]["lost_ranks"] in ([2], [2, 3]), attempts[0]
    assert attempts[-1]["reason"] == "finished" and attempts[1]["resumed_from"] > 20, attempts
    resumed = attempts[1]["resumed_from"]
    jit = attempts[0].get("jit_snapshot")
    assert jit is None or jit["step"] == resumed, attempts[0]  # the survivors' snapshot, if any, is resumed from
    assert logged_losses(run_dir) == logged_losses(tmp_path / "reference")
    assert json.loads((run_dir / "DONE.json").read_text()) == json.loads(
        (tmp_path / "reference" / "DONE.json").read_text())


# --- per node, not per rank (issue 45) ---

class RunDirOpens:
    """Every open under one folder, counted through Python's audit hook (open, os.open): what the file server
    of a shared run dir would see, whatever code path made it."""

    hooked: list[RunDirOpens] = []
    installed = False  # an audit hook cannot be removed: one for the process, whatever the counters

    def __init__(self, folder: Path) -> None:
        self.folder, self.count, self.on = str(folder), 0, False
        if not RunDirOpens.installed:
            sys.addaudithook(lambda event, args: RunDirOpens._seen(event, args))
            RunDirOpens.installed = True
        RunDirOpens.hooked.append(self)

    @staticmethod
    def _seen(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, os.PathLike)):
            for counter in RunDirOpens.hooked:
                if counter.on and os.fspath(args[0]).startswith(counter.folder):
                    counter.count += 1

    def close(self) -> None:
        RunDirOpens.hooked.remove(self)


def node_of_ranks(run_dir: Path, nodes: int, per_node: int, clock: Clock, heard: dict[int, list[str]],
                  wrote: list[int]) -> list[Liveness]:
    ranks = []
    for rank in range(nodes * per_node):
        node, local = divmod(rank, per_node)
        live = Liveness(run_dir, 7, 0, 0, rank, nodes * per_node, f"n{node}", LIVENESS_S, clock=clock,
                        place=liveness.Place(local, per_node, node, nodes), node_base=run_dir.parent / "node-local",
                        on_lost=heard.setdefault(rank, []).append, on_heard=heard[rank].append)
        live.before_exit = lambda message, r=rank: wrote.append(r)  # type: ignore[misc]
        live._thread.start = lambda: None  # type: ignore[method-assign]  # the test turns the periods
        ranks.append(live.start())
    for live in ranks:
        live.listen()
    return ranks


def turn_until(ranks: list[Liveness], clock: Clock, heard: list[str], frozen: set[int]) -> None:
    """Four periods of every rank; then periods of the ranks not ``frozen`` (and not gone) until ``heard``."""
    for _ in range(4):
        for live in ranks:
            live.check()
        clock.now += 0.5
    while not heard:
        for live in ranks:
            if live.rank not in frozen and not live._left:
                live.check()
        clock.now += 0.5


@pytest.mark.parametrize("per_node", [1, 2, 4])
def test_the_run_dir_sees_one_beat_file_and_three_opens_per_node_a_period_at_any_ranks_per_node(
        tmp_path: Path, per_node: int) -> None:
    """Every rank beats on its node; only each node's first rank writes to the run dir (its node's beat) and
    reads it (the next node's beat, the declaration): what the shared filesystem sees per period is O(nodes)
    and flat in the ranks per node."""
    run_dir, clock = tmp_path / "run", Clock()
    ranks = node_of_ranks(run_dir, 3, per_node, clock, {}, [])
    counter = RunDirOpens(run_dir)
    try:
        counter.on = True
        for _ in range(10):
            for live in ranks:
                assert live.check() is None
            clock.now += 0.5
        counter.on = False
    finally:
        counter.close()
    assert counter.count == 10 * 3 * 3  # periods x nodes x (write own beat, read the next node's, the declaration)
    assert sorted(p.name for p in (run_dir / "liveness").iterdir()) == [
        "declared.json", "node-0.json", "node-1.json", "node-2.json"]
    node1 = decode(beats.node_beat(run_dir, 1).read_bytes(), "job-7-restart-0")
    assert node1 is not None and node1.ranks == tuple(range(per_node, 2 * per_node)) and node1.host == "n1"


def test_a_frozen_rank_of_a_live_node_is_found_on_its_node_and_named_by_rank(tmp_path: Path) -> None:
    """Rank 3 (node 1's second rank) freezes while node 1's first rank beats on for the node: node 1's first rank
    watches it on the node, names rank 3 alone, and every survivor hears it: another node's ranks through their
    first rank, which relays the run dir's declaration on its node."""
    run_dir, clock, heard, wrote = tmp_path / "run", Clock(), {}, []
    ranks = node_of_ranks(run_dir, 3, 2, clock, heard, wrote)
    turn_until(ranks, clock, heard[2], frozen={3})
    assert "rank 2: rank 3 on n1 is lost: no liveness beat for 3s" in heard[2][0]
    assert lost_ranks(run_dir, 7, 0, 0) == {3: "n1"}
    for _ in range(2):  # leaders hear the run dir's declaration in one period, their node's ranks in the next
        for live in ranks[:3] + ranks[4:]:
            if not live._left:
                live.check()
    assert sorted(wrote) == [0, 1, 2, 4, 5] and all("rank 2 declared rank 3 on n1 lost" in heard[r][0]
                                                     for r in (0, 1, 4, 5))


def test_a_whole_frozen_node_is_declared_with_every_rank_on_it_by_the_node_before_it(tmp_path: Path) -> None:
    run_dir, clock, heard, wrote = tmp_path / "run", Clock(), {}, []
    ranks = node_of_ranks(run_dir, 3, 2, clock, heard, wrote)
    turn_until(ranks, clock, heard[2], frozen={4, 5})  # node 2 freezes; node 1's first rank watches it
    assert "rank 2: ranks 4, 5 on n2 (node 2, every rank on it) are lost" in heard[2][0]
    assert lost_ranks(run_dir, 7, 0, 0) == {4: "n2", 5: "n2"}
    assert losses.describe(run_dir, 7, 0).startswith("ranks 4, 5 on n2 lost (no liveness beat for 3")
    assert losses.ledger_fields(run_dir, 7, 0)["lost_ranks"] == [4, 5]
    assert len(list((run_dir / "errors").glob("*-lost-rank-*"))) == 1  # one marker for the node


def test_the_last_rank_to_leave_clears_the_nodes_beats_but_never_a_survivors_snapshot_in_progress(
        tmp_path: Path) -> None:
    """A rank that hears a declaration leaves (its last beat) before it writes what it holds, in the node's
    folder: the node's last rank to leave used to remove the whole folder, another rank's per-rank states with it
    (the survivors' snapshot then could not read them: found by the frozen-node test on the local cluster)."""
    run_dir, clock = tmp_path / "run", Clock()
    ranks = node_of_ranks(run_dir, 1, 2, clock, {}, [])
    folder = ranks[0].folder
    (folder / "jit").mkdir()
    (folder / "jit" / "blobs-1.pt").write_bytes(b"rank 1's per-rank states")
    for live in ranks:
        live.leave()
    assert (folder / "jit" / "blobs-1.pt").exists() and not list(folder.glob("rank-*.beat"))
    (folder / "jit" / "blobs-1.pt").unlink()
    (folder / "jit").rmdir()
    again = node_of_ranks(run_dir, 1, 2, clock, {}, [])  # a clean end: nothing of the node is left
    for live in again:
        live.leave()
    assert not folder.exists() and not folder.parent.exists()


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_its_nodes_watcher_long_before_liveness_s(tmp_path: Path) -> None:
    """Rank 3 SIGSTOPs itself, its liveness thread with it; dist.liveness_s is 600 s, so only the node's watcher
    process, which sees state T in /proc, can end the step within the test's time: it names rank 3 alone."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "--local", "slurm.nodes=2", "slurm.tasks_per_node=2",
           f"run_dir={run_dir}", "examples/mlp.yaml", "train.task=null", "dist.timeout_s=3600",
           "dist.liveness_s=600", "slurm.max_restarts_in_job=0", "train.loop=tests.tasks.liveness:a_rank_stops",
           "train.max_steps=2000"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TEST_TIMEOUT_S,
                          env={**os.environ, "HPC_DDP_TEST_STOP_RANK": "3"})
    assert proc.returncode == codes.EXIT_LOST, proc.stderr[-3000:]
    # 2 s of the watcher's looks, every 0.5 s: "2s", or "3s" on a loaded machine whose looks came late
    assert re.search(r"rank 3 on node1 lost \(stopped \(SIGSTOP: state T in /proc\) for [23]s, seen by node 1's "
                     r"watcher \(node1\)\)", proc.stderr), proc.stderr[-3000:]
    [attempt] = read_attempts(run_dir)[:1]
    assert attempt["reason"] == "failed" and attempt["lost_ranks"] == [3] and attempt["lost_hosts"] == ["node1"]
    assert alive_with(str(run_dir)) == []  # the stopped rank was SIGKILLed with the step, the watchers ended


@pytest.mark.slow
def test_a_rank_that_holds_the_gil_four_times_liveness_s_is_not_lost(tmp_path: Path) -> None:
    """Rank 0, its node's first rank, spends 4 x dist.liveness_s in one C call that keeps the GIL: neither its
    beats on the node nor the node's beat (its watcher's) may make anyone declare it lost."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "--local", "slurm.nodes=2", "slurm.tasks_per_node=2",
           f"run_dir={run_dir}", "examples/mlp.yaml", "train.task=null", *SLOW, "train.max_steps=6",
           "train.loop=tests.tasks.liveness:rank0_holds_the_gil"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TEST_TIMEOUT_S,
                          env={**os.environ, "HPC_DDP_TEST_HOLD_S": str(4 * LIVENESS_S)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [a["reason"] for a in read_attempts(run_dir)] == ["finished"]
    assert not list((run_dir / "errors").glob("*-lost-rank-*")) and "is lost" not in proc.stderr
