"""Just-in-time snapshot: when a rank is lost, the survivors write the step they hold (issue 35).

DDP keeps the replicated state (model, optimizer, schedulers, the global data position) alike on
every rank after each optimizer step, so when a rank dies the others still hold all of it. A failure
then need not cost the work since the last periodic snapshot: a survivor writes the newest step it
holds whole, and the healed step (or the requeue) resumes from it.

**What a rank holds whole** (:class:`hpc_ddp.rank.salvage.held.Held`): the live parameters and
optimizer state while no update began since the last ``run.boundary(k)``, with what else a step
changes copied at each boundary. A rank whose optimizer stepped after boundary k holds no whole
step: the code between ``step()`` and the next boundary (a scheduler, an EMA, a logging collective)
may not have run, and it is no source. A write from a side thread while the training thread runs on
(a false alarm) is committed only when the held generation did not move while it was written:
nothing torn is committed.

**Per-rank state.** Under ``train.rng=derived`` every rank's RNGs are reseeded from (seed, step,
rank) at every boundary and resume, so the lost ranks' randomness is known without a copy.
``per_rank(...)`` objects are mirrored at every boundary to a buddy on another node
(:mod:`hpc_ddp.rank.salvage.mirror`); each survivor leaves what it holds (its own state and its
ward's, each of their last two boundaries: survivors that stopped at two steps complete the older
one) beside its offer, and the snapshot is committed only when every rank's state of the same step
is there. When one is missing (a rank and its buddy both lost, a mirror more than a step behind), or
with ``train.rng=saved``, nothing is committed and the run resumes from the last periodic snapshot;
the offers say why, and the batch shell's ledger line repeats it.

**Agreeing without the lost rank.** The process group is broken and its store may have been on the
lost node, so the survivors meet in the run dir, which every node shares. Each survivor whose
collective failed writes its offer (the step it holds whole and the state's fingerprint, or why it
holds none) on its node, and the node's ranks' offers are published together as one file per node
(``RUN_DIR/jit/<attempt>/node-N.json``, :mod:`hpc_ddp.rundir.jit_files`). A source claims its step
by creating ``claim-step-S`` exclusively (one writer per step, whichever comes first), writes the
whole replicated state as one file, compares its fingerprint with every other offer of that step it
can read (survivors that disagree: nothing is committed), and commits the manifest with a ``jit``
entry (writer, seconds, the failure). With per-rank state the survivor whose offer completes the set
(the state file written, every rank's per-rank state of that step held by someone) commits, whoever
it is: no survivor waits for another, so none keeps a blocked peer from contributing
(:mod:`hpc_ddp.rank.salvage.jit_commit`). A survivor that holds a newer step (it passed one more
optimizer update before its collective failed) claims that one: resume takes the newest. It is an
ordinary committed snapshot, verified like any other on resume.

A survivor that stays alive keeps the peers that wait on it blocked (gloo frees a rank only when the
peer it waits on exits, measured), so one source writes and every rank exits as soon as it is done;
a rank blocked elsewhere is freed as the others exit. The write must end within Slurm's KillWait
(the time between srun's SIGTERM and its SIGKILL, 30 s by default) or the rehearsal's grace: an
unfinished write is never committed, and the run falls back to the periodic snapshot.

This module is the failure path: what a survivor offers, and whether it compares, leaves or writes
its step, once per process (:class:`OneHandler`). Whether a rank may be a source, and the
fingerprint the sources compare, are :mod:`~hpc_ddp.rank.salvage.jit_checks`'s; the state file
written is :mod:`~hpc_ddp.rank.salvage.jit_write`'s, the commit
:mod:`~hpc_ddp.rank.salvage.jit_commit`'s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.core.errors import first_line
from hpc_ddp.rank.salvage import device_read, jit_commit
from hpc_ddp.rank.salvage.device_clock import Holding
# Held and buffers were defined here first
from hpc_ddp.rank.salvage.held import Held
from hpc_ddp.rank.salvage.held_copies import buffers  # noqa: F401
from hpc_ddp.rank.salvage.jit_checks import (broadcast_buffers, fingerprint, rank_zero_offer,
                                             why_not,
                                             why_not_buffers)
from hpc_ddp.rank.salvage.jit_write import split_over, write_claimed
from hpc_ddp.rank.salvage.one_handler import HANDLER_WAIT_S, OneHandler  # noqa: F401 (its home)
from hpc_ddp.rank.salvage.survivor import Survivor
from hpc_ddp.rank.state.tracked import mirrored
from hpc_ddp.rundir import jit_claims, jit_files, jit_gather, newest

log = logging.getLogger("hpc_ddp.jit")
# how long the liveness or watchdog thread waits for the survivors' snapshot before it exits
SIDE_WAIT_S = 20.0
# how old a node's read of snapshots/newest.json may be for another survivor of the node
NEWEST_FRESH_S = 0.1


def after_failure(run: Survivor, error: BaseException) -> dict[str, Any] | None:
    """This rank's part after its program raised (a collective that failed because a peer died):
    offer what it holds, and write and commit it if it is the first source of its step. Returns what
    it did (also in its offer), or None when snapshot.jit is off. Never raises: the failure it
    follows is what the worker reports."""
    if run.held is None:
        return None
    started = time.monotonic()
    post = jit_files.post_for(run.run_dir, run.env, per_rank=bool(mirrored(run.per_rank)))
    # the node's name as Slurm (or the rehearsal's simulated node) gives it; else the host's
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    offer: dict[str, Any] = {"rank": run.env.rank, "host": host,
                             "error": first_line(error), "time": round(time.time(), 3)}
    try:
        # the node's first offers wait for this rank's (rundir/jit_gather.py)
        jit_gather.enter(post)
        return _offer(run, run.held, post, offer, started)
    except Exception as err:  # noqa: BLE001
        # the snapshot is a bonus: the failure it follows must still be reported
        log.error("the just-in-time snapshot failed: %r", err)
        offer.update(outcome=f"failed: {err!r}")
        try:
            jit_files.offer(post, offer)
        except OSError:
            pass
        return offer


def _offer(run: Survivor, held: Held, post: jit_files.Post, offer: dict[str, Any],
           started: float) -> dict[str, Any]:
    """What this rank holds, offered (its mirror's states, whatever else it holds), and its part in
    the snapshot of the step it holds whole: compare with a commit of that step or later, leave the
    step to rank 0 or to the survivor that claimed it first, or write it
    (:mod:`~hpc_ddp.rank.salvage.jit_write`)."""
    env, folder, mirror = run.env, post.shared, run.mirror
    if mirror is not None:  # this rank's per-rank states and its ward's, whatever it holds besides
        _with_blobs(mirror, post, offer)
    reason = why_not(run)
    whole = held.whole() if reason is None else reason
    if not isinstance(whole, str):  # a GPU's state: read once, off the wedged stream
        whole = _on_host(held, *whole)
    if isinstance(whole, str):
        return _no_source(run, post, offer, whole)
    step, state, holding = whole
    synced = holding.synced  # rank 0's buffers on every rank (rank/salvage/held.py)
    broadcast = broadcast_buffers(run, held)
    # unsynced: this rank's buffers are its own, not rank 0's
    skip = any(({} if synced else broadcast).values())
    # rank 0's own buffers are the step's: it splits as a synced rank does (issue 59)
    share = split_over(env, {} if synced or env.rank == 0 else broadcast)
    if skip and (missing := why_not_buffers(env.rank, folder, step, read=jit_files.per_node(
            post, "rank-0-offer", lambda: rank_zero_offer(folder)))) is not None:
        return _no_source(run, post, offer, missing)
    # never over the broadcast buffers: survivors before and after their boundary's broadcast hold
    # the same step with other statistics; which of them may write is decided above
    offer.update(source=True, step=step, fingerprint=fingerprint(state, step, broadcast))
    split = mirror is None and not skip and share[1] > 1  # one offer a rank, two a writer
    if split and jit_files.written_alike(post, step, offer["fingerprint"]):
        return _said_by_writer(post, offer, step)  # no read of the run dir: nothing to tell it
    latest = jit_files.once_per_node(post, "newest", lambda: jit_commit.latest_commit(run.run_dir),
                                     fresh_s=NEWEST_FRESH_S)
    if latest is not None and latest >= step and mirror is None:
        return _late(run, post, offer, step, latest)
    if split:
        return _split(run, post, offer, step, state, started, holding, share)
    news = jit_commit.settled(run, folder, jit_files.offer(post, offer))
    if news is not None and news.startswith("committed"):
        offer.update(outcome=news)  # what its node said completed the set: this rank committed
    elif latest is not None and latest >= step:
        # the same state as a peer that compared it: its answer
        offer.update(outcome=jit_files.once_per_node(
            post, f"checked-{step}-{offer['fingerprint']}",
            lambda: jit_commit.check_commit(run.run_dir, folder, step, latest, offer)))
    elif skip and env.rank != 0:  # rank 0 holds the step: it writes, with its buffers
        offer.update(outcome=_passed(news) if mirror is not None
                     else jit_commit.claimed_by_another(run.run_dir, step, folder, offer,
                                                        read=_newest_per_node(run, post)))
    elif (not jit_claims.claim_on_node(post, step)
          or (share[1] == 1 and not jit_claims.claim(folder, step))):
        offer.update(outcome=_passed(news) if mirror is not None else _lost_claim(
            run, post, folder, step, offer, share))
    else:
        offer.update(outcome=write_claimed(run, post, step, state, offer, started,
                                           holding.mark, share))
    if news is not None and news not in offer["outcome"]:  # what its first offer came to
        offer.update(outcome=f"{offer['outcome']}; {news}")
    _tell(run, post, offer)
    return offer


def _split(run: Survivor, post: jit_files.Post, offer: dict[str, Any], step: int,
           state: dict[str, Any], started: float, holding: Holding,
           share: tuple[int, int]) -> dict[str, Any]:
    """A split survivors' snapshot without per-rank state: the node's first source to claim the
    step writes its share, and offers once it is written (its first offer is the written one); the
    node's others offer once, with what came of it (left on the node while its writer is at work,
    which then carries them; once it wrote the same state, not at all: issue 59)."""
    if jit_claims.claim_on_node(post, step):
        offer.update(outcome=write_claimed(run, post, step, state, offer, started, holding.mark,
                                           share))
    else:
        offer.update(outcome=f"another rank of this node writes its share of step {step}")
        if jit_files.written_alike(post, step, offer["fingerprint"]):  # it has nothing to add
            return _said_by_writer(post, offer, step)
    _tell(run, post, offer)
    return offer


def _said_by_writer(post: jit_files.Post, offer: dict[str, Any], step: int) -> dict[str, Any]:
    """A source whose node's writer wrote its share of ``step`` holding the same state: its offer
    stays on the node, and it reads nothing of the run dir (issue 59: a rank freed after its
    writer finished read the newest commit and rewrote its node's file, once per rank). Rank 0
    compares every offer before the next attempt resumes, so one that agrees adds nothing."""
    offer.update(outcome=f"another rank of this node wrote its share of step {step} (same "
                         "fingerprint)")
    jit_files.offer(post, offer, quiet=True)
    return offer


def _with_blobs(mirror: Any, post: jit_files.Post, offer: dict[str, Any]) -> None:
    """The per-rank states this rank holds (its own and its ward's) on its node, named in its
    offer: ``{rank: [steps], newest first}``; with a cadence (``per_rank(..., mirror=N)``) a
    state packed at an earlier boundary stands for this rank's last boundaries, and ``stale`` says
    so (``{rank: {step: the state's step}}``: the commit names it in the ledger)."""
    blobs = mirror.held()
    jit_files.write_blobs(post, blobs)
    offer["blobs"] = {str(r): list(states) for r, states in blobs.items()}
    if mirror.stale:  # set by held()
        offer["stale"] = {str(r): {str(s): older for s, older in given.items()}
                          for r, given in mirror.stale.items()}
    if mirror.broken is not None:
        offer["mirror_broken"] = mirror.broken


def _late(run: Survivor, post: jit_files.Post, offer: dict[str, Any], step: int,
          latest: int) -> dict[str, Any]:
    """A survivor freed after the set was committed (gloo frees a node's ranks one by one as their
    peers exit): compared with the commit first (once per node and fingerprint), and offered in the
    run dir unless it agrees with this attempt's own commit (one that disagrees withdraws it, and a
    resume checks the offers; a step committed otherwise is news for the ledger); one that agrees
    tells the file server nothing (issue 59: each late rank rewrote its node's file twice)."""
    said = jit_files.once_per_node(
        post, f"checked-{step}-{offer['fingerprint']}",
        lambda: jit_commit.check_commit(run.run_dir, post.shared, step, latest, offer))
    offer.update(outcome=said)
    # quiet only where this attempt's own commit holds what it holds: anything else is for the
    # ledger
    jit_files.offer(post, offer, quiet=said.endswith("(same fingerprint)"))
    return offer


def _passed(news: str | None) -> str:
    """A survivor that writes nothing: what its part in the tally came to (:func:`_offer`)."""
    return news or ("this node's offers are in the set's tally; the survivor that completes the "
                    "set checks and commits it")


def _tell(run: Survivor, post: jit_files.Post, offer: dict[str, Any]) -> None:
    """Offer what came of this rank's part, again while its publishes carry news of its node's
    other ranks that it must settle (a fact that completes a set: it checks and commits it)."""
    for _ in range(post.local_size + 1):  # each round carries at least one other rank's news
        came = jit_commit.settled(run, post.shared, jit_files.offer(post, offer))
        said = str(offer.get("outcome") or "")
        if came is None or said.startswith("committed"):
            return
        offer.update(outcome=came if came.startswith("committed") or not said
                     else f"{said}; {came}")


def _on_host(held: Held, step: int, state: dict[str, Any],
             holding: Holding) -> tuple[int, dict[str, Any], Holding] | str:
    """The held state with its device tensors copied to host memory on a stream of their own
    (:mod:`~hpc_ddp.rank.salvage.device_read`), checked after the copy: the update after the step
    had not begun on the device meanwhile. A CPU state as it is (the write checks it)."""
    if held.reader is None:
        return step, state, holding
    read = device_read.to_host(state, held.reader)
    if isinstance(read, str):
        return read
    if not held.intact(holding.mark):
        return (f"the update after step {step} began on this rank's device while its state was "
                "copied to host memory")
    return step, held.to_numbers(read), holding


def _no_source(run: Survivor, post: jit_files.Post, offer: dict[str, Any],
               why: str) -> dict[str, Any]:
    """This rank holds no step it may write: say why; with a mirror, its per-rank states may still
    be what another survivor's snapshot lacks."""
    offer.update(source=False, why=why)
    news = jit_commit.settled(run, post.shared, jit_files.offer(post, offer))
    log.warning("no just-in-time snapshot from this rank: %s", why)
    if run.mirror is not None or news is not None:
        offer.update(outcome=_passed(news))
        _tell(run, post, offer)
    return offer


def _newest_per_node(run: Survivor, post: jit_files.Post) -> Callable[[], Any]:
    """The newest commit's record, read once per node and tenth of a second for the node's waiting
    ranks (not each rank ten times a second: issue 59)."""
    return jit_files.per_node(post, "newest-record", lambda: newest.read(run.run_dir))


def _lost_claim(run: Survivor, post: jit_files.Post, folder: Path, step: int,
                offer: dict[str, Any], share: tuple[int, int]) -> str:
    """Another source writes this step (the whole state), or this node's share of it (a split): with
    one writer for the step, wait for its commit and compare
    (:func:`jit_commit.claimed_by_another`); a node's other sources need not, and exit (rank 0
    compares every source's offer before the next attempt resumes from it)."""
    if share[1] == 1:
        return jit_commit.claimed_by_another(run.run_dir, step, folder, offer,
                                             read=_newest_per_node(run, post))
    return f"another rank of this node writes its share of step {step}"
