"""The node's beat over the training network (issue 60): a watcher pings the node it watches over UDP and that
node's watcher answers. Pure parts with a fake clock; two watchers' real sockets on loopback and real run-dir
files, ticked by hand: a partitioned node (it still beats into the run dir) and a frozen one are declared in
net_silent_s, a slow file server is not a loss, a node whose own link is down declares no other node, and itself
once it stays down. The whole thing on the local cluster of machines (a node's link cut for real):
tests/cluster/test_heal_slurm.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpc_ddp.rank.watch import net_beat
from hpc_ddp.rank.watch.net_beat import NetBeat, NetJudge, decode, encode
from hpc_ddp.rank.watch.node_watch import NodeWatch, Plan
from hpc_ddp.rundir import beats, losses, lost

TAG = "job-7-restart-0"
KEY = net_beat.key(f"{TAG}+token")


def test_a_datagram_is_believed_only_with_the_attempts_key_and_tag() -> None:
    raw = encode(KEY, TAG, 1, "ping", 5)
    assert decode(KEY, TAG, raw) == (1, "ping", 5)
    assert decode(net_beat.key(f"{TAG}+another-token"), TAG, raw) is None  # another user's, or another run's
    assert decode(KEY, "job-7-restart-1", raw) is None  # another attempt's
    assert decode(KEY, TAG, raw[:-2] + b"9}") is None  # tampered
    assert decode(KEY, TAG, b"short") is None


def test_the_judge_counts_silence_only_once_answers_came_ignores_replays_and_its_own_stall() -> None:
    judge = NetJudge(silent_s=3.0, stall_s=1.0)
    for t in (0.0, 0.5, 1.0):
        judge.awake(t)
        assert judge.lost(t) is None and judge.silence(t) is None  # never answered: not judged here
    judge.heard(4, 1.0)
    judge.heard(2, 1.5)  # an older answer (replayed, reordered) is no news
    for t in (1.5, 2.0, 2.5, 3.0, 3.5):
        judge.awake(t)
        assert judge.lost(t) is None
    judge.awake(4.0)
    assert judge.lost(4.0) == 3.0
    judge.heard(5, 4.0)
    judge.awake(4.5)
    judge.awake(64.5)  # the pinging thread did not run for 60 s (scontrol suspend): this watcher's stall
    assert judge.silence(64.5) == 0.0
    for t in (65.0, 65.5, 66.0, 66.5, 67.0):
        judge.awake(t)
    assert judge.lost(67.0) is None and judge.lost(67.5) == 3.0
    # how seldom the verdict is read (a tick stuck on the file server) changes nothing: the thread's runs count
    judge.heard(6, 67.5)
    for t in (67.5, 68.0, 68.5, 69.0, 69.5, 70.0, 70.5):
        judge.awake(t)
    assert judge.lost(70.5) == 3.0


def test_two_sockets_ping_and_answer_on_loopback() -> None:
    watcher, watched = NetBeat(f"{TAG}+token", TAG, 0, "127.0.0.1"), NetBeat(f"{TAG}+token", TAG, 1, "127.0.0.1")
    stranger = NetBeat(f"{TAG}+other", TAG, 1, "127.0.0.1")  # another key: its answers are never heard
    try:
        assert watched.endpoint.startswith("127.0.0.1:") and watched.interface == "lo"
        watcher.tick(1, stranger.endpoint, 0.0)
        stranger.tick(0, None, 0.0)
        watcher.tick(1, watched.endpoint, 0.5)
        assert watcher.judge.count == -1  # the stranger ignored the ping it could not read
        watched.tick(0, None, 0.5)  # answers
        watcher.tick(1, watched.endpoint, 1.0)
        assert watcher.judge.heard_at == 1.0 and watcher.judge.count == 2
        for t in (1.5, 2.0, 2.5, 3.0, 3.5):  # the watched node frozen: no answers
            watcher.tick(1, watched.endpoint, t)
        assert watcher.judge.lost(4.0) == 3.0
    finally:
        for sock in (watcher, watched, stranger):
            sock.close()


def plans(tmp_path: Path) -> list[Plan]:
    return [Plan(str(tmp_path / "run"), (7, 0, 0), TAG, f"{TAG}+token", str(tmp_path / f"node{n}"), n, 2, 2 * n, 2,
                 f"n{n}", 3.0, 0.5) for n in (0, 1)]


class Pair:
    """Two nodes' watchers ticked by hand on one fake clock; node 1 frozen, cut or with a stalled file server."""

    def __init__(self, tmp_path: Path) -> None:
        self.clock = [0.0]
        self.watches = [NodeWatch(p, clock=lambda: self.clock[0], wall=lambda: 1000.0 + self.clock[0],
                                  proc=tmp_path / "proc") for p in plans(tmp_path)]
        for watch in self.watches:
            Path(watch.plan.folder).mkdir(mode=0o700)

    def run(self, until: float, node1: str = "alive") -> None:
        """Tick both every 0.5 s; node 1 ``alive``, ``frozen`` (nothing), ``cut`` (its run-dir beats go on,
        nothing reaches its socket) or ``slow-files`` (its answers go on, its run-dir beats do not)."""
        while self.clock[0] < until:
            self.clock[0] += 0.5
            self.watches[0].tick()
            one = self.watches[1]
            if node1 == "cut":
                self._drain_unanswered(one)
                one._period(self.clock[0], judge=False)
            elif node1 == "slow-files":
                one._beat = lambda left: None  # type: ignore[method-assign]
                one.tick()
            elif node1 == "alive":
                one.tick()

    @staticmethod
    def _drain_unanswered(watch: NodeWatch) -> None:
        assert watch.net is not None
        while True:
            try:
                watch.net.sock.recvfrom(2048)
            except BlockingIOError:
                return

    def close(self) -> None:
        for watch in self.watches:
            if watch.net is not None:
                watch.net.close()


