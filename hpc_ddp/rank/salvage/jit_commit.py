"""The survivors' snapshot committed once, and only whole (:mod:`hpc_ddp.rank.salvage.jit` writes
the state file).

A survivor that finds the step committed already checks it against what it holds
(:func:`check_commit`: a snapshot that another survivor disagrees with is withdrawn). Otherwise any
survivor may complete the set (:func:`complete`): the newest written step whose sources agree, with
every rank's per-rank state of that step in some survivor's file, is committed by the one survivor
that creates the attempt's commit claim (:func:`hpc_ddp.rundir.jit_claims.claim_commit`: one per
attempt; the batch shell seals it once the step ended, so a late process of the attempt, a
partitioned node's, never commits into a run gone on); the per-rank states go into one more file of
the step, listed with the ranks it holds, so a resumed rank finds its own as it finds its RNG state
in a periodic snapshot.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from hpc_ddp.rank.salvage.survivor import Survivor
from hpc_ddp.rank.state.tracked import mirrored
from hpc_ddp.rank.state.checkpointer import PER_RANK
from hpc_ddp.rundir import (jit_blobs, jit_claims, jit_files, jit_offers, jit_tally, lost, newest,
                            slicing, snapshot)
from hpc_ddp.rundir.snapshot import steps as snapshot_steps, write as snapshot_write

log = logging.getLogger("hpc_ddp.jit")


def check_commit(run_dir: Path, folder: Path, step: int, newest: int, offer: dict[str, Any]) -> str:
    """This source came after the step was committed: if another survivor's snapshot of the same
    step holds another state than this rank (their fingerprints differ), withdraw it (the manifest
    is renamed away before any rank of the next step can read it: they start once every rank of this
    one has exited)."""
    if newest != step:
        return f"step {newest} is committed already"
    directory = snapshot.step_dir(run_dir, step)
    manifest = snapshot_steps.read_manifest(directory) or {}
    record = manifest.get("jit")
    if not isinstance(record, dict) or record.get("attempt") != folder.name:
        return f"step {step} is committed already"
    if record.get("fingerprint") == offer["fingerprint"]:
        return f"step {step} committed by another survivor (same fingerprint)"
    snapshot.withdraw(directory, f"rank {offer['rank']} holds another state of step {step} than "
                                 f"rank {record.get('writer')} wrote")
    log.error("withdrew the just-in-time snapshot of step %d: rank %s wrote another state than "
              "this rank holds",
              step, record.get("writer"))
    return (f"withdrew step {step}: rank {record.get('writer')} wrote another state than "
            f"rank {offer['rank']} holds")


def claimed_by_another(run_dir: Path, step: int, folder: Path, offer: dict[str, Any],
                       wait_s: float = 10.0,
                       read: Callable[[], dict[str, Any] | None] | None = None) -> str:
    """Another survivor writes the step: wait a little for its commit (this rank's exit would free
    ranks that wait on it, but also tells the batch shell the step ended), then compare it with what
    this rank holds (:func:`check_commit`: withdrawn if it differs), and say what came of it.
    ``read``: the newest commit's record (the survivors pass one read per node and tenth of a
    second, shared by the node's ranks: issue 59; by default this rank reads it)."""
    deadline = time.monotonic() + wait_s
    read = read or (lambda: newest.read(run_dir))
    # polls the newest commit's own file: never a manifest not there yet,
    while time.monotonic() < deadline:
        # whose absence this node's NFS client would remember (rundir/newest.py)
        named = read()
        if named is not None and named["step"] >= step:
            return check_commit(run_dir, folder, step, named["step"], offer)
        time.sleep(0.1)
    return f"another survivor claimed step {step}; not committed within {wait_s:g} s"


def complete(run: Survivor, folder: Path) -> str:
    """Commit the newest written step whose set is complete: every slice of the state written by a
    survivor (the whole state by one, or each node's share by that node,
    :func:`hpc_ddp.rank.salvage.jit_write.split_over`), no source of it holds another state, and
    (with per_rank objects) every rank's per-rank state of that step is in some survivor's file. Any
    survivor may complete it; the attempt's commit claim makes one the committer. Otherwise say what
    is missing. A rank declared lost in the attempt is no survivor (:mod:`hpc_ddp.rundir.lost`): its
    offers are not taken, and it commits nothing. The failure path calls it once per attempt, from
    the survivor that found the set whole in the tally (:func:`settled`): it opens every node's
    file."""
    env = run.env
    fence = lost.fence_at(folder)  # a declared rank's offers are never taken
    if env.rank in fence.declared:
        return ("not committed: this rank was declared lost in this attempt (its node cut off, or "
                "a false alarm); the other survivors commit without it")
    said = jit_offers.offers(folder, max(1, env.num_nodes))  # one file per node, opened by name
    offers = fence.offers(said)
    set_aside = sorted({o.get("rank") for o in said} - {o.get("rank") for o in offers})
    steps = sorted({o["written"]["step"] for o in offers if isinstance(o.get("written"), dict)},
                   reverse=True)
    reasons = []
    for step in steps:
        ready = _ready(run, folder, offers, step)
        if isinstance(ready, str):
            reasons.append(ready)
            continue
        writers, sources, holders, states = ready
        if not jit_claims.claim_commit(folder, step):
            return _claimed_elsewhere(folder, step)
        try:
            return _commit(run, folder, writers, sources, holders, states,
                           _stale(offers, holders, step))
        except BaseException as err:
            # the claim says so: nobody reads "step S" wrongly
            jit_claims.commit_failed(folder, f"failed: {err!r}")
            raise
    fenced = (f" (the offers of rank(s) {set_aside}, declared lost in this attempt, are not "
              "taken)" if set_aside else "")
    if not steps:
        return ("no survivor had written a state file yet (a later survivor completes the "
                "snapshot)" + fenced)
    return "not committed: " + "; ".join(reasons) + fenced


