"""The survivors' snapshot written: the state file of the step a survivor claimed (the whole state,
or its node's share of it), then the commit if the set is complete
(:mod:`hpc_ddp.rank.salvage.jit_commit`).

Apart from the failure path that offers and claims (:mod:`~hpc_ddp.rank.salvage.jit`) and from its
checks (:mod:`~hpc_ddp.rank.salvage.jit_checks`): this is the one part that writes the state, split
over the surviving nodes as a periodic snapshot is (issue 45), and the one that must not commit a
torn one.
"""

from __future__ import annotations

import time
from typing import Any

from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rank.salvage import jit_commit
from hpc_ddp.rank.salvage.device_clock import Mark
from hpc_ddp.rank.salvage.survivor import Survivor
from hpc_ddp.rundir import jit_files, slicing, snapshot
from hpc_ddp.rundir.snapshot import write as snapshot_write

# how long after its failure the survivor that completes the set waits for the other survivors'
# offers before comparing (0.5 s until issue 59: a source that offers later compares itself with the
# commit, and rank 0 compares every offer again before it resumes; the wait only held the commit
# back, and each rank of a node freed meanwhile rewrote the node's file)
OFFER_WAIT_S = 0.1


def split_over(env: DistEnv, broadcast: dict[str, set[str]]) -> tuple[int, int]:
    """(this node's index, the node count) the survivors' snapshot is split over: each surviving
    node writes its share, as in a periodic snapshot, so its time falls with the node count (issue
    45). (0, 1), one survivor writing the whole state, on one node and where ``broadcast`` names
    buffers: the DDP buffers this rank holds are its own, not rank 0's (the boundary's broadcast of
    them had not finished), and only rank 0 may write then
    (:func:`~hpc_ddp.rank.salvage.jit_checks.buffers_source_holds`). A rank that holds rank 0's
    buffers (rank 0, or any rank once the boundary synced them) splits as for any model: every
    writer's share then holds the same statistics (issue 59: a BatchNorm model used to be written
    whole by one survivor)."""
    if env.num_nodes < 2 or any(broadcast.values()):
        return 0, 1
    return env.node_rank, env.num_nodes


def replicas_of(nodes: int, configured: int) -> int:
    """How many nodes write each slice: at least 2 (the snapshot follows a loss: a lost node's slice
    is written by the node after it), the configured ``snapshot.replicas`` if more, never more than
    the nodes."""
    return 1 if nodes == 1 else min(nodes, max(2, int(configured)))


def write_claimed(run: Survivor, post: jit_files.Post, step: int, state: dict[str, Any],
                  offer: dict[str, Any], started: float, mark: Mark,
                  share: tuple[int, int] = (0, 1)) -> str:
    """The claimed step's file; then, where this writer completed the set (the step's tally,
    :mod:`hpc_ddp.rundir.jit_tally`) and once the other survivors' offers had a moment to come in,
    the check and the commit (:func:`jit_commit.settled`). Not committed when the training
    thread began the update after ``mark`` while the state was read and written (on the device, for
    a GPU: :meth:`~hpc_ddp.rank.salvage.held.Held.intact`): the file may hold parameters half-way
    to the next step."""
    index, nodes = share
    # a part of a tensor is copied (torch.save of a view writes its whole storage: every node would
    # write the whole state, as B13-SPLIT's first run showed); a whole tensor never is
    content, split, held = slicing.node_content(state, index, nodes,
                                                replicas_of(nodes, run.config.snapshot.replicas),
                                                {}, copy=nodes > 1)
    directory = snapshot.step_dir(run.run_dir, step)
    name = jit_files.file_name(run.env.rank) if nodes == 1 else jit_files.node_file_name(index)
    writing = time.monotonic()
    entry = snapshot_write.write_node_file(directory, 0, content, name=name, split=split)
    wrote_s = time.monotonic() - writing
    assert run.held is not None  # for the type checker: after_failure writes only with a Held
    if not run.held.intact(mark):  # written from a side thread while training went on
        return ("not committed: this rank's training went on (an optimizer update) while the "
                "state was written")
    offer.update(written={"step": step, "entry": {**entry, "slices": held, "ranks": []},
                          "layout": split, "took_s": round(time.monotonic() - started, 3),
                          "write_s": round(wrote_s, 3)})
    # a survivor whose offer comes later may complete the set
    said = jit_files.offer(post, offer)
    if said.whole:  # the other survivors' offers come in before the sources are compared
        time.sleep(max(0.0, OFFER_WAIT_S - (time.monotonic() - started)))
    what = "its node's share" if nodes > 1 else "the state"
    return (jit_commit.settled(run, post.shared, said)
            or f"wrote {what} of step {step}; the survivor that completes the set commits it")