@pytest.fixture
def pair(tmp_path: Path):  # type: ignore[no-untyped-def]
    made = Pair(tmp_path)
    yield made
    made.close()


def test_a_partitioned_node_that_still_beats_into_the_run_dir_is_declared_and_says_so(pair: Pair) -> None:
    pair.run(2.0)
    assert pair.watches[0].net is not None and pair.watches[0].net.judge.heard_at is not None  # answers came
    pair.run(4.5, node1="cut")
    assert not pair.watches[0].quiet  # 2.5 s without an answer: not yet
    pair.run(5.5, node1="cut")
    record = lost.declaration(Path(pair.watches[0].plan.run_dir), TAG)
    assert record is not None and record["ranks"] == [2, 3] and record["by"] == "node 0's watcher (n0)", record
    assert record["noticed"].startswith("no answer over the training network for 3s, while its beats in the run "
                                        "dir still came"), record
    assert losses.describe(Path(pair.watches[0].plan.run_dir), 7, 0).startswith(
        "ranks 2, 3 on n1 lost (no answer over the training network for 3s")


def test_a_frozen_node_is_declared_in_net_silent_s_not_liveness_s(pair: Pair) -> None:
    pair.watches[0].plan = Plan(**{**pair.watches[0].plan.__dict__, "liveness_s": 30.0})  # the default window
    pair.run(2.0)
    pair.run(5.5, node1="frozen")
    record = lost.declaration(Path(pair.watches[0].plan.run_dir), TAG)
    assert record is not None and "nor a new beat in the run dir: frozen" in record["noticed"], record


def test_what_the_run_dirs_beats_tell_is_said_only_when_they_come_often_enough_to_tell() -> None:
    assert net_beat.noticed(3.0, 0.2, 0.5).endswith("while its beats in the run dir still came (0s ago): its link "
                                                     "is down")
    assert net_beat.noticed(3.0, 2.6, 0.5).endswith("nor a new beat in the run dir: frozen, powered off or hung "
                                                     "in its kernel")
    # one beat every 5 s (dist.liveness_s=30): 3 s of silence cannot tell
    assert "too seldom to tell a frozen node from a cut-off one" in net_beat.noticed(3.0, 1.0, 5.0)


