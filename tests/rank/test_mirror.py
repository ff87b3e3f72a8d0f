"""Per-rank state mirrored to a buddy on another node (issue 35, :mod:`hpc_ddp.rank.salvage.mirror`): who is whose buddy,
and over real gloo processes that a rank killed as soon as its sender thread posted a step's state leaves that
state with its buddy (the case a split header and payload lost), and that a clean end leaves nothing in flight.
Issue 45: a state that did not change goes as a header alone, one whose leaves changed in part as those leaves
(the buddy then holds the same bytes a whole send gives), a dropped message never leaves a wrong state, and the
sender's buffers are reused. Messages are counted through the sender's seam (``Mirror._send``), never timed.
Issue 55: each rank holds its own state and its ward's of its last two boundaries, exactly, whatever messages
brought them (whole, delta, unchanged, refused)."""

from __future__ import annotations

import os
from collections import namedtuple
import signal
from typing import Any

import pytest

from hpc_ddp.rank.salvage.mirror import buddy_of, ward_of
from hpc_ddp.rank.salvage.mirror_wire import FIRST_SIZE
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


def leaves(rank: int, step: int) -> dict[str, Any]:
    """A state of leaves: a large one that never changes, and a batch and a counter that change at every step."""
    import torch

    return {"frozen": torch.arange(64 * 1024, dtype=torch.float32) + rank, "n": step,
            "batch": torch.full((64,), float(step * 10 + rank))}


def same_state(blob: bytes, rank: int, step: int) -> bool:
    import torch

    from hpc_ddp.rank.state.tracked import unpack

    got, want = unpack(blob), leaves(rank, step)
    return got["n"] == want["n"] and all(torch.equal(got[k], want[k]) for k in ("frozen", "batch"))


def _ranks(environ: dict[str, str], victim: int, out: Any, state: str = "bytes") -> None:
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
            mirror.mark(step, blob(rank, step) if state == "bytes" else leaves(rank, step))
            if rank == victim and step == 20:
                assert mirror.wait_sent(20, 5.0)
                os.kill(os.getpid(), signal.SIGKILL)  # at once: its isend was only posted
        mirror.close()
        dist.destroy_process_group()
    except RuntimeError:  # a peer was lost: what this survivor holds
        pass
    check = (lambda r, s, b: b == blob(r, s)) if state == "bytes" else (lambda r, s, b: same_state(b, r, s))
    out.put((rank, {r: [(s, check(r, s, b)) for s, b in states.items()] for r, states in mirror.held().items()}))
    out.close()
    out.join_thread()  # the queue's feeder thread has sent it: os._exit would drop it
    os._exit(0)  # a survivor's process group is broken: no destroy


def two_boundaries(held: list[tuple[int, bool]], newest: int, exactly: bool = True) -> bool:
    """Whether a rank's states are of ``newest`` and one step before it, newest first, every one exact. A ward's
    state before its newest is the one of its message before (``exactly`` False): a state replaced while another
    was on its way (``skipped``) never left its rank."""
    return (len(held) == 2 and held[0][0] == newest and (held[1][0] == newest - 1 if exactly else held[1][0] < newest)
            and all(ok for _, ok in held))


def test_a_clean_end_leaves_every_rank_with_its_wards_last_two_states() -> None:
    got = spawn_ranks(_ranks, 2, 2, -1, timeout=60)
    assert [(rank, sorted(held)) for rank, held in got] == [(0, [0, 2]), (1, [1, 3]), (2, [0, 2]), (3, [1, 3])]
    for rank, held in got:
        assert two_boundaries(held[rank], 30), (rank, held)
        assert two_boundaries(held[(rank + 2) % 4], 30, exactly=False), (rank, held)