Ready = tuple[list[dict[str, Any]], list[dict[str, Any]], dict[int, int], dict[int, bytes]]


def _ready(run: Survivor, folder: Path, offers: list[dict[str, Any]], step: int) -> Ready | str:
    """What a commit of ``step`` takes (its writers, sources, the holders of the per-rank states and
    those states, read before the claim: a commit that cannot be made never takes it), or why the
    set of ``step`` is not whole."""
    writers = [o for o in offers if isinstance(o.get("written"), dict)
               and o["written"]["step"] == step]
    unwritten = _unwritten(writers, step)
    if unwritten:
        return unwritten
    writer = writers[0]
    sources = [o for o in offers if o.get("source") and o.get("step") == step]
    differing = sorted(o["rank"] for o in sources if o.get("fingerprint") != writer["fingerprint"])
    if differing:
        log.error("no just-in-time snapshot: ranks %s hold another state of step %d than rank %d",
                  differing, step, writer["rank"])
        return f"ranks {differing} hold another state of step {step} than rank {writer['rank']}"
    kept = bool(mirrored(run.per_rank))  # a buddy keeps them: every rank's must be held
    holders = _holders(offers, step) if kept else {}
    missing = [r for r in range(run.env.world_size) if r not in holders] if kept else []
    if missing:
        return (f"no survivor holds the per_rank state of rank(s) {missing} at step {step} (their "
                "buddies were lost too, or their mirror was more than a step behind)")
    states = _per_rank_states(folder, holders, {o["rank"]: o.get("node", 0) for o in offers}, step)
    return states if isinstance(states, str) else (writers, sources, holders, states)


def settled(run: Survivor, folder: Path, said: jit_tally.Settled) -> str | None:
    """What came of this rank's part in the steps' tallies (:mod:`hpc_ddp.rundir.jit_tally`): where
    it carried a set's baton past the last item, the one full check and the commit
    (:func:`complete`); where it left a set waiting, what the set lacks; None when it only added
    what its node said (the survivor that completes the set checks it)."""
    if said.whole:
        return complete(run, folder)
    if said.waiting:
        return "not committed (yet): " + "; ".join(said.waiting[step]
                                                    for step in sorted(said.waiting, reverse=True))
    return None


def _claimed_elsewhere(folder: Path, step: int) -> str:
    """Why this survivor did not commit the complete ``step``: the attempt's commit claim was taken
    (by another survivor, for this step or another) or sealed by the batch shell."""
    held = jit_claims.commit_holder(folder)
    if held == "sealed":
        return ("not committed: the attempt was sealed (its step had ended and the batch shell "
                f"went on) before step {step}'s set was complete")
    if held == f"step {step}":
        return f"step {step} committed by another survivor"
    return (f"step {step} not committed here: this attempt's commit went to another "
            f"survivor ({held})")


def _holders(offers: list[dict[str, Any]], step: int) -> dict[int, int]:
    """rank -> the survivor whose file holds its per-rank state of ``step``: the rank's own copy
    where it survived, else its buddy's. An offer names the steps it holds of each rank (``{rank:
    [steps]}``: the last two boundaries); an offer of the version before names one step, a
    number."""
    holders: dict[int, int] = {}
    for o in offers:
        for rank, held in (o.get("blobs") or {}).items():
            steps = held if isinstance(held, list) else [held]
            if step in steps and (int(rank) not in holders or int(rank) == o["rank"]):
                holders[int(rank)] = o["rank"]
    return holders


def _stale(offers: list[dict[str, Any]], holders: dict[int, int], step: int) -> dict[int, int]:
    """rank -> the older step whose per-rank state its holder gives for ``step`` (its last copied
    boundary: ``per_rank(..., mirror=N)``); only the ranks whose state is not of ``step``."""
    said = {o["rank"]: o.get("stale") or {} for o in offers}
    older = {rank: (said.get(holder) or {}).get(str(rank), {}).get(str(step))
             for rank, holder in holders.items()}
    return {rank: int(s) for rank, s in older.items() if isinstance(s, int)}


