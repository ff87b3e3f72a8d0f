"""The node's watcher (issue 60): its ranks judged through the kernel's process table, with a fake /proc and a fake
clock; one tick of the process's work on real node-local and run-dir files. The whole process is tried in
tests/rank/test_liveness.py (a stopped rank named long before dist.liveness_s, a GIL held 4 x liveness_s not lost)."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_ddp.core.processes import Seen, seen
from hpc_ddp.rank.watch.kernel_judge import KernelJudge
from hpc_ddp.rank.watch.node_watch import NodeWatch, Plan
from hpc_ddp.rank.watch.watcher_marker import marker, watching
from hpc_ddp.rundir import beats, losses, lost
from hpc_ddp.rundir.beats import Beat, decode, encode

TAG = "job-7-restart-0"


def beat(rank: int, pid: int | None, left: bool = False, count: int = 1) -> Beat:
    return Beat("t", rank, "n1", count, left, 0.0, pid=pid)


def test_seen_reads_the_state_after_the_last_parenthesis_and_the_start_time(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    fields = ["T", *map(str, range(1, 19)), "777", "0"]  # the state, 18 fields, then field 22: the start time
    (tmp_path / "42" / "stat").write_text(f"42 (py (a) b) {' '.join(fields)}\n")
    assert seen(42, tmp_path) == Seen("T", 777) and seen(42, tmp_path).stopped
    assert seen(43, tmp_path) is None
    assert Seen("t", 1).stopped is False and Seen("Z", 1).exited and not Seen("R", 1).exited


def test_a_stopped_rank_is_lost_after_stopped_s_of_watching_and_a_debuggers_stop_never() -> None:
    judge = KernelJudge(stopped_s=2.0, gone_s=30.0, stall_s=1.0)
    ranks = {2: beat(2, 100), 3: beat(3, 101)}
    for t in (0.0, 0.5, 1.0, 1.5):
        look = judge.observe(ranks, {100: Seen("T", 5), 101: Seen("t", 6)}, t)
        assert look.stopped == {} and look.gone == []
    look = judge.observe(ranks, {100: Seen("T", 5), 101: Seen("t", 6)}, 2.0)
    assert look.stopped == {2: 2.0}  # rank 3 under a debugger is never lost
    assert judge.observe(ranks, {100: Seen("S", 5), 101: Seen("t", 6)}, 2.5).stopped == {}  # SIGCONT: alive again


def test_time_the_watcher_did_not_watch_is_not_counted_as_stopped() -> None:
    """scontrol suspend stops the watcher with its ranks; on resume it may look before its ranks get SIGCONT."""
    judge = KernelJudge(stopped_s=2.0, stall_s=1.0)
    ranks = {0: beat(0, 100)}
    judge.observe(ranks, {100: Seen("S", 5)}, 0.0)
    judge.observe(ranks, {100: Seen("T", 5)}, 0.5)
    assert judge.observe(ranks, {100: Seen("T", 5)}, 60.0).stopped == {}  # 59.5 s unwatched: starts again
    assert judge.observe(ranks, {100: Seen("S", 5)}, 60.2).stopped == {}


def test_a_gone_rank_is_named_once_and_declared_only_after_gone_s_and_a_left_one_never() -> None:
    judge = KernelJudge(stopped_s=2.0, gone_s=3.0, stall_s=10.0)
    ranks = {0: beat(0, 100), 1: beat(1, 101, left=True), 2: beat(2, 102), 3: beat(3, None)}
    alive = {100: Seen("S", 5), 102: Seen("R", 9)}
    assert judge.observe(ranks, {**alive, 101: None}, 0.0).gone == []
    look = judge.observe(ranks, {100: Seen("Z", 5), 101: None, 102: Seen("R", 10)}, 1.0)  # 102: another process
    assert look.gone == [0, 2] and look.gone_long == {}
    assert judge.observe(ranks, {102: Seen("R", 10)}, 2.0).gone == []  # named once
    assert judge.observe(ranks, {102: Seen("R", 10)}, 4.0).gone_long == {0: 3.0, 2: 3.0}


def plan(tmp_path: Path, **extra: object) -> Plan:
    return Plan(str(tmp_path / "run"), (7, 0, 0), TAG, f"{TAG}+tok", str(tmp_path / "node"), 1, 3, 2, 2, "n1",
                30.0, 5.0, **extra)  # type: ignore[arg-type]


def fake_proc(root: Path, states: dict[int, str]) -> Path:
    for pid, letter in states.items():
        (root / str(pid)).mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "stat").write_text(f"{pid} (python) {letter} {' '.join(['1'] * 18)} 55 0\n")
    return root


def test_one_tick_beats_for_the_node_and_declares_a_rank_stopped_on_it(tmp_path: Path) -> None:
    p = plan(tmp_path)
    folder = Path(p.folder)
    folder.mkdir(mode=0o700)
    for local, pid in ((0, 100), (1, 101)):
        (folder / f"rank-{local}.beat").write_bytes(encode(Beat(p.local_tag, 2 + local, "n1", 1, pid=pid)))
    proc = fake_proc(tmp_path / "proc", {100: "S", 101: "T"})
    clock = [0.0]
    watch = NodeWatch(p, clock=lambda: clock[0], wall=lambda: 1000.0, proc=proc)
    watch.tick()
    node = decode(beats.node_beat(p.run_dir, 1).read_bytes(), TAG)
    assert node is not None and node.ranks == (2, 3) and node.node == 1 and not node.left
    for t in (0.5, 1.0, 1.5, 2.0):
        clock[0] = t
        watch.tick()
    assert watch.quiet and not watch.done  # it answers pings until its ranks have left
    assert losses.lost_ranks(Path(p.run_dir), 7, 0, 0) == {3: "n1"}
    relayed = lost.declaration_in(beats.local_declared(folder), p.local_tag, own=True)
    assert relayed is not None and relayed["by"] == "node 1's watcher (n1)" and relayed["by_rank"] is None
    assert losses.describe(Path(p.run_dir), 7, 0) == (
        "rank 3 on n1 lost (stopped (SIGSTOP: state T in /proc) for 2s, seen by node 1's watcher (n1))")


def test_the_node_beat_says_left_when_the_first_rank_left_and_the_ranks_see_whether_it_watches(
        tmp_path: Path) -> None:
    p = plan(tmp_path)
    folder = Path(p.folder)
    folder.mkdir(mode=0o700)
    (folder / "rank-0.beat").write_bytes(encode(Beat(p.local_tag, 2, "n1", 9, left=True, pid=100)))
    proc = fake_proc(tmp_path / "proc", {100: "S", 200: "S", 201: "T"})
    watch = NodeWatch(p, proc=proc)
    watch.tick()
    assert watch.done and json.loads(beats.node_beat(p.run_dir, 1).read_text())["state"] == "left"
    assert not watching(folder, p.local_tag, proc)  # no marker: the ranks' threads watch their node
    for pid, expected in ((200, True), (201, False), (202, False)):  # alive; stopped; gone
        marker(folder).write_bytes(encode(Beat(p.local_tag, 2, "n1", 1, pid=pid)))
        assert watching(folder, p.local_tag, proc) is expected


def test_a_watcher_whose_nodes_folder_went_ends(tmp_path: Path) -> None:
    """A watcher quiet after a declaration answers pings until its ranks end; where the step's end took the node's
    folder first (the rehearsal's clean-up), it found no rank at all and stayed forever (seen after a test's time-out)."""
    import shutil

    p = plan(tmp_path)
    folder = Path(p.folder)
    folder.mkdir(mode=0o700)
    (folder / "rank-0.beat").write_bytes(encode(Beat(p.local_tag, 2, "n1", 1, pid=100)))
    watch = NodeWatch(p, proc=fake_proc(tmp_path / "proc", {100: "S"}))
    watch.quiet = True
    watch.tick()
    assert not watch.done
    shutil.rmtree(folder)
    watch.tick()
    assert watch.done
    if watch.net is not None:
        watch.net.close()