@pytest.mark.parametrize("state", ["bytes", "leaves"])
def test_a_rank_killed_as_soon_as_its_state_is_posted_leaves_that_step_with_its_buddy(state: str) -> None:
    """Whole states (torch.save bytes that change at every step), and states of leaves that go as deltas: the
    node lost at step 20 leaves rank 1's state of step 20, exactly, with its buddy."""
    import multiprocessing

    from hpc_ddp.core.slurm_env import simulated_environ
    from hpc_ddp.rehearsal.local import free_port

    port, ctx = free_port(), multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ranks, args=({**e, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, 1, out,
                                              state))
             for e in simulated_environ(2, 2, job_id=1)]
    for proc in procs:
        proc.start()
    got = dict(out.get(timeout=60) for _ in range(3))
    for proc in procs:
        proc.join(timeout=30)
    assert procs[1].exitcode == -signal.SIGKILL
    assert two_boundaries(got[3][3], 20) and two_boundaries(got[3][1], 20, exactly=False)  # rank 1's of step 20


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
    # a per-rank parameter comes back a parameter, with its flag (issue 58: it went through torch.save)
    param = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    layout = flat.plan({"p": param})
    assert layout is not None
    layout.write(body := torch.zeros(layout.nbytes, dtype=torch.uint8))
    got = flat.read(body)["p"]
    assert type(got) is torch.nn.Parameter and not got.requires_grad and torch.equal(got, param)


Batch = namedtuple("Batch", "x y")  # a per-rank type the flat format does not carry (picklable: module level)


