"""The watchers' endpoints handed over through the process group's store (issue 60): a node cut off before the
node before it ever read its beat in the run dir (a file server's cache keeps an absent name up to a minute) is
still pinged and declared. A fake store and clock for the hand-over; two watchers' real sockets on loopback, ticked
by hand, for the declaration. On the local cluster of machines: B16 (benchmarks/detection.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from hpc_ddp.rank.watch import net_exchange
from hpc_ddp.rank.watch.next_node import PEER
from hpc_ddp.rank.watch.node_watch import NodeWatch, Plan
from hpc_ddp.rank.watch.watcher_marker import marker
from hpc_ddp.rundir import beats, lost
from hpc_ddp.rundir.beats import Beat, encode

TAG = "job-7-restart-0"
LOCAL = f"{TAG}+token"


class Store:
    """What hand_over uses of a c10d store: set, check, get (bytes back, as c10d gives)."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.keys[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.keys[key]


def _folder(tmp_path: Path, node: int, net: str | None) -> Path:
    folder = tmp_path / f"node{node}"
    folder.mkdir(mode=0o700)
    if net is not None:
        marker(folder).write_bytes(encode(Beat(LOCAL, 2 * node, f"n{node}", 1, pid=100 + node, net=net)))
    return folder


def test_each_first_rank_publishes_its_watchers_endpoint_and_hands_the_next_nodes_to_its_watcher(
        tmp_path: Path) -> None:
    store = Store()
    folders = [_folder(tmp_path, n, f"10.0.0.{n + 1}:400{n}") for n in (0, 1)]
    said: list[Any] = [None, None]

    def one(node: int) -> None:
        said[node] = net_exchange.hand_over(store, folders[node], LOCAL, TAG, node, 2,
                                            {"first": 2 * node, "ranks": [2 * node, 2 * node + 1],
                                             "host": f"n{node}"})
    threads = [threading.Thread(target=one, args=(n,)) for n in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert said[0] is not None and said[0].net == "10.0.0.2:4001" and said[0].ranks == (2, 3) and said[0].node == 1
    assert said[1] is not None and said[1].net == "10.0.0.1:4000" and said[1].ranks == (0, 1)
    handed = beats.read(folders[0] / PEER, LOCAL, own=True)
    assert handed == said[0]
    assert json.loads(store.keys[net_exchange.key(TAG, 0)])["host"] == "n0"


def test_a_next_node_that_never_says_leaves_the_run_dirs_beat_to_say_it_and_a_lone_node_asks_nobody(
        tmp_path: Path) -> None:
    store, clock = Store(), [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds
    folder = _folder(tmp_path, 0, None)  # its watcher never said where it answers: published as null
    assert net_exchange.hand_over(store, folder, LOCAL, TAG, 0, 2, {"first": 0, "ranks": [0], "host": "n0"},
                                  clock=lambda: clock[0], sleep=sleep) is None
    assert clock[0] >= net_exchange.MARKER_S + net_exchange.WAIT_S and not (folder / PEER).exists()
    assert json.loads(store.keys[net_exchange.key(TAG, 0)])["net"] is None
    assert net_exchange.hand_over(Store(), folder, LOCAL, TAG, 0, 1, {"first": 0, "ranks": [0], "host": "n0"}) is None


def test_a_node_cut_before_its_beat_reached_the_node_before_is_declared_with_what_the_store_said(
        tmp_path: Path) -> None:
    """Node 1 beats into a run dir node 0 never sees (its view cached the name as absent); node 0's watcher has
    only the hand-over: it pings, hears answers, and declares node 1's ranks 3 s after the cut."""
    plans = [Plan(str(tmp_path / ("run" if n == 0 else "run-as-node1-sees-it")), (7, 0, 0), TAG, LOCAL,
                  str(tmp_path / f"node{n}"), n, 2, 2 * n, 2, f"n{n}", 30.0, 5.0) for n in (0, 1)]
    clock = [0.0]
    watches = [NodeWatch(p, clock=lambda: clock[0], wall=lambda: 1000.0 + clock[0], proc=tmp_path / "proc")
               for p in plans]
    try:
        for watch in watches:
            Path(watch.plan.folder).mkdir(mode=0o700)
        assert watches[1].net is not None
        (Path(plans[0].folder) / PEER).write_bytes(
            encode(Beat(LOCAL, 2, "n1", 0, node=1, ranks=(2, 3), net=watches[1].net.endpoint)))
        while clock[0] < 2.0:
            clock[0] += 0.5
            for watch in watches:
                watch.tick()
        assert watches[0].net is not None and watches[0].net.judge.heard_at is not None  # answers came
        assert watches[0].next_node.judge.last is None  # no beat of node 1 read from the run dir
        while clock[0] < 5.5:  # node 1 cut: it answers nothing
            clock[0] += 0.5
            watches[0].tick()
            while True:
                try:
                    watches[1].net.sock.recvfrom(2048)
                except BlockingIOError:
                    break
        record = lost.declaration(Path(plans[0].run_dir), TAG)
        assert record is not None and record["ranks"] == [2, 3] and record["host"] == "n1", record
        assert record["noticed"].startswith("no answer over the training network for 3s"), record
    finally:
        for watch in watches:
            if watch.net is not None:
                watch.net.close()


def test_a_run_dir_beat_that_names_no_endpoint_does_not_hide_the_store_s(tmp_path: Path) -> None:
    """The next node's first rank beats for its node until its watcher runs, without an endpoint; a watcher that
    read that beat first pinged nobody until a later beat came through its file server's cache (B16: half of the
    partitions 5 s into an attempt were found only when the cut node declared itself)."""
    from hpc_ddp.rank.watch.next_node import NextNode

    folder = _folder(tmp_path, 0, None)
    run_dir = tmp_path / "run"
    watch = NextNode(run_dir, TAG, 0, 2, 30.0, handed=(folder, LOCAL))
    beats.node_beat(run_dir, 1).parent.mkdir(parents=True)
    beats.node_beat(run_dir, 1).write_bytes(encode(Beat(TAG, 2, "n1", 1, node=1, ranks=(2, 3))))  # the rank's
    watch.look(0.0)
    assert watch.judge.last is not None and watch.judge.last.net is None and watch.endpoint() is None
    (folder / PEER).write_bytes(encode(Beat(LOCAL, 2, "n1", 0, node=1, ranks=(2, 3), net="10.0.0.2:4001")))
    assert watch.endpoint() == "10.0.0.2:4001" and watch.last() == watch.judge.last
    beats.node_beat(run_dir, 1).write_bytes(encode(Beat(TAG, 2, "n1", 2, node=1, ranks=(2, 3), net="10.0.0.2:4002")))
    watch.look(1.0)
    assert watch.endpoint() == "10.0.0.2:4002"  # the run dir's, once it names one
