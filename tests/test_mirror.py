"""Per-rank state mirrored to a buddy on another node (issue 35, :mod:`hpc_ddp.rank.salvage.mirror`): who is whose buddy,
and over real gloo processes that a rank killed as soon as its sender thread posted a step's state leaves that
state with its buddy (the case a split header and payload lost), and that a clean end leaves nothing in flight."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from hpc_ddp.rank.salvage.mirror import FIRST_SIZE, buddy_of, ward_of
from tests.helpers import spawn_ranks


@pytest.mark.parametrize("local, world, buddies", [
    (2, 4, [2, 3, 0, 1]),  # 2 nodes x 2: the same local rank on the next node
    (1, 3, [1, 2, 0]),  # 3 nodes x 1
    (2, 6, [2, 3, 4, 5, 0, 1]),  # the last node's ranks go to the first node
    (2, 2, [1, 0]),  # one node: the next rank on it (a crash is covered, a lost node is not)
])
def test_the_buddy_is_the_same_local_rank_on_the_next_node(local: int, world: int, buddies: list[int]) -> None:
    assert [buddy_of(r, local, world) for r in range(world)] == buddies
    assert [ward_of(buddies[r], local, world) for r in range(world)] == list(range(world))


def blob(rank: int, step: int) -> bytes:
    """Grows past the first message size at step 10: the size change travels too."""
    return f"rank {rank} step {step};".encode() * (10 if step < 10 else FIRST_SIZE // 10)


def _ranks(environ: dict[str, str], victim: int, out: Any) -> None:
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    from hpc_ddp.rank.salvage.mirror import Mirror
    from hpc_ddp.rank.group import control

    from hpc_ddp.core.slurm_env import from_environ

    env = from_environ(environ)
    rank, world, local = env.rank, env.world_size, env.local_world_size
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with control.lazily():
        group = dist.new_group(backend="gloo")
    mirror = Mirror(rank, local, world, group).start()
    try:
        for step in range(1, 31):
            dist.all_reduce(torch.ones(4))
            mirror.mark(step, blob(rank, step))
            if rank == victim and step == 20:
                assert mirror.wait_sent(20, 5.0)
                os.kill(os.getpid(), signal.SIGKILL)  # at once: its isend was only posted
        mirror.close()
        dist.destroy_process_group()
    except RuntimeError:  # a peer was lost: what this survivor holds
        pass
    out.put((rank, {r: (s, b == blob(r, s)) for r, (s, b) in mirror.held().items()}))
    out.close()
    out.join_thread()  # the queue's feeder thread has sent it: os._exit would drop it
    os._exit(0)  # a survivor's process group is broken: no destroy


def test_a_clean_end_leaves_every_rank_with_its_wards_last_state() -> None:
    got = spawn_ranks(_ranks, 2, 2, -1, timeout=60)
    assert got == [(0, {0: (30, True), 2: (30, True)}), (1, {1: (30, True), 3: (30, True)}),
                   (2, {2: (30, True), 0: (30, True)}), (3, {3: (30, True), 1: (30, True)})]


def test_a_rank_killed_as_soon_as_its_state_is_posted_leaves_that_step_with_its_buddy() -> None:
    import multiprocessing

    from hpc_ddp.core.slurm_env import simulated_environ
    from hpc_ddp.rehearsal.local import free_port

    port, ctx = free_port(), multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ranks, args=({**e, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, 1, out))
             for e in simulated_environ(2, 2, job_id=1)]
    for proc in procs:
        proc.start()
    got = dict(out.get(timeout=60) for _ in range(3))
    for proc in procs:
        proc.join(timeout=30)
    assert procs[1].exitcode == -signal.SIGKILL
    assert got[3] == {3: (20, True), 1: (20, True)}  # rank 1's state of step 20, whole, with its buddy


def test_a_state_comes_back_from_its_message_exactly_or_goes_as_torch_save_bytes() -> None:
    """rank/salvage/flat.py: the usual per-rank state (containers, scalars, tensors of any dtype, views, int and tuple
    keys) is copied into the message once and read back with the same types and bits; what it cannot give
    back exactly (a NumPy array, a dict subclass) returns None, and the mirror sends torch.save bytes."""
    from collections import OrderedDict, defaultdict

    import numpy as np
    import torch

    from hpc_ddp.rank.salvage import flat

    state = {"batch": {"x": torch.randn(4, 3), "y": torch.arange(5), "n": 3, "f": 0.1, "big": 2**70, "s": "a",
                       "none": None, "b": True, "nan": float("nan"), "neg0": -0.0},
             "g": torch.Generator().manual_seed(3).get_state(),
             "mod": OrderedDict(w=torch.randn(2, 2, dtype=torch.bfloat16), empty=torch.zeros(0)),
             "opt": {"state": {0: {"step": torch.tensor(3.0), "avg": torch.randn(3, dtype=torch.float64)}},
                     "param_groups": [{"lr": 0.1, "params": [0]}]},
             "t": (1, (2, 3)), "keys": {(1, 2): "a tuple key"}, "mask": torch.tensor([True, False]),
             "c": torch.randn(3, dtype=torch.complex64), "view": torch.arange(10.0)[2:7:2]}
    layout = flat.plan(state)
    assert layout is not None
    message = torch.full((32 + layout.nbytes,), 7, dtype=torch.uint8)  # the body starts after the header
    layout.write(message[32:])
    back = flat.read(message[32:])

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return (type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
                    and a.contiguous().reshape(-1).view(torch.uint8).tolist()
                    == b.contiguous().reshape(-1).view(torch.uint8).tolist())
        if type(a) is not type(b):
            return False
        if isinstance(a, float):
            return repr(a) == repr(b)
        if isinstance(a, dict):
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return bool(a == b)

    assert same(state, back)
    for odd in (np.zeros(3), defaultdict(int), np.float32(1.0), torch.zeros(3).to_sparse()):
        assert flat.plan({"odd": odd}) is None


def _long_gap(environ: dict[str, str], out: Any) -> None:
    os.environ.update(environ)
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from hpc_ddp.rank.group import control
    from hpc_ddp.rank.salvage.mirror import Mirror, new_group

    rank = int(environ["SLURM_PROCID"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=2))
    with control.lazily():
        group = new_group()
    mirror = Mirror(rank, 1, 2, group).start()
    mirror.mark(1, blob(rank, 1))
    time.sleep(4)  # an evaluation longer than the group's timeout, without a boundary
    mirror.mark(2, blob(rank, 2))
    assert mirror.wait_sent(2, 10)
    deadline = time.monotonic() + 10
    while (mirror.kept is None or mirror.kept[0] < 2) and mirror.broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    out.put((rank, mirror.broken, {r: (s, b == blob(r, s)) for r, (s, b) in mirror.held().items()}))
    mirror.close()
    dist.destroy_process_group()


def test_a_gap_between_boundaries_longer_than_the_timeout_does_not_break_the_mirror() -> None:
    """Its receive used to take the training group's timeout: a long evaluation without a boundary timed it out,
    which closed the pair for good (said at debug level), and every later failure fell back. The mirror's group
    now waits a day; the state of the step after the gap still reaches the buddy."""
    got = spawn_ranks(_long_gap, 1, 2, timeout=60)
    assert got == [(0, None, {0: (2, True), 1: (2, True)}), (1, None, {1: (2, True), 0: (2, True)})]
