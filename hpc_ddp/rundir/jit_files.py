"""The run dir's part of a just-in-time snapshot (:mod:`hpc_ddp.rank.salvage.jit`): where the
survivors of an attempt meet, without a process group or a store. No torch: the batch shell reads
what they said.

Per node, not per rank (issue 45). Each survivor leaves its offer (the step it holds whole and its
fingerprint, or why it holds none, and what came of it) and, with ``per_rank`` objects, the per-rank
states it holds (its own and its ward's, from :mod:`hpc_ddp.rank.salvage.mirror`) on its node, in
the node's folder on node-local storage. Under a lock on the node, whoever offers last publishes
what the node's ranks said as one file per node in ``RUN_DIR/jit/job-J-restart-R[-step-K]/``:
``node-N.json`` (the offers) and ``blobs-node-N.pt`` (the per-rank states, by holder:
:mod:`hpc_ddp.rundir.jit_blobs` reads them), rewritten only when it changed. At 4,096 ranks on 512
nodes that is about 512 files a failure, not 8,192, and a survivor that completes the set reads 512
offers, not 4,096.

Who writes and who commits is claimed apart (:mod:`hpc_ddp.rundir.jit_claims`: exclusive
creates), and what the nodes' files say is read apart (:mod:`hpc_ddp.rundir.jit_offers`: by name,
never by listing, for whoever decides).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rundir import jit_blobs, jit_gather, jit_tally, lost, node_local, view
from hpc_ddp.rundir.jit_gather import local_json as _local_json, local_offer as _local_offer
from hpc_ddp.rundir.jit_post import JIT, Post, post_for  # noqa: F401 (where callers find them)
from hpc_ddp.rundir.ledger import attempt_tag



def folder(run_dir: Path | str, job_id: int | None, restart_count: int, in_job: int = 0) -> Path:
    return Path(run_dir) / JIT / attempt_tag(job_id, restart_count, in_job)


# made empty by rank 0; a rank whose step a stop broke (rank/stop/broken_step.py) writes into it
BROKEN_STOP_MARK = "stopped-mid-step"


def broken_stop_marked(run_dir: Path | str, job_id: int | None, restart_count: int,
                       in_job: int = 0) -> bool:
    """Whether a rank of this attempt found its step broken by a stop signal."""
    return marked(folder(run_dir, job_id, restart_count, in_job) / BROKEN_STOP_MARK)


def marked(path: Path) -> bool:
    """A mark read by its content, opened by name (a stat may answer from a cache that remembers it
    absent): rank 0 creates it empty before anyone looks it up (:func:`prepare_mark`)."""
    try:
        return bool(view.current().read_bytes(path).strip())
    except OSError:
        return False


def prepare_mark(path: Path) -> None:  # before the rendezvous: empty (kept if it is there)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError as err:  # its writer creates it all the same
        logging.getLogger("hpc_ddp.jit").warning("could not create %s (%s)", path, err)


def file_name(rank: int) -> str:
    """The snapshot file a survivor writes: its own name, apart from the nodes' files of a periodic
    save of the same step that a failure may have left half-written (a manifest lists only what it
    commits)."""
    return f"jit-{rank:05d}.pt"


def node_file_name(node: int) -> str:
    """A split survivors' snapshot's file of node ``node``'s share (one writer per node and
    step)."""
    return f"jit-node-{node:05d}.pt"


def ranks_file_name(step: int, committer: int) -> str:
    """The snapshot file of every rank's per-rank state at ``step`` (beside the survivor's state
    file), named after the survivor that committed it: on a filesystem without O_EXCL across nodes
    two may both believe they hold the commit claim, and the same name would have one's bytes under
    the other's manifest."""
    return f"jit-ranks-{step:08d}-by-{committer:05d}.pt"


def prepare(post: Post) -> None:
    """The node's first rank, before the rendezvous: its node's (empty) file exists before any
    survivor of another node looks it up, so no NFS client remembers it as absent when the node
    offers (a survivor that completes the set would not see it for up to a minute). One create per
    node and attempt; a failure to create it is only a warning (the offer creates it)."""
    prepare_mark(post.shared / f"node-{post.node}.json")


