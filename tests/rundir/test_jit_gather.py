"""A node's first offers wait on evidence, never a fixed window (hpc_ddp/rundir/jit_gather.py, issue 59): for a
rank of the node that entered the failure path, lives and has not offered, and for nobody else."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rundir import jit_files, jit_gather

BOUND_S = 30.0  # far above any wait these cases make: reaching it is the failure


def post(tmp_path: Path, local: int) -> jit_files.Post:
    return jit_files.Post(tmp_path / "run" / "jit" / "a", tmp_path / "node-0", local, 0, local, 3, "tag")


def offer_later(tmp_path: Path, local: int, after_s: float) -> threading.Thread:
    def offer() -> None:
        time.sleep(after_s)
        write_atomic(post(tmp_path, local).local / f"offer-{local}.json",
                     json.dumps({"tag": "tag", "offer": {"rank": local}}).encode())

    thread = threading.Thread(target=offer)
    thread.start()
    return thread


def test_a_first_offer_waits_for_a_rank_that_entered_and_lives_until_it_offers(tmp_path: Path) -> None:
    """Local rank 1 entered (this process: alive) and offers 0.3 s later; local rank 2 never entered (blocked in a
    collective elsewhere): rank 0's wait ends when rank 1's offer is there, without rank 2's."""
    jit_gather.enter(post(tmp_path, 1))
    thread = offer_later(tmp_path, 1, 0.3)
    started = time.monotonic()
    jit_gather.await_peers(post(tmp_path, 0), BOUND_S)
    assert jit_gather.local_offer(post(tmp_path, 0), 1) == {"rank": 1}
    assert jit_gather.local_offer(post(tmp_path, 0), 2) is None and time.monotonic() - started < BOUND_S
    thread.join()


