"""The rank's front door for a failure (hpc_ddp.rank.attempt.failure), phase by phase, with the process's
exits and waits replaced: what must be on disk before a rank can be killed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_ddp.rank.attempt import failure
from hpc_ddp.rundir import flight, flight_node


class KilledInTheWait(BaseException):
    """The launcher's SIGKILL, arriving while the rank waits before its exit."""


def test_a_hung_ranks_node_dump_is_published_before_it_waits_to_exit(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank other than 0 waits a few seconds before it exits (its exit would fail rank 0's collective before
    rank 0 recorded the hang). Rank 0 then writes the ledger and exits, which ends the step: the launcher's
    SIGKILL came 3 s later, inside that wait, and the stuck rank's node had no dump in errors/ (CI, stop 67).
    The node's file is written before the wait."""
    from hpc_ddp.rundir import node_local

    monkeypatch.setattr(node_local, "prefix", lambda uid=None: "hpc_ddp-")
    spot = flight_node.Spot(str(tmp_path / "run" / "errors" / "job-1-restart-0-collectives-"),
                            tmp_path / "shm" / "hpc_ddp-0-x-node-1" / "flight", "job-1-restart-0+token", 1, 1, 1)
    monkeypatch.setattr(flight_node, "spot_for", lambda run_dir, env: spot)
    monkeypatch.setattr(flight, "record", lambda: {"entries": [{"rank": 1}]})

    def killed(seconds: float) -> None:
        raise KilledInTheWait

    monkeypatch.setattr(failure.time, "sleep", killed)
    monkeypatch.setattr(failure, "_exit", lambda code: pytest.fail(f"exited {code} without the wait"))
    env = SimpleNamespace(rank=1, is_main=False, node_rank=1)
    attempt = SimpleNamespace(env=env, run_dir=tmp_path / "run", after_failure=None, liveness=None, wrapped=False)
    with pytest.raises(KilledInTheWait):
        failure._hung(attempt, 8.0, "Stuck: rank 1 at step 17 forward", [1])  # type: ignore[arg-type]
    assert {rank: dump["entries"] for rank, dump in flight.read(spot.prefix).items()} == {1: [{"rank": 1}]}
