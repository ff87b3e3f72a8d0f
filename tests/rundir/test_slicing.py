"""The split layout of a snapshot: the plan's arithmetic (property tests), the manifest's checks, and
splitting a real training state apart and back together."""

from __future__ import annotations

import collections
import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_ddp.rundir import slicing

SIZES = st.lists(st.tuples(st.integers(0, 3_000_000), st.sampled_from([1, 2, 4, 8])), max_size=12)


@settings(max_examples=300, deadline=None)
@given(sizes=SIZES, slices=st.integers(1, 9), min_split=st.sampled_from([1, 1000, slicing.MIN_SPLIT]))
def test_the_plan_covers_every_tensor_once_and_balances_the_slices(sizes: list[tuple[int, int]], slices: int,
                                                                 min_split: int) -> None:
    pieces = slicing.plan(sizes, slices, min_split)
    assert pieces == slicing.plan(sizes, slices, min_split)  # every writer computes the same plan
    by_tensor: dict[int, list[slicing.Piece]] = collections.defaultdict(list)
    for piece in pieces:
        by_tensor[piece.tensor].append(piece)
        assert 0 <= piece.slice < slices
    for index, (numel, _) in enumerate(sizes):
        ranges = [(p.start, p.stop) for p in by_tensor[index]]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel  # contiguous, in order, whole
        assert all(a[1] == b[0] and b[0] < b[1] for a, b in zip(ranges, ranges[1:]))
    total = sum(n * i for n, i in sizes)
    load = [0] * slices
    for piece in pieces:
        load[piece.slice] += (piece.stop - piece.start) * sizes[piece.tensor][1]
    small = max([n * i for n, i in sizes if n * i < min_split] + [0])
    item = max([i for _, i in sizes] + [1])
    if slices > 1:  # every slice within a small tensor (placed whole) and an element of its fair share
        assert max(load) <= math.ceil(total / slices) + small + item


@given(nodes=st.integers(1, 12), replicas=st.integers(1, 14))
def test_each_slice_is_held_by_replicas_nodes_and_each_node_holds_replicas_slices(nodes: int, replicas: int) -> None:
    copies = min(replicas, nodes)
    held = {node: slicing.slices_of(node, nodes, replicas) for node in range(nodes)}
    for owner in range(nodes):
        assert slicing.holders(owner, nodes, replicas)[0] == owner  # its own node first
        assert sorted(slicing.holders(owner, nodes, replicas)) == sorted(n for n in held if owner in held[n])
        assert len(set(slicing.holders(owner, nodes, replicas))) == copies
    assert all(len(set(h)) == copies and h[0] == node for node, h in held.items())


def training_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(700, 800), torch.nn.ReLU(), torch.nn.Linear(800, 3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 700)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7,
            "mine": {"seen": torch.arange(5), "pair": (torch.ones(2), 3), (1, 2): torch.zeros(3),
                     "nested": [(torch.full((2, 2), 5.0), "x")], "empty": torch.empty(0, 4)}}


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("nodes,replicas", [(1, 2), (2, 1), (2, 2), (3, 2), (4, 9)])
def test_a_training_state_splits_over_the_nodes_and_comes_back_whole(nodes: int, replicas: int) -> None:
    state = training_state()
    skeleton, tensors = slicing.split(state)
    split = slicing.layout_for(tensors, nodes, replicas)
    assert slicing.layout_problem({"layout": split, "files": {}}) is None
    files = {node: slicing.pieces_for(split, tensors, slicing.slices_of(node, nodes, replicas))
             for node in range(nodes)}
    written = []
    for pieces in files.values():  # through torch.save/load(weights_only) as a node file goes
        buffer = io.BytesIO()
        torch.save({"skeleton": skeleton, "pieces": pieces}, buffer)
        written.append(buffer.tell())
        buffer.seek(0)
        pieces.update(torch.load(buffer, weights_only=True)["pieces"])
    from_own = {i: files[owner][i] for i, (_, _, _, owner) in enumerate(split["pieces"])}
    assert same(slicing.assemble(split, skeleton, from_own), state)
    state_bytes = sum(t.nbytes for _, t in tensors)
    assert sum(written) <= min(replicas, nodes) * state_bytes * 1.05  # a part is saved as its own bytes, not
    assert ("mine", (1, 2)) not in [p for p, _ in tensors]  # its whole storage; a tuple key stays in the skeleton


def test_views_are_staged_not_saved_and_parts_are_copies() -> None:
    big = torch.arange(600_000, dtype=torch.float32)  # 2.4 MB: cut in two
    tensors = [(("w",), big)]
    split = slicing.layout_for(tensors, 2, 1)
    part = slicing.pieces_for(split, tensors, [1])
    view = slicing.pieces_for(split, tensors, [1], copy=False)
    (index,) = part
    assert part[index].untyped_storage().nbytes() == part[index].nbytes < big.nbytes
    assert view[index].data_ptr() != big.data_ptr() and view[index].untyped_storage().data_ptr() == big.data_ptr()


def test_sources_take_the_own_node_first_then_a_replica_and_give_up_without_one() -> None:
    manifest = {"layout": {"slices": 3}, "files": {f"node-{n:05d}.pt": {"slices": slicing.slices_of(n, 3, 2)}
                                                   for n in range(3)}}
    names = sorted(manifest["files"])
    assert slicing.sources(manifest, names) == {0: names[0], 1: names[1], 2: names[2]}
    assert slicing.sources(manifest, [names[0], names[2]]) == {0: names[0], 1: names[2], 2: names[2]}
    assert slicing.sources(manifest, [names[0]]) is None  # slice 1 lived in files 1 and 2, both gone
    assert slicing.sources({"files": {"node-00000.pt": {}, "node-00001.pt": {}}}, ["node-00001.pt"]) == \
        {0: "node-00001.pt"}  # format 1: any file is a whole copy


def test_the_rng_holder_is_read_from_the_manifest_or_from_the_old_block_layout() -> None:
    assert slicing.rank_file({"files": {"node-00001.pt": {"ranks": [2, 3]}}, "world_size": 4}, 3) == "node-00001.pt"
    assert slicing.rank_file({"files": {}, "world_size": 4, "num_nodes": 2}, 1) == "node-00000.pt"
    assert slicing.rank_file({"files": {}, "world_size": 4, "num_nodes": 2}, 4) is None


@pytest.mark.parametrize("change,problem", [
    (lambda m: m["layout"].update(format=3), "layout format 3"),
    (lambda m: m["layout"].update(slices=0), "lacks slices"),
    (lambda m: m["layout"]["tensors"][0].__setitem__(1, [-1]), "not [path, shape]"),
    (lambda m: m["layout"]["pieces"].pop(), "cover"),
    (lambda m: m["layout"]["pieces"][0].__setitem__(3, 9), "does not continue"),
    (lambda m: m["layout"]["pieces"][0].__setitem__(0, "os.system"), "is not [tensor, start, stop, slice]"),
    (lambda m: m["files"]["node-00000.pt"].update(slices=[5]), "does not say which"),
])
def test_a_tampered_layout_is_named(change, problem: str) -> None:
    _, tensors = slicing.split(training_state())
    manifest = {"layout": slicing.layout_for(tensors, 2, 2), "files": {"node-00000.pt": {"slices": [0, 1]}}}
    assert slicing.layout_problem(manifest) is None
    change(manifest)
    assert problem in (slicing.layout_problem(manifest) or "")