def test_the_first_boundary_names_a_per_rank_type_that_costs_a_torch_save_per_step_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 58: a namedtuple, a dataclass, a NumPy array went through torch.save on the training thread at every
    boundary, silently (with a CUDA tensor inside, a device sync per step). The first boundary says so, once, and
    names the type and where it is."""
    import numpy as np
    import torch

    from hpc_ddp.rank.salvage import flat, mirror
    from hpc_ddp.rank.salvage.mirror_receive import Receiver
    from hpc_ddp.rank.salvage.mirror_send import Sender

    assert flat.unsupported({"b": [1, Batch(torch.ones(1), 2)]}) == \
        f"a {__name__}.Batch at ['b'][1]"
    assert flat.unsupported({"a": np.zeros(2)}) == "a numpy.ndarray at ['a']"
    assert flat.unsupported({"t": (torch.ones(2), {"k": None})}) is None
    kept = object.__new__(mirror.Mirror)  # no process group: only the boundary's packing runs
    kept.rank, kept.ward, kept.broken = 0, 0, None
    kept._lock = mirror.threading.Lock()
    Sender.__init__(kept)
    Receiver.__init__(kept)
    with caplog.at_level("WARNING", logger="hpc_ddp.mirror"):
        kept.mark(1, {"prefetched": Batch(torch.ones(2), torch.zeros(2))})
        kept.mark(2, {"prefetched": Batch(torch.ones(2), torch.zeros(2))})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "Batch at ['prefetched']" in said[0] and "device sync per step" in said[0]


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
    out.put((rank, mirror.broken, {r: [(s, b == blob(r, s)) for s, b in states.items()]
                                   for r, states in mirror.held().items()}))
    mirror.close()
    dist.destroy_process_group()


def test_a_gap_between_boundaries_longer_than_the_timeout_does_not_break_the_mirror() -> None:
    """Its receive used to take the training group's timeout: a long evaluation without a boundary timed it out,
    which closed the pair for good (said at debug level), and every later failure fell back. The mirror's group
    now waits a day; the state of the step after the gap still reaches the buddy."""
    got = spawn_ranks(_long_gap, 1, 2, timeout=60)
    assert got == [(0, None, {0: [(2, True), (1, True)], 1: [(2, True), (1, True)]}),
                   (1, None, {1: [(2, True), (1, True)], 0: [(2, True), (1, True)]})]


UNCHANGED_AT = {2, 3, 6, 10}  # the mixed scenario's steps whose state is the step before's
WHOLE_AT = {4, 8, 9}  # and those whose large leaf changes: the state goes whole


def scenario_state(scenario: str, rank: int, step: int) -> dict[str, Any]:
    """A scenario's state of ``rank`` at ``step``. "unchanged": the same at every step; "whole": every byte
    changes; "delta" and "drop": the batch and counter change, the large leaf does not; "mixed": one step in
    three or so of each, so that every kind of message follows every other (whole, delta, unchanged)."""
    import torch

    if scenario == "unchanged":
        return {"batch": torch.arange(256 * 1024, dtype=torch.uint8) + rank}  # 256 KB, the same at every step
    if scenario == "whole":
        return {"batch": torch.full((64 * 1024,), float(step * 10 + rank)), "n": step}
    if scenario != "mixed":
        return leaves(rank, step)
    version = max(s for s in range(1, step + 1) if s not in UNCHANGED_AT)
    state = leaves(rank, version)
    state["frozen"] += 1000 * sum(1 for s in WHOLE_AT if s <= version)
    return state


def same_leaves(got: dict[str, Any], want: dict[str, Any]) -> bool:
    import torch

    return list(got) == list(want) and all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor)
                                           else got[k] == want[k] for k in want)


def _exchange(environ: dict[str, str], scenario: str, out: Any) -> None:
    """Two ranks, each the other's buddy, mark 12 steps of a scenario's state, each sent before the next. Each
    reports what its sender put on the wire (counted at ``_send``), whether every state its receiver ever
    kept, and the one before it, was the ward's exact state of that step (compared leaf by leaf with a body
    packed whole), and what ``held`` gives at the end."""
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    from hpc_ddp.rank.group import control
    from hpc_ddp.rank.salvage import flat, mirror as mirror_module, mirror_send
    from hpc_ddp.rank.salvage.mirror import Mirror
    from hpc_ddp.rank.state.tracked import unpack

    rank = int(environ["SLURM_PROCID"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with control.lazily():
        group = mirror_module.new_group()
    if scenario == "drop":
        mirror_send.FULL_EVERY = 8  # messages 1 and 9 go whole: the one dropped at step 5 is mended at step 9
    wire: list[tuple[int, int]] = []  # (step, bytes) of each message posted
    kept_right: list[list[tuple[int, bool]]] = []  # after each message received: (step, exact) newest first

    def exact(step: int, body: torch.Tensor) -> bool:
        want = flat.plan(scenario_state(scenario, 1 - rank, step))
        whole = torch.zeros(want.nbytes, dtype=torch.uint8)  # what a whole send of that step carries
        want.write(whole)
        return body.numel() == want.nbytes and all(torch.equal(body[s:e], whole[s:e]) for s, e in want.segments())

    class Counted(Mirror):
        def _send(self, messages: list[torch.Tensor]) -> list[Any]:
            step = int(messages[-1][:8].view(torch.int64)[0])
            wire.extend((int(m[:8].view(torch.int64)[0]), m.numel()) for m in messages)
            if scenario == "drop" and step == 5:
                return []  # lost on the way: the sender believes its buddy holds step 5
            return super()._send(messages)

        def _keep(self, *args: Any) -> torch.Tensor:
            into = super()._keep(*args)
            kept_right.append([(step, exact(step, body)) for step, _, body in self._ward_bodies()])
            return into

    mirror = Counted(rank, 1, 2, group, 5 if scenario == "every5" else 1).start()
    for step in range(1, 13):
        if mirror.due(step):  # as the boundary does (rank/loop/holding.py)
            mirror.mark(step, scenario_state(scenario, rank, step))
        else:
            mirror.skip(step)
        assert mirror.wait_sent(step, 10)
        dist.barrier()
    mirror.close()
    held = {r: [(s, same_leaves(unpack(b), scenario_state(scenario, r, s))) for s, b in states.items()]
            for r, states in mirror.held().items()}
    kinds = {**mirror.sent_kinds, **({"stale": mirror.stale} if scenario == "every5" else {})}
    out.put((rank, wire, kinds, mirror.refused, mirror.allocated, kept_right, held))
    dist.destroy_process_group()


def all_exact(kept: list[list[tuple[int, bool]]]) -> bool:
    return all(ok for states in kept for _, ok in states)


def newest_two(kept: list[list[tuple[int, bool]]]) -> list[list[int]]:
    return [[step for step, _ in states] for states in kept]


def test_an_unchanged_state_goes_as_a_header_alone() -> None:
    from hpc_ddp.rank.salvage.mirror_wire import DELTA, FLAT, HEADER, UNCHANGED

    for rank, wire, kinds, refused, allocated, kept, held in spawn_ranks(_exchange, 1, 2, "unchanged", timeout=60):
        assert kinds[FLAT] == 1 and kinds[UNCHANGED] == 11 and kinds[DELTA] == 0
        state_bytes = [n for step, n in wire if step == 1]
        assert len(state_bytes) == 1 and state_bytes[0] > 256 * 1024  # the first state whole (after its GROW)
        assert [n for step, n in wire if step > 1] == [HEADER] * 11  # then 48 bytes a step
        assert refused == 0 and allocated <= 3  # three buffers in turn: the buddy's, the one before, the new one
        assert newest_two(kept) == [[1]] + [[s, s - 1] for s in range(2, 13)] and all_exact(kept)
        assert held == {rank: [(12, True), (11, True)], 1 - rank: [(12, True), (11, True)]}


def test_a_delta_of_the_changed_leaves_leaves_the_bytes_a_whole_send_gives() -> None:
    from hpc_ddp.rank.salvage.mirror_wire import DELTA, FLAT, UNCHANGED

    for rank, wire, kinds, refused, allocated, kept, held in spawn_ranks(_exchange, 1, 2, "delta", timeout=60):
        assert kinds[FLAT] == 1 and kinds[DELTA] == 11 and kinds[UNCHANGED] == 0
        assert max(n for step, n in wire if step > 1) < 1024  # the batch and the skeleton, not the 256 KB leaf
        assert refused == 0 and allocated <= 3
        assert newest_two(kept) == [[1]] + [[s, s - 1] for s in range(2, 13)] and all_exact(kept)
        assert held == {rank: [(12, True), (11, True)], 1 - rank: [(12, True), (11, True)]}


@pytest.mark.parametrize("scenario", ["whole", "mixed"])
def test_the_last_two_states_are_held_exactly_whatever_messages_brought_them(scenario: str) -> None:
    """Issue 55: a state that changes wholly at every step (whole messages: three receive buffers in turn), and
    one whose messages are whole, deltas and "unchanged" in every order. After every message the receiver holds
    the ward's state of that step and of the message before, byte for byte what a whole send of each gives,
    and ``held`` gives both ranks' states of the last two boundaries exactly."""
    from hpc_ddp.rank.salvage.mirror_wire import BYTES, DELTA, FLAT, UNCHANGED

    for rank, wire, kinds, refused, allocated, kept, held in spawn_ranks(_exchange, 1, 2, scenario, timeout=60):
        if scenario == "whole":
            assert kinds[FLAT] == 12 and kinds[DELTA] == kinds[UNCHANGED] == 0
        else:
            assert kinds == {BYTES: 0, FLAT: 1 + len(WHOLE_AT), UNCHANGED: len(UNCHANGED_AT), DELTA: 4}
        assert refused == 0 and allocated <= 3
        assert newest_two(kept) == [[1]] + [[s, s - 1] for s in range(2, 13)] and all_exact(kept), kept
        assert held == {rank: [(12, True), (11, True)], 1 - rank: [(12, True), (11, True)]}


