"""Hostlist expansion: tables, Slurm's documented examples, errors, and scontrol as the oracle."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_ddp.core.errors import SlurmEnvError
from hpc_ddp.core.hostlist import MAX_RANGE, compress_hostlist, expand_hostlist

TABLE = [
    ("n1", ["n1"]),
    ("", []),
    ("a,b,c", ["a", "b", "c"]),
    ("a b\tc\nd", ["a", "b", "c", "d"]),
    ("a,,b,", ["a", "b"]),
    ("node[009-011]", ["node009", "node010", "node011"]),
    ("n[8-10]", ["n8", "n9", "n10"]),  # width comes from lo: no padding
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
    ("n[00-02]", ["n00", "n01", "n02"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("n[3,1,2]", ["n3", "n1", "n2"]),  # order kept
    ("n1,n1", ["n1", "n1"]),  # duplicates kept
    ("rack[1-2]-n[08-10]", ["rack1-n08", "rack1-n09", "rack1-n10", "rack2-n08", "rack2-n09", "rack2-n10"]),
    ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
    # three groups: Slurm's recursion varies the last fastest, then the first, the second slowest
    ("x[1-2]y[01-02]z[3]", ["x1y01z3", "x2y01z3", "x1y02z3", "x2y02z3"]),
    ("login.cluster-1,gpu-node.a[1-2]", ["login.cluster-1", "gpu-node.a1", "gpu-node.a2"]),
    ("n-[1-2]", ["n-1", "n-2"]),
    ("[1-2]", ["1", "2"]),
    ("n[1-2],m", ["n1", "n2", "m"]),
    # Slurm's documentation examples (Slurm::Hostlist, slurm_hostlist_create(3), sbatch --nodelist)
    ("node1,node[2-5,12]", ["node1", "node2", "node3", "node4", "node5", "node12"]),
    ("tux[0-5,12,20-25]", [f"tux{i}" for i in [0, 1, 2, 3, 4, 5, 12, 20, 21, 22, 23, 24, 25]]),
    ("linux[1-3,6]", ["linux1", "linux2", "linux3", "linux6"]),
    ("lx[15,18,32-33]", ["lx15", "lx18", "lx32", "lx33"]),
]

MALFORMED = [
    ("a[]", 2), ("a[2-1]", 2), ("a[1-2", 1), ("a]", 1), ("x[a-b]", 2), ("n[1 -2]", 2), ("n[1-2,]", 6),
    ("n[-2]", 2), ("n[1--2]", 4), ("n[+1-2]", 2), ("a[[1]]", 2), ("n[1-2]]", 6), ("d[1-2].x", 6),
    ("a[1-2]b,c", 6), (f"n[0-{MAX_RANGE}]", 2),
]


@pytest.mark.parametrize(("text", "expected"), TABLE)
def test_table(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


@pytest.mark.slurm
@pytest.mark.parametrize(("text", "expected"), TABLE)
def test_table_agrees_with_scontrol(text: str, expected: list[str], scontrol_hostnames) -> None:
    assert scontrol_hostnames(text) == expected


@pytest.mark.parametrize(("text", "position"), MALFORMED)
def test_malformed_names_text_and_position(text: str, position: int) -> None:
    with pytest.raises(SlurmEnvError) as info:
        expand_hostlist(text)
    message = str(info.value)
    assert repr(text) in message and f"position {position}" in message and "HINT" in message
    assert message.splitlines()[-1] == " " * (position + 4) + "^"


@pytest.mark.slurm
@pytest.mark.parametrize("text", ["a[]", "a[2-1]", "x[a-b]", "n[1-2,]", "n[-2]", "n[1-2]]", "d[1-2].x",
                                  "a[1-2]b,c", f"n[0-{MAX_RANGE}]"])
def test_malformed_is_also_invalid_for_slurm(text: str, scontrol_hostnames) -> None:
    assert scontrol_hostnames(text) is None


def test_a_huge_product_is_refused_not_built() -> None:
    with pytest.raises(SlurmEnvError, match="too many hosts"):
        expand_hostlist("a[0-65535]b[0-65535]")


def test_non_text_is_refused() -> None:
    with pytest.raises(SlurmEnvError, match="must be text"):
        expand_hostlist(None)  # type: ignore[arg-type]


@st.composite
def ranges(draw: st.DrawFn) -> str:
    """'07-12' or '3': lo possibly zero-padded, small spans so scontrol's output stays short."""
    lo = draw(st.integers(0, 120))
    width = draw(st.integers(1, 3))
    lo_text = str(lo).zfill(width)
    if draw(st.booleans()):
        return lo_text
    hi = lo + draw(st.integers(0, 12))
    return f"{lo_text}-{str(hi).zfill(draw(st.integers(1, 3)))}"


name = st.text(alphabet="abcnxyz", min_size=1, max_size=3).flatmap(
    lambda head: st.text(alphabet="abz0189.-_", max_size=4).map(lambda tail: head + tail))
group = st.lists(ranges(), min_size=1, max_size=3).map(lambda r: "[" + ",".join(r) + "]")
bracketed = st.tuples(name, st.lists(st.tuples(st.text(alphabet="-._ab1", max_size=2), group), min_size=1,
                                     max_size=3)).map(lambda t: t[0] + "".join(lit + g for lit, g in t[1]))
hostlists = st.lists(st.one_of(name, bracketed), min_size=1, max_size=4).flatmap(
    lambda items: st.sampled_from([",", " "]).map(lambda sep: sep.join(items)))


@pytest.mark.slurm
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=hostlists)
def test_random_valid_hostlists_match_scontrol(text: str, scontrol_hostnames) -> None:
    assert expand_hostlist(text) == scontrol_hostnames(text)


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet="ab01-[], \t.x", max_size=30) | st.text(max_size=30))
def test_garbage_raises_only_slurm_env_error(text: str) -> None:
    try:
        hosts = expand_hostlist(text)
    except SlurmEnvError:
        return
    assert all(isinstance(h, str) and h for h in hosts)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n", "gpu", "rack1-n", "a.b", ""]), st.integers(0, 30),
                          st.integers(1, 3)), max_size=12))
def test_compress_round_trips(parts: list[tuple[str, int, int]]) -> None:
    hosts = [f"{prefix}{str(number).zfill(width)}" for prefix, number, width in parts]
    assert expand_hostlist(compress_hostlist(hosts)) == hosts


def test_compress_forms() -> None:
    assert compress_hostlist(["n1", "n2", "n3", "n5"]) == "n[1-3,5]"
    assert compress_hostlist(["n8", "n9", "n10"]) == "n[8-10]"
    assert compress_hostlist(["node0", "node1", "gpu7"]) == "node[0-1],gpu7"
    with pytest.raises(SlurmEnvError, match="cannot compress"):
        compress_hostlist(["bad[1]"])
