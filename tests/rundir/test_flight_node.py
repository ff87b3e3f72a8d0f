"""A hang's flight dumps: kept on each node, published as one file per node in errors/ by the first of the node's
ranks to leave (the others find themselves in it); read back by rank, beside older runs' per-rank files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.rundir import flight, flight_node


def spot(tmp_path: Path, rank: int, node: int, tag: str = "job-1-restart-0+token") -> flight_node.Spot:
    return flight_node.Spot(str(tmp_path / "run" / "errors" / "job-1-restart-0-collectives-"),
                            tmp_path / "shm" / f"hpc_ddp-0-x-node-{node}" / "flight", tag, rank, node, 2)


@pytest.fixture(autouse=True)
def private_base(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.rundir import node_local

    monkeypatch.setattr(node_local, "prefix", lambda uid=None: "hpc_ddp-")


def test_a_nodes_ranks_publish_one_file_written_once_and_a_late_rank_adds_itself(tmp_path: Path) -> None:
    ranks = [spot(tmp_path, 0, 0), spot(tmp_path, 1, 0), spot(tmp_path, 2, 1), spot(tmp_path, 3, 1)]
    for where in ranks[:3]:  # rank 3 dumps late
        flight_node.keep(where, {"entries": [{"rank": where.rank}]})
    node0 = flight_node.publish(ranks[0])
    first = node0.stat().st_mtime_ns
    assert flight_node.publish(ranks[1]) == node0 and node0.stat().st_mtime_ns == first  # no second write
    flight_node.publish(ranks[2])
    flight_node.keep(ranks[3], {"entries": [{"rank": 3}]})
    flight_node.publish(ranks[3])  # node 1's file said only rank 2: written again with rank 3
    errors = tmp_path / "run" / "errors"
    assert sorted(p.name for p in errors.iterdir()) == ["job-1-restart-0-collectives-node-0.json",
                                                         "job-1-restart-0-collectives-node-1.json"]
    dumps = flight.read(ranks[0].prefix)
    assert {r: d["entries"][0]["rank"] for r, d in dumps.items()} == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_dump_without_the_attempts_token_is_not_published(tmp_path: Path) -> None:
    mine, planted = spot(tmp_path, 0, 0), spot(tmp_path, 1, 0, tag="job-1-restart-0+guess")
    flight_node.keep(planted, {"entries": [{"rank": "planted"}]})
    flight_node.keep(mine, {"entries": [{"rank": 0}]})
    flight_node.publish(mine)
    assert list(flight.read(mine.prefix)) == [0]


def test_older_runs_per_rank_dumps_are_still_read(tmp_path: Path) -> None:
    errors = tmp_path / "errors"
    errors.mkdir()
    (errors / "job-1-restart-0-collectives-rank-3.json").write_text(json.dumps({"entries": [1]}))
    assert flight.read(str(errors / "job-1-restart-0-collectives-rank-")) == {3: {"entries": [1]}}
    assert flight.read(str(errors / "job-1-restart-0-collectives-")) == {3: {"entries": [1]}}