def test_a_rank_that_entered_and_died_is_not_waited_for(tmp_path: Path) -> None:
    """Local rank 1 entered, then its process ended before it offered: nobody waits for it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    jit_files.node_local.ensure(post(tmp_path, 1).local)
    write_atomic(post(tmp_path, 1).local / "entered-1.json",
                 json.dumps({"tag": "tag", "pid": int(dead.stdout)}).encode())
    started = time.monotonic()
    jit_gather.await_peers(post(tmp_path, 0), BOUND_S)
    assert time.monotonic() - started < BOUND_S and jit_gather.local_offer(post(tmp_path, 0), 1) is None


def test_an_entry_of_another_attempt_is_not_believed(tmp_path: Path) -> None:
    """A record without the attempt's token (another attempt's, or planted) says nobody entered."""
    jit_files.node_local.ensure(post(tmp_path, 1).local)
    write_atomic(post(tmp_path, 1).local / "entered-1.json", json.dumps({"tag": "other", "pid": 1}).encode())
    started = time.monotonic()
    jit_gather.await_peers(post(tmp_path, 0), BOUND_S)
    assert time.monotonic() - started < BOUND_S


def test_an_offer_that_tells_the_set_nothing_waits_on_the_node_for_its_writer_to_carry_it(tmp_path: Path) -> None:
    """Issue 59: a node's ranks are freed one by one, and each rewrote the node's file twice. While local rank 1
    (a source, no outcome yet: it writes the node's share) is at work, rank 2's offer with its outcome stays on the
    node; rank 1's own publish with its outcome carries it, one write for both. Rank 0's first offer goes out at
    once (other ranks may wait for it)."""
    from hpc_ddp.rundir import jit_offers

    where = tmp_path / "run" / "jit" / "a"
    jit_files.offer(post(tmp_path, 1), {"rank": 1, "source": True, "step": 8}, gather_s=0)
    assert [o["rank"] for o in jit_offers.node_offers(where, 0)] == [1]
    jit_files.offer(post(tmp_path, 2), {"rank": 2, "source": True, "step": 8, "outcome": "another writes"},
                    gather_s=0)
    assert [o["rank"] for o in jit_offers.node_offers(where, 0)] == [1]  # left on the node
    jit_files.offer(post(tmp_path, 0), {"rank": 0, "source": True, "step": 8}, gather_s=0)
    assert [o["rank"] for o in jit_offers.node_offers(where, 0)] == [0, 1, 2]  # rank 0's: at once
    jit_files.offer(post(tmp_path, 1), {"rank": 1, "source": True, "step": 8, "outcome": "wrote"}, gather_s=0)
    jit_files.offer(post(tmp_path, 0), {"rank": 0, "source": True, "step": 8, "outcome": "done"}, gather_s=0)
    assert {o["rank"]: o.get("outcome") for o in jit_offers.node_offers(where, 0)} == {
        0: "done", 1: "wrote", 2: "another writes"}


def test_a_nodes_per_rank_states_reach_the_tally_once_from_its_last_rank_at_work(tmp_path: Path) -> None:
    """Issue 59 (B14-SIM with per-rank state): local rank 1 wrote slice 1 and holds its own state while rank 2 is
    still at its part; its publish tells the slice, not its group's one rank: a group's grown rank list, told at
    each publish, was one more entry in the group's tally chain each time. Rank 2, the last at work, tells the
    group once, with both ranks."""
    def said(local: int, offer: dict) -> None:
        jit_files.node_local.ensure(post(tmp_path, local).local)
        write_atomic(post(tmp_path, local).local / f"offer-{local}.json",
                     json.dumps({"tag": "tag", "offer": offer}).encode())

    def told(local: int) -> list[tuple[str, int, list[int]]]:
        return [(f.kind, f.index, f.content.get("ranks", [])) for f in jit_files.publish(
            dataclasses.replace(post(tmp_path, local), group=3), defer=True)]  # a node's 3 ranks a group

    written = {"step": 8, "layout": {"slices": 2}, "entry": {"slices": [1]}}
    said(1, {"rank": 1, "source": True, "written": written, "blobs": {"1": [8]}, "outcome": "wrote"})
    said(2, {"rank": 2, "source": True, "blobs": {"2": [8]}})  # at its part: no outcome yet
    assert told(1) == [("s", 1, [])]
    said(2, {"rank": 2, "source": True, "blobs": {"2": [8]}, "outcome": "passed"})
    assert told(2) == [("r", 0, [1, 2])]


def test_a_source_that_holds_what_its_nodes_writer_wrote_has_nothing_to_tell(tmp_path: Path) -> None:
    """Once a rank of the node wrote its share of step 8 and said what came of it, another source of the node with
    the same fingerprint adds nothing to the run dir; one with another fingerprint, or of another step, does."""
    written = {"step": 8, "layout": {"slices": 2}, "entry": {"slices": [0]}}
    jit_files.node_local.ensure(post(tmp_path, 1).local)
    write_atomic(post(tmp_path, 1).local / "offer-1.json", json.dumps(
        {"tag": "tag", "offer": {"rank": 1, "source": True, "step": 8, "fingerprint": 7, "written": written,
                                 "outcome": "wrote"}}).encode())
    assert jit_files.written_alike(post(tmp_path, 2), 8, 7)
    assert not jit_files.written_alike(post(tmp_path, 2), 8, 9)
    assert not jit_files.written_alike(post(tmp_path, 2), 9, 7)
    assert not jit_files.written_alike(post(tmp_path, 1), 8, 7)  # its own offer is not another's


def test_per_rank_states_wait_on_the_node_for_the_last_rank_at_work_unless_it_died(tmp_path: Path) -> None:
    """Issue 59 (B14-SIM with per-rank state): each rank of a node published its own per-rank states as it was
    freed, and its groups' tally chains grew with the ranks per node. While local rank 1 is at its part (no
    outcome yet, alive), rank 2's states stay on the node, and rank 1's publish with its outcome carries them to
    the node's file and its blobs file, with their tally facts. A rank at work whose process died holds nobody's
    states back: they go out at once."""
    from hpc_ddp.rundir import jit_blobs, jit_offers

    where = tmp_path / "run" / "jit" / "a"

    def per_rank_post(local: int) -> jit_files.Post:
        return jit_files.Post(where, tmp_path / "node-0", local, 0, local, 3, "tag", 6, True, 3)

    def offer(local: int, **fields: object) -> jit_files.jit_tally.Settled:
        jit_files.write_blobs(per_rank_post(local), {local: {8: b"s%d" % local}})
        return jit_files.offer(per_rank_post(local), {"rank": local, "source": True, "step": 8,
                                                       "blobs": {str(local): [8]}, **fields}, gather_s=0)

    jit_gather.enter(per_rank_post(1))  # this process: alive
    offer(1)  # the node's first: at once (nobody else at work)
    offer(2, outcome="another rank writes its share")
    assert [o["rank"] for o in jit_offers.node_offers(where, 0)] == [1]  # rank 2's states wait on the node
    offer(1, outcome="wrote its share")  # the last at work carries them
    assert [o["rank"] for o in jit_offers.node_offers(where, 0)] == [1, 2]
    assert set(jit_blobs.read_blobs(where, 0) or {}) == {1, 2}  # by holder
    assert any(p.name.startswith("r0-") for p in where.glob("tally-8/*"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_atomic(per_rank_post(0).local / "entered-0.json",
                 json.dumps({"tag": "tag", "pid": int(dead.stdout)}).encode())
    write_atomic(per_rank_post(0).local / "offer-0.json", json.dumps(
        {"tag": "tag", "offer": {"rank": 0, "source": True, "step": 8}}).encode())  # killed at its part
    offer(2, outcome="another rank writes its share", fingerprint=1)  # news: not held back by a dead rank
    assert {o["rank"]: o.get("fingerprint") for o in jit_offers.node_offers(where, 0)}[2] == 1