def offer(post: Post, content: dict[str, Any], gather_s: float = jit_gather.GATHER_S,
          quiet: bool = False) -> jit_tally.Settled:
    """This rank's offer: on its node first, then in its node's file in the run dir
    (:func:`publish`), and what the file newly says added to the steps' tallies
    (:func:`hpc_ddp.rundir.jit_tally.settle`, whose answer it returns: the steps whose set this
    rank found whole, which it must check and commit, and where it left a set waiting).

    A killed peer frees its survivors one after another, so a node's ranks offer milliseconds apart,
    and each offer used to rewrite the node's file (3 writes per rank at 2 x 4 in B14). Before it
    publishes, a first offer waits for the node's ranks that are at their part and have not offered
    yet (:func:`hpc_ddp.rundir.jit_gather.await_peers`: never for a rank still blocked elsewhere or
    dead; at most ``gather_s``): the last to arrive publishes for all, the others find nothing new.
    Then an offer that tells the set no slice written, while another rank of the node is still at
    its part (a source whose offer has no outcome yet), is left on the node for that rank's publish
    to carry, and so are the per-rank states a publish with a slice would tell: the node's last rank
    at work publishes what the others said (issue 59: a node's ranks are freed one by one, and each
    rewrote the node's file twice, and each grew its groups' tally chains by one entry). Rank 0's
    first offer goes out at once: the other ranks may wait for it
    (:func:`hpc_ddp.rank.salvage.jit_checks.buffers_source_holds`). ``quiet``: on the node only."""
    node_local.ensure(post.local)
    write_atomic(post.local / f"offer-{post.local_rank}.json",
                 json.dumps({"tag": post.tag, "offer": {**content, "node": post.node}}).encode())
    if quiet:  # it tells nobody anything (a late survivor that agrees with the commit)
        return jit_tally.Settled()
    if "outcome" not in content:
        jit_gather.await_peers(post, gather_s)
    new = publish(post, defer=post.rank != 0 or "outcome" in content)
    if not new:
        return jit_tally.Settled()

    def declared() -> Collection[int]:
        """The attempt's declared ranks: read only where a walk found its set whole (the fence)."""
        return lost.fence_at(post.shared).declared

    memory = post.local / "tally-ends.json"  # what the node learnt of the tallies' chains
    ends = {k: v for k, v in jit_gather.local_json(post, memory).items() if isinstance(v, int)}
    settled = jit_tally.settle(post.shared, new, post.rank, post.world, post.group, post.per_rank,
                               declared, ends)
    # a node's ranks settle one after another, mostly: a lost race only makes a scan longer
    known = jit_gather.local_json(post, memory)
    write_atomic(memory, json.dumps({**known, **{k: max(v, int(known.get(k) or 0))
                                                 for k, v in ends.items()}, "tag": post.tag}))
    return settled


def once_per_node(post: Post, key: str, compute: Callable[[], Any],
                  fresh_s: float | None = None) -> Any:
    """``compute()`` once for the node's ranks (under the node's lock, kept in its folder): a value
    every survivor of the node needs from the run dir (the newest commit, a commit's record) is read
    there once per node, not once per rank. ``fresh_s``: how old a kept value may be (None: any
    age). JSON values only."""
    node_local.ensure(post.local)
    with node_local.locked(post.local / "memo.lock"):
        memo_path = post.local / "memo.json"
        memo = _local_json(post, memo_path)
        kept = memo.get(key)
        if isinstance(kept, dict) and (fresh_s is None
                                       or time.time() - float(kept.get("at", 0)) < fresh_s):
            return kept.get("value")
        value = compute()
        memo[key] = {"value": value, "at": time.time()}
        write_atomic(memo_path, json.dumps({**memo, "tag": post.tag}))
        return value


def written_alike(post: Post, step: int, fingerprint: Any) -> bool:
    """Whether a rank of this node wrote its share of ``step`` holding the state ``fingerprint``
    says, and said what came of it (its written offer is in the run dir): another source of the node
    that holds the same state has nothing to tell the file server (issue 59)."""
    for local in range(post.local_size):
        found = _local_offer(post, local) if local != post.local_rank else None
        written = (found or {}).get("written")
        if (isinstance(written, dict) and written.get("step") == step and "outcome" in found
                and found.get("fingerprint") == fingerprint):
            return True
    return False