def _unwritten(writers: list[dict[str, Any]], step: int) -> str | None:
    """Why the state files of ``step`` are not a whole state yet: a slice nobody wrote (its node and
    the next were lost, or they still write), or writers that cut the state differently; None when
    whole."""
    layouts = {slicing.layout_digest(w["written"]["layout"]) for w in writers}
    if len(layouts) > 1:
        return f"the survivors' files of step {step} cut the state in {len(layouts)} different ways"
    held = {s for w in writers for s in w["written"]["entry"].get("slices", [])}
    missing = sorted(set(range(writers[0]["written"]["layout"]["slices"])) - held)
    if missing:
        return (f"slice(s) {missing} of step {step} not written (yet): the nodes that write them "
                "were lost, or "
                "had not finished (a later survivor completes the snapshot)")
    return None


def _per_rank_states(folder: Path, holders: dict[int, int], node_of: dict[int, int],
                     step: int) -> dict[int, bytes] | str:
    """Every rank's packed per-rank state of ``step`` from the file of the survivor that holds it
    ({} without per_rank objects), or why some cannot be read."""
    if not holders:
        return {}
    loaded = {node: jit_blobs.read_blobs(folder, node)
              for node in sorted({node_of[h] for h in holders.values()})}
    states = {rank: jit_blobs.blob_of(loaded[node_of[holder]], holder, rank, step)
              for rank, holder in holders.items()}
    lost = sorted(rank for rank, blob in states.items() if blob is None)
    if lost:
        return (f"the files holding the per_rank state of rank(s) {lost} at step {step} could "
                "not be read")
    return {rank: blob for rank, blob in states.items() if blob is not None}


def _commit(run: Survivor, folder: Path, writers: list[dict[str, Any]],
            sources: list[dict[str, Any]],
            holders: dict[int, int], states: dict[int, bytes], stale: dict[int, int]) -> str:
    """The manifest of the writers' state files (and of every rank's per-rank state, put together in
    one more file): the snapshot is committed. ``stale``: the ranks whose per-rank state is of an
    older step (said in the ledger, and warned)."""
    env, ckpt, writer = run.env, run.checkpointer, writers[0]
    step = writer["written"]["step"]
    directory = snapshot.step_dir(run.run_dir, step)
    entries = [w["written"]["entry"] for w in writers]
    if holders:
        content = {"format": slicing.FORMAT, "skeleton": None, "pieces": {},
                   "rng": {rank: {PER_RANK: blob} for rank, blob in states.items()}}
        entry = snapshot_write.write_node_file(directory, 0, content,
                                               name=jit_files.ranks_file_name(step, env.rank))
        entries.append({**entry, "slices": [], "ranks": sorted(states)})
    took = round(time.time() - min(o["time"] for o in [*writers, *sources]), 3)
    shares = {str(w["rank"]): {"write_s": w["written"].get("write_s"),
                               "bytes": w["written"]["entry"].get("size"),
                               "slices": w["written"]["entry"].get("slices")} for w in writers}
    record = {"attempt": folder.name, "writer": writer["rank"], "host": writer["host"],
              "took_s": took,
              **({"writers": shares} if shares else {}),
              "fingerprint": writer["fingerprint"], "sources": sorted(o["rank"] for o in sources),
              "after": writer["error"], "nodes": max(1, env.num_nodes),
              **({"committer": env.rank,
                  "per_rank_from": {str(r): h for r, h in sorted(holders.items())}}
                 if holders else {}),
              **({"per_rank_stale": {str(r): s for r, s in sorted(stale.items())}}
                 if stale else {})}
    snapshot.commit(directory, step, entries, env.world_size, ckpt.config_hash if ckpt else "",
                    ckpt.config if ckpt else None, split=writer["written"]["layout"],
                    refuses_resize=ckpt.refuses_resize if ckpt else None, extra={"jit": record})
    log.warning("just-in-time snapshot of step %d committed in %s (%.2f s after the failure): the "
                "run resumes "
                "from it", step, directory, took)
    if stale:
        log.warning("in it, the per_rank state of %s is older than step %d (per_rank(..., "
                    "mirror=N) sends it every N steps): the run resumes from it, not exactly as "
                    "if uninterrupted", ", ".join(f"rank {r} of step {s}" for r, s in
                                                  sorted(stale.items())), step)
    return f"committed step {step}"


def latest_commit(run_dir: Path) -> int | None:
    """The newest committed step, from the file that names it (read by name): not by reading every
    step's manifest, which would look up the one survivors are about to commit and make this node's
    NFS client remember it as absent (:mod:`hpc_ddp.rundir.newest`). A run dir older than that file:
    by its manifests."""
    named = newest.read(run_dir)
    if named is not None:
        return int(named["step"])
    steps = snapshot.committed_steps(run_dir)
    return steps[0] if steps else None