def test_a_cadence_sends_a_state_every_n_steps_and_held_says_which_step_stands_in() -> None:
    """``per_rank(..., mirror=5)``: a boundary packs and sends the state when it is at least 5 steps newer than
    the last one packed (steps 1, 6 and 11 of 12); the others copy nothing. After a failure ``held`` gives both
    ranks' states of step 11 for this rank's last boundary, step 12, and ``stale`` says so (the commit puts it in
    the ledger)."""
    for rank, wire, kinds, refused, allocated, kept, held in spawn_ranks(_exchange, 1, 2, "every5", timeout=60):
        assert sorted({step for step, _ in wire if step > 0}) == [1, 6, 11], wire  # -2 and -1: GROW and END
        assert newest_two(kept) == [[1], [6, 1], [11, 6]] and all_exact(kept), kept
        assert held == {r: [(12, False), (11, True), (6, True)] for r in (0, 1)}, held
        assert kinds["stale"] == {0: {12: 11}, 1: {12: 11}} and refused == 0


def test_a_dropped_message_never_leaves_a_wrong_state_and_a_whole_one_mends_it() -> None:
    """Step 5's delta is lost on the way (the seam drops it): the deltas of steps 6 to 8 name step 5 or later as
    their base, the receiver holds step 4 and refuses them (it keeps step 4 and step 3 before it, exact), and
    the whole state that goes every FULL_EVERY (8 here) messages, step 9's, mends it: step 4 is then the one
    before, never a refused step's."""
    for rank, wire, kinds, refused, allocated, kept, held in spawn_ranks(_exchange, 1, 2, "drop", timeout=60):
        assert refused == 3
        assert newest_two(kept) == [[1], [2, 1], [3, 2], [4, 3], [4, 3], [4, 3], [4, 3], [9, 4], [10, 9], [11, 10],
                                    [12, 11]]  # after each message it received
        assert all_exact(kept), kept
        assert held == {rank: [(12, True), (11, True)], 1 - rank: [(12, True), (11, True)]}