def per_node(post: Post, key: str, compute: Callable[[], Any],
             fresh_s: float = 0.1) -> Callable[[], Any]:
    """A reader of what the node's waiting ranks poll in the run dir, shared by them
    (:func:`once_per_node`, at most one read per node every ``fresh_s``)."""
    return lambda: once_per_node(post, key, compute, fresh_s=fresh_s)


def write_blobs(post: Post, blobs: dict[int, dict[int, bytes]]) -> None:
    """A survivor's per-rank states ({rank: {step: packed bytes}}: its own and its ward's of their
    last two boundaries), on its node, before its offer names them."""
    import torch

    node_local.ensure(post.local)
    held = {"holder": post.rank, "tag": post.tag,
            "blobs": {r: dict(states) for r, states in blobs.items()}}
    write_atomic(post.local / f"blobs-{post.local_rank}.pt", lambda out: torch.save(held, out))


def publish(post: Post, defer: bool = False) -> list[jit_tally.Fact]:
    """The node's file in the run dir, ``node-N.json`` (every offer its ranks made, by rank), and
    with per-rank state ``blobs-node-N.pt`` (each rank's per-rank states, by the rank that holds
    them): rewritten only when what the node's ranks said changed since the last publish, under a
    lock on the node, so ranks that offer together cost the file server one write for the node, not
    one per rank.

    Returns what the node's file now says towards a set (a slice written, per-rank states held) that
    no publish of the node returned before: whoever publishes it adds it to the steps' tallies
    (:func:`offer`), so each fact of the node reaches the file server once, whichever rank made
    it."""
    with node_local.locked(post.local / "publish.lock"):
        offers, blob_files, others = [], [], []
        for local in range(post.local_size):
            found = _local_offer(post, local)
            if found is not None:
                offers.append(found)
                if local != post.local_rank:
                    others.append((local, found))
            blob = post.local / f"blobs-{local}.pt"
            with contextlib.suppress(OSError):
                info = blob.lstat()  # a regular file of this user's (never a link's target)
                if info.st_uid == os.getuid() and stat.S_ISREG(info.st_mode):
                    # a list: as published.json reads
                    blob_files.append([local, info.st_mtime_ns, info.st_size])
        said = json.dumps({"offers": offers, "blobs": blob_files}, sort_keys=True)
        published = post.local / "published.json"
        before = _local_json(post, published)
        if before.get("said") == said:
            return []
        told = set(before.get("facts", []))
        new = [f for f in jit_tally.facts(offers, post.node, post.group) if f.key not in told]
        # per-rank states wait while a rank of the node is at its part, beside a slice written too:
        # a node's ranks are freed one by one, and each publish of a group's grown rank list was
        # one more entry in its tally chain (B14-SIM with per-rank state: the entries grew with the
        # ranks per node, and with how they came); the last rank at work carries them all
        if defer and any(jit_gather.at_work(post, local, o) for local, o in others):
            new = [f for f in new if f.kind != "r"]  # not told: a later publish carries them
            if not new:  # nothing for the set now: the node's last rank at work publishes it
                return []
        if blob_files and before.get("blobs") != blob_files:
            _publish_blobs(post, [local for local, _, _ in blob_files])
        record = json.dumps({"node": post.node,
                             "offers": sorted(offers, key=lambda o: o.get("rank", -1))}).encode()
        _shared(post, f"node-{post.node}.json", record)
        write_atomic(published, json.dumps({"said": said, "blobs": blob_files, "tag": post.tag,
                                            "facts": sorted(told | {f.key for f in new})}))
        return new


def _publish_blobs(post: Post, locals_: list[int]) -> None:
    import torch

    by_holder: dict[int, Any] = {}
    for local in locals_:
        # None: missing, garbage,
        found = jit_blobs.survivor_file(post.local / f"blobs-{local}.pt", post.tag)
        if found is not None:  # not this user's or without the attempt's token (named)
            by_holder[found[0]] = found[1]
    _shared(post, f"blobs-node-{post.node}.pt", lambda out: torch.save(by_holder, out))


def _shared(post: Post, name: str, data: Any) -> None:
    """One of the node's files in the run dir; the folder made only when no node made it before the
    rendezvous (:func:`prepare`), not at every write."""
    try:
        write_atomic(post.shared / name, data)
    except FileNotFoundError:
        post.shared.mkdir(parents=True, exist_ok=True)
        write_atomic(post.shared / name, data)
