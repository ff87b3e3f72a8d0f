"""Just-in-time snapshot: when a rank is lost, the survivors write the step they hold (issue 35).

DDP keeps the replicated state (model, optimizer, schedulers, the global data position) alike on
every rank after each optimizer step, so when a rank dies the others still hold all of it. A
failure then need not cost the work since the last periodic snapshot: a survivor writes the
newest step it holds whole, and the healed step (or the requeue) resumes from it.

**What a rank holds whole** (:class:`hpc_ddp.rank.salvage.held.Held`): the live parameters and optimizer state
while no update began since the last ``run.boundary(k)``, with what else a step changes copied at each
boundary. A rank whose optimizer stepped after boundary k holds no whole step: the code between
``step()`` and the next boundary (a scheduler, an EMA, a logging collective) may not have run, and it
is no source. A write from a side thread while the training thread runs on (a false alarm) is
committed only when the held generation did not move while it was written: nothing torn is committed.

**Per-rank state.** Under ``train.rng=derived`` every rank's RNGs are reseeded from (seed, step,
rank) at every boundary and resume, so the lost ranks' randomness is known without a copy.
``per_rank(...)`` objects are mirrored at every boundary to a buddy on another node
(:mod:`hpc_ddp.rank.salvage.mirror`); each survivor leaves what it holds (its own state and its ward's, each
of their last two boundaries: survivors that stopped at two steps complete the older one) beside its offer,
and the snapshot is committed only when every rank's state of the same step is there. When one is
missing (a rank and its buddy both lost, a mirror more than a step behind), or with ``train.rng=saved``,
nothing is committed and the run resumes from the last periodic snapshot; the offers say why, and the
batch shell's ledger line repeats it.

**Agreeing without the lost rank.** The process group is broken and its store may have been on
the lost node, so the survivors meet in the run dir, which every node shares. Each survivor
whose collective failed writes its offer (the step it holds whole and the state's fingerprint, or why it
holds none) on its node, and the node's ranks' offers are published together as one file per node
(``RUN_DIR/jit/<attempt>/node-N.json``, :mod:`hpc_ddp.rundir.jit_files`). A source claims its step by
creating ``claim-step-S`` exclusively (one writer per step, whichever comes first), writes the
whole replicated state as one file, compares its fingerprint with every other offer of that step
it can read (survivors that disagree: nothing is committed), and commits the manifest with a
``jit`` entry (writer, seconds, the failure). With per-rank state the survivor whose offer completes
the set (the state file written, every rank's per-rank state of that step held by someone) commits,
whoever it is: no survivor waits for another, so none keeps a blocked peer from contributing
(:mod:`hpc_ddp.rank.salvage.jit_commit`). A survivor that holds a newer step (it passed one more optimizer
update before its collective failed) claims that one: resume takes the newest.
It is an ordinary committed snapshot, verified like any other on resume.

A survivor that stays alive keeps the peers that wait on it blocked (gloo frees a rank only when
the peer it waits on exits, measured), so one source writes and every rank exits as soon as it is
done; a rank blocked elsewhere is freed as the others exit. The write must end within Slurm's
KillWait (the time between srun's SIGTERM and its SIGKILL, 30 s by default) or the rehearsal's
grace: an unfinished write is never committed, and the run falls back to the periodic snapshot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hpc_ddp.rank.state.ddp_settle import ddp_in

from hpc_ddp.core.errors import first_line
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rank.salvage import jit_commit
from hpc_ddp.rank.state import replication
from hpc_ddp.rank.salvage.held import Held, buffers  # noqa: F401  (Held and buffers were defined here first)
from hpc_ddp.rank.salvage.survivor import Survivor
from hpc_ddp.rank.state.checkpointer import STEP
from hpc_ddp.rundir import (jit_claims, jit_files, jit_offers, newest, slicing, snapshot,
                            snapshot_write)

log = logging.getLogger("hpc_ddp.jit")
OFFER_WAIT_S = 0.5  # how long after its failure the writer waits for the other survivors' offers before comparing
HANDLER_WAIT_S = 25.0  # how long a second failure handler waits for the first one's write (under KillWait)
SIDE_WAIT_S = 20.0  # how long the liveness or watchdog thread waits for the survivors' snapshot before it exits
BUFFERS_SOURCE_WAIT_S = 1.0  # how long another survivor waits for rank 0's offer when DDP broadcasts rank 0's buffers
NEWEST_FRESH_S = 0.5  # how old a node's read of snapshots/newest.json may be for another survivor of the node


def why_not(run: Survivor) -> str | None:
    """Why this run can write no just-in-time snapshot whatever rank is lost, or None."""
    if run.config.train.rng != "derived":
        return "train.rng=saved: a lost rank's RNG state died with it (train.rng=derived derives it)"
    if run.per_rank and run.mirror is None:
        return (f"per_rank objects ({', '.join(sorted(run.per_rank))}) are not mirrored (one rank): a lost "
                "rank's died with it")
    return None


def warn_unprotected(run: Survivor) -> None:
    """Rank 0, at resume: a run that can have no just-in-time snapshot and takes no periodic one would lose
    everything since its start to a failure; say so now, not after the failure."""
    reason, cfg = why_not(run), run.config.snapshot
    if reason and run.env.is_main and not cfg.every_steps and not cfg.every_minutes:
        log.warning("a failure would lose every step since the start: the survivors can write no snapshot (%s) "
                    "and snapshot.every_steps and snapshot.every_minutes are null.\nHINT: set "
                    "snapshot.every_steps=N (or every_minutes), or track no per_rank objects with train.rng=derived",
                    reason)


def fingerprint(state: dict[str, Any], step: int, skip_buffers: dict[str, set[str]]) -> int:
    """One number for the replicated state (rank/state/replication.py's digests), without the buffers DDP broadcasts
    from rank 0 at the next forward (they differ by rank between boundaries, by design)."""
    kept = {name: ({k: v for k, v in value.items() if k not in skip_buffers[name]} if name in skip_buffers else value)
            for name, value in state.items() if name != STEP}
    return replication.combined([(f"{name}/{path}", d) for name, items in replication.fingerprints(kept, step).items()
                                 for path, d in items])


def after_failure(run: Survivor, error: BaseException) -> dict[str, Any] | None:
    """This rank's part after its program raised (a collective that failed because a peer died): offer what it
    holds, and write and commit it if it is the first source of its step. Returns what it did (also in its
    offer), or None when snapshot.jit is off. Never raises: the failure it follows is what the worker reports."""
    if run.held is None:
        return None
    started = time.monotonic()
    env: DistEnv = run.env
    post = jit_files.post_for(run.run_dir, env)
    folder = post.shared
    offer: dict[str, Any] = {"rank": env.rank, "host": os.uname().nodename, "error": first_line(error),
                             "time": round(time.time(), 3)}
    try:
        mirror = run.mirror
        if mirror is not None:  # this rank's per-rank states and its ward's, whatever this rank holds besides
            blobs = mirror.held()
            jit_files.write_blobs(post, blobs)
            offer["blobs"] = {str(r): list(states) for r, states in blobs.items()}  # {rank: [steps], newest first}
            if mirror.broken is not None:
                offer["mirror_broken"] = mirror.broken
        reason = why_not(run)
        generation = run.held.generation  # read first: a write that sees it move holds a torn state
        synced = run.held.buffers_synced  # rank 0's buffers on every rank (rank/salvage/held.py)
        held = run.held.whole() if reason is None else reason
        if isinstance(held, str):
            return _no_source(run, post, offer, held)
        step, state = held
        broadcast = {name: run.held.buffer_keys(name) for name, obj in run.tracked.items()
                     if (ddp := ddp_in(obj)) is not None and ddp.broadcast_buffers and env.world_size > 1}
        skip = {} if synced else broadcast  # this rank's buffers are its own, not rank 0's
        share = split_over(env, broadcast)
        if any(skip.values()) and env.rank != 0 and not _buffers_source_holds(folder, step):
            return _no_source(run, post, offer, (
                f"rank 0's DDP buffers (BatchNorm's running statistics) of step {step} are not on this rank (the "
                f"boundary's broadcast of them had not finished) and rank 0 offers no step {step}: a snapshot "
                "from here would mix this rank's own statistics into the run"))
        # never over the broadcast buffers: a survivor whose boundary broadcast had finished and one whose had not
        # hold the same step with other statistics; which of them may write is decided above, not by a mismatch
        offer.update(source=True, step=step, fingerprint=fingerprint(state, step, broadcast))
        news = jit_files.offer(post, offer)
        latest = jit_files.once_per_node(post, "newest", lambda: _latest_commit(run.run_dir), fresh_s=NEWEST_FRESH_S)
        if latest is not None and latest >= step:
            offer.update(outcome=jit_files.once_per_node(  # the same state as a peer that compared it: its answer
                post, f"checked-{step}-{offer['fingerprint']}",
                lambda: jit_commit.check_commit(run.run_dir, folder, step, latest, offer)))
        elif any(skip.values()) and env.rank != 0:  # rank 0 holds the step: it writes, with its buffers
            offer.update(outcome=_check_set(run, folder, news) if mirror is not None
                         else jit_commit.claimed_by_another(run.run_dir, step, folder, offer))
        elif not jit_claims.claim_on_node(post, step) or (share[1] == 1 and not jit_claims.claim(folder, step)):
            offer.update(outcome=_check_set(run, folder, news) if mirror is not None else _lost_claim(
                run, folder, step, offer, share))
        else:
            offer.update(outcome=_write(run, post, step, state, offer, started, generation, share))
        if jit_files.offer(post, offer) and mirror is not None and not offer["outcome"].startswith("committed"):
            offer.update(outcome=_check_set(run, folder, True))  # it carried another rank's news: check them
            jit_files.offer(post, offer)
        return offer
    except Exception as err:  # noqa: BLE001 - the snapshot is a bonus: the failure it follows must still be reported
        log.error("the just-in-time snapshot failed: %r", err)
        offer.update(outcome=f"failed: {err!r}")
        try:
            jit_files.offer(post, offer)
        except OSError:
            pass
        return offer


class OneHandler:
    """:func:`after_failure` once per process, whichever thread comes first (issue 44).

    The training thread (its collective failed), the liveness thread (a frozen peer, a declaration) and
    the watchdog thread (a hang) may each start the survivors' snapshot, and the second used to write
    the same files over the first (and a thread that exits after it cut the first write short). The
    first caller writes; a later one waits for it, up to ``wait_s`` (under Slurm's KillWait, 30 s by
    default), and returns what it did, so that whichever thread ends the process ends it after the write.

    A side thread passes ``wait_s`` for its own call too: its write then runs in a thread of its own, and
    the side thread goes on to exit when the bound passes, whatever the write waits for (on a GPU, a
    read of the state queues behind a wedged collective's kernel). The training thread's own write runs
    inline, as long as it takes."""

    def __init__(self, handler: Callable[[BaseException], dict[str, Any] | None],
                 wait_s: float = HANDLER_WAIT_S) -> None:
        self.handler, self.wait_s = handler, wait_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self._result: dict[str, Any] | None = None

    def __call__(self, error: BaseException, wait_s: float | None = None) -> dict[str, Any] | None:
        with self._lock:
            first, self._started = not self._started, True
        if first and wait_s is None:
            self._run(error)
            return self._result
        if first:
            threading.Thread(target=self._run, args=(error,), name="hpc_ddp-failure", daemon=True).start()
        limit = wait_s if wait_s is not None else self.wait_s
        if not self._done.wait(limit):
            log.warning("the survivors' snapshot of this rank did not end within %g s: this rank exits without it",
                        limit)
        return self._result

    def _run(self, error: BaseException) -> None:
        try:
            self._result = self.handler(error)
        finally:
            self._done.set()


def _latest_commit(run_dir: Path) -> int | None:
    """The newest committed step, from the file that names it (read by name): not by reading every step's
    manifest, which would look up the one survivors are about to commit and make this node's NFS client
    remember it as absent (:mod:`hpc_ddp.rundir.newest`). A run dir older than that file: by its manifests."""
    named = newest.read(run_dir)
    if named is not None:
        return int(named["step"])
    steps = snapshot.committed_steps(run_dir)
    return steps[0] if steps else None


def _no_source(run: Survivor, post: jit_files.Post, offer: dict[str, Any], why: str) -> dict[str, Any]:
    """This rank holds no step it may write: say why; with a mirror, its per-rank states may still be what
    another survivor's snapshot lacks."""
    offer.update(source=False, why=why)
    news = jit_files.offer(post, offer)
    log.warning("no just-in-time snapshot from this rank: %s", why)
    if run.mirror is not None:
        offer.update(outcome=_check_set(run, post.shared, news))
        jit_files.offer(post, offer)
    return offer


def _check_set(run: Survivor, folder: Path, news: bool) -> str:
    """Whether this rank's offer completed the set, checked by the one rank whose publish of its node's file
    brought news (:func:`hpc_ddp.rundir.jit_files.publish`): per node and change, not per rank."""
    if not news:
        return "this node's offers went out with another rank's, which checked the set"
    return jit_commit.complete(run, folder)


def _lost_claim(run: Survivor, folder: Path, step: int, offer: dict[str, Any],
                share: tuple[int, int]) -> str:
    """Another source writes this step (the whole state), or this node's share of it (a split): with one writer
    for the step, wait for its commit and compare (:func:`jit_commit.claimed_by_another`); a node's other
    sources need not, and exit (rank 0 compares every source's offer before the next attempt resumes from it)."""
    if share[1] == 1:
        return jit_commit.claimed_by_another(run.run_dir, step, folder, offer)
    return f"another rank of this node writes its share of step {step}"


def _buffers_source_holds(folder: Path, step: int, wait_s: float = BUFFERS_SOURCE_WAIT_S) -> bool:
    """Whether rank 0 offers the same step (waiting up to ``wait_s`` for its offer). DDP broadcasts rank 0's
    buffers (BatchNorm's running statistics) at every forward, so rank 0's are the step's: a periodic snapshot
    holds them, and a survivors' snapshot written by another rank would hold that rank's own and the resumed
    run would drift from one never stopped. Rank 0 then writes it (a stop that broke a step leaves every rank
    alive). Only where the boundary's broadcast had not finished (rank/salvage/held.py ``buffers_synced``): when rank 0
    was lost then, nobody writes that step, and the run falls back rather than resume from a mixture."""
    deadline = time.monotonic() + wait_s
    while True:
        found = next((o for o in jit_offers.offers(folder, 1) if o.get("rank") == 0), None)
        if found is not None:
            return bool(found.get("source")) and found.get("step") == step
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def split_over(env: DistEnv, broadcast: dict[str, set[str]]) -> tuple[int, int]:
    """(this node's index, the node count) the survivors' snapshot is split over: each surviving node writes
    its share, as in a periodic snapshot, so its time falls with the node count (issue 45). (0, 1), one
    survivor writing the whole state, on one node and where DDP broadcasts buffers: only rank 0 or a rank that
    holds rank 0's buffers may write then (:func:`_buffers_source_holds`), which no split can promise."""
    if env.num_nodes < 2 or any(broadcast.values()):
        return 0, 1
    return env.node_rank, env.num_nodes


def replicas_of(nodes: int, configured: int) -> int:
    """How many nodes write each slice: at least 2 (the snapshot follows a loss: a lost node's slice is written
    by the node after it), the configured ``snapshot.replicas`` if more, never more than the nodes."""
    return 1 if nodes == 1 else min(nodes, max(2, int(configured)))


def _write(run: Survivor, post: jit_files.Post, step: int, state: dict[str, Any], offer: dict[str, Any],
           started: float, generation: int, share: tuple[int, int] = (0, 1)) -> str:
    """The claimed step's file; then, once the other survivors' offers had a moment to come in, the commit if
    the set is complete (:func:`jit_commit.complete`). Not committed when the training thread began an update or
    reached its next boundary while the state was read and written (``generation`` moved): the file may hold
    parameters half-way to the next step."""
    index, nodes = share
    # a part of a tensor is copied (torch.save of a view writes its whole storage: every node would write the
    # whole state, as B13-SPLIT's first run showed); a whole tensor never is
    content, split, held = slicing.node_content(state, index, nodes, replicas_of(nodes, run.config.snapshot.replicas),
                                                {}, copy=nodes > 1)
    directory = snapshot.step_dir(run.run_dir, step)
    name = jit_files.file_name(run.env.rank) if nodes == 1 else jit_files.node_file_name(index)
    writing = time.monotonic()
    entry = snapshot_write.write_node_file(directory, 0, content, name=name, split=split)
    wrote_s = time.monotonic() - writing
    assert run.held is not None  # for the type checker: after_failure writes only with a Held
    if run.held.generation != generation:  # written from a side thread while the training thread went on
        return ("not committed: this rank's training went on (an optimizer update or a boundary) while the "
                "state was written")
    offer.update(written={"step": step, "entry": {**entry, "slices": held, "ranks": []}, "layout": split,
                          "took_s": round(time.monotonic() - started, 3), "write_s": round(wrote_s, 3)})
    jit_files.offer(post, offer)  # a survivor whose offer comes later may complete the set
    time.sleep(max(0.0, OFFER_WAIT_S - (time.monotonic() - started)))  # the other survivors' offers come in
    return jit_commit.complete(run, post.shared)