def test_a_node_whose_file_server_stalls_but_answers_is_not_lost(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    pair.run(2.0)
    pair.run(12.0, node1="slow-files")  # 10 s without a run-dir beat, liveness_s 3
    assert lost.declaration(Path(pair.watches[0].plan.run_dir), TAG) is None and not pair.watches[0].quiet
    assert caplog.text.count("answers over the training network: its file server is slow") == 1


def test_a_node_whose_own_link_is_down_declares_no_other_and_itself_once_it_stays_down(
        pair: Pair, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Node 0 plays the cut-off side here: its neighbour is silent to it, and its own interface says down. It never
    declares node 1; after twice net_silent_s with nobody's declaration out, it declares its own ranks (a node cut
    before its first answer is declared by nobody else)."""
    pair.run(2.0)
    monkeypatch.setattr(net_beat, "link_down", lambda interface: True)
    pair.run(6.0, node1="cut")  # 3.5 s down
    run_dir = Path(pair.watches[0].plan.run_dir)
    assert lost.declaration(run_dir, TAG) is None
    assert "this node's link (lo) is down: it is the one cut off, and declares nobody else" in caplog.text
    pair.run(9.0, node1="cut")  # 6.5 s down
    record = lost.declaration(run_dir, TAG)
    assert record is not None and record["ranks"] == [0, 1] and record["host"] == "n0", record
    assert record["noticed"] == "its own link (lo) down for 6s: the node declared itself, cut off from its peers"
    assert pair.watches[0].quiet


def test_a_cut_off_node_does_not_declare_itself_when_its_peers_already_declared_it(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.core.atomic import rewrite_in_place
    from hpc_ddp.rundir import layout

    pair.run(2.0)
    run_dir = Path(pair.watches[0].plan.run_dir)
    said = {"attempt": TAG, "rank": 0, "ranks": [0, 1], "host": "n0", "by": "node 1's watcher (n1)", "time": 1.0}
    layout.declared(run_dir).parent.mkdir(parents=True, exist_ok=True)
    rewrite_in_place(layout.declared(run_dir), lost.padded(said))
    monkeypatch.setattr(net_beat, "link_down", lambda interface: True)
    pair.run(9.0, node1="cut")
    assert lost.declaration(run_dir, TAG)["by"] == "node 1's watcher (n1)"
    assert not layout.lost_marker(run_dir, TAG, 0).exists()  # it wrote nothing of its own


def test_a_node_that_left_is_not_declared_when_its_answers_stop(pair: Pair) -> None:
    pair.run(2.0)
    one = pair.watches[1]
    one._beat(left=True)
    pair.run(6.0, node1="frozen")
    assert lost.declaration(Path(pair.watches[0].plan.run_dir), TAG) is None
    assert json.loads(beats.node_beat(one.plan.run_dir, 1).read_text())["state"] == "left"


def test_a_serving_watcher_answers_while_its_own_tick_waits_on_the_file_server() -> None:
    """The answers come from a thread that touches no file: a tick stuck in a write to a stalled file server
    (here: nothing ticks node 1 at all) does not silence the node on the network."""
    watcher, watched = NetBeat(f"{TAG}+token", TAG, 0, "127.0.0.1"), NetBeat(f"{TAG}+token", TAG, 1, "127.0.0.1")
    try:
        watched.serve()
        for t in range(1, 50):
            watcher.tick(1, watched.endpoint, t * 0.5)
            if watcher.judge.count >= 1:
                break
            time.sleep(0.05)
        assert watcher.judge.count >= 1 and watcher.silence(t * 0.5) == 0.0
    finally:
        watcher.close()
        watched.close()


def test_a_link_down_is_read_from_this_namespaces_kernel_not_from_sys() -> None:
    """In a network namespace of its own (as each node of the local cluster of machines), /sys/class/net may be
    the host's: the first version read operstate there, saw the host's eth0 up, and a cut-off node never knew it
    was the one cut off. The flags come from the kernel through a socket of the namespace."""
    import shutil
    import subprocess
    import sys

    probe = ("from hpc_ddp.rank.watch import net_beat as n; "
             "print(n.link_down('lo'), n.interface_of('127.0.0.1'))")
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("needs unshare -n (a network namespace of its own): root on Linux")
    down = subprocess.run(["unshare", "-n", sys.executable, "-c", probe], capture_output=True, text=True)
    up = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && {sys.executable} -c \"{probe}\""],
                        capture_output=True, text=True)
    assert down.stdout.split() == ["True", "None"], down  # lo down: no address either
    assert up.stdout.split() == ["False", "lo"], up


def test_the_judge_takes_no_silence_for_evidence_while_its_own_pings_stopped_and_never_hears_backwards() -> None:
    judge = NetJudge(silent_s=3.0, stall_s=1.0)
    judge.awake(0.0)
    judge.heard(1, 0.0)
    for t in (0.5, 1.0, 1.5):
        judge.awake(t)
    assert judge.lost(3.0) is None  # silent 3 s, but its own last ping went 1.5 s ago: no evidence
    for t in (2.0, 2.5, 3.0):
        judge.awake(t)
    assert judge.lost(3.0) == 3.0 and judge.unanswered == 6
    judge.heard(2, 6.0)
    judge.heard(3, 4.0)  # a tick's older clock hears a newer answer: the silence never grows from it
    assert judge.heard_at == 6.0 and judge.unanswered == 0


def test_each_thread_stands_in_for_the_other_a_stuck_thread_silences_nobody_and_a_frozen_node_is_still_found() -> None:
    """ci47-ci48: a node's answers paused 3-4 s at a compile's start, and its neighbour declared it. The thread that
    pings and answers writes nothing now, and each tick answers, hears and (where the thread missed a ping) pings
    too: a watcher with a stuck thread, on either side, declares nobody falsely and is not declared."""
    import threading

    stuck = {0: threading.Event(), 1: threading.Event()}

    def clock_of(node: int):  # type: ignore[no-untyped-def]
        def clock() -> float:
            while stuck[node].is_set():  # the thread waits here, as on a blocked write or a lock
                time.sleep(0.01)
            return time.monotonic()
        return clock

    nets = [NetBeat(f"{TAG}+token", TAG, n, "127.0.0.1", silent_s=1.0, stall_s=0.6) for n in (0, 1)]
    try:
        for n, net in enumerate(nets):
            net.serve(clock_of(n), every_s=0.1)

        def run(seconds: float, tick_watched: bool = True) -> list[float]:
            verdicts, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                nets[0].tick(1, nets[1].endpoint, time.monotonic())
                if tick_watched:
                    nets[1].tick(0, None, time.monotonic())
                verdicts.append(nets[0].lost(time.monotonic()))
                time.sleep(0.1)
            return [v for v in verdicts if v is not None]

        assert run(0.5) == [] and nets[0].judge.count >= 1
        stuck[1].set()  # the watched node's thread stuck for twice the silence: its ticks answer
        assert run(2.0) == []
        stuck[1].clear()
        stuck[0].set()  # the watcher's own thread stuck: its ticks ping and hear
        assert run(2.0) == []
        stuck[1].set()  # the watched node frozen: neither its thread nor its tick runs
        assert run(2.0, tick_watched=False), "a frozen node was never found"
    finally:
        for event in stuck.values():
            event.clear()
        for net in nets:
            net.close()


def test_a_tick_never_waits_on_the_socket_the_thread_waits_on() -> None:
    """The thread's socket object waits out its timeout in poll() before a read, MSG_DONTWAIT or not: ticks that
    read through it took up to half a second more each, and B16's frozen rank was found in up to 6 s (not 2.4). The
    thread here waits up to 30 s for a datagram; a tick with nothing to read still returns at once."""
    import threading

    net = NetBeat(f"{TAG}+token", TAG, 0, "127.0.0.1")
    try:
        net.serve(every_s=30.0)
        time.sleep(0.1)  # the thread pinged nobody and waits for a datagram
        ticked = threading.Thread(target=lambda: [net.tick(1, None, time.monotonic()) for _ in range(3)])
        ticked.start()
        ticked.join(timeout=10)
        assert not ticked.is_alive(), "a tick waited on the thread's socket"
    finally:
        net.close()