def test_the_boundary_never_writes_into_the_last_state_or_the_one_before() -> None:
    """The sender's buffers are reused, but never the last state's or the one before's while they are that:
    ``held`` (a failure handler on a side thread) may read them while the boundary writes the next one. A
    buddy that takes nothing (no sender thread here: every state is replaced while waiting) is the case where
    the one before sits among the free buffers. Both states of a rank's own come back exactly, and a snapshot
    of the step before reuses its bytes."""
    import torch

    from hpc_ddp.rank.salvage.mirror import Mirror
    from hpc_ddp.rank.salvage.mirror_send import IN_FLIGHT

    mirror = Mirror(0, 1, 2, group=None)  # never started: no message goes anywhere
    taken: list[torch.Tensor] = []
    original = mirror._take

    def take(nbytes: int, pinned: bool) -> torch.Tensor:
        buf = original(nbytes, pinned)
        assert all(p is None or p.buf is not buf for p in (mirror.own, mirror.before))
        taken.append(buf)
        return buf

    mirror._take = take  # type: ignore[method-assign]
    for step in range(1, 9):
        mirror.mark(step, blob(0, step))
        assert mirror.held() == {0: {step: blob(0, step), **({step - 1: blob(0, step - 1)} if step > 1 else {})}}
    assert mirror.skipped == 7 and mirror.allocated <= IN_FLIGHT and len({id(b) for b in taken}) == 3
    assert mirror.own_bytes(8) == blob(0, 8) and mirror.own_bytes(7) == blob(0, 7) and mirror.own_bytes(6) is None


def test_a_delta_rebuilds_a_body_byte_for_byte() -> None:
    """rank/salvage/flat.py alone: the changed leaves of a body, written onto the other body, give the first's bytes where
    they are read; leaves whose first bytes agree but whose rest differs are found too."""
    import torch

    from hpc_ddp.rank.salvage import flat

    def body(state: Any) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        layout = flat.plan(state)
        assert layout is not None
        out = torch.zeros(48 + layout.nbytes, dtype=torch.uint8)  # a body starts after the mirror's header
        layout.write(out[48:])
        return out[48:], layout.segments()

    big = torch.randn(100_000)
    old, leaves_old = body({"a": big, "b": torch.zeros(3), "n": 1})
    changed_tail = big.clone()
    changed_tail[-1] += 1  # beyond the first bytes compared
    new, leaves_new = body({"a": changed_tail, "b": torch.zeros(3), "n": 2})
    assert leaves_old == leaves_new
    diff = flat.changed(new, old, leaves_new)
    assert diff == [leaves_new[0], leaves_new[1]]  # the skeleton (n) and a; not b
    delta = torch.zeros(48 + flat.delta_size(diff), dtype=torch.uint8)
    assert flat.write_delta(delta[48:], new, diff) == flat.delta_size(diff)
    flat.apply_delta(old, delta[48:])
    assert all(torch.equal(old[s:e], new[s:e]) for s, e in leaves_new)
    assert flat.changed(new, old, leaves_new) == []
