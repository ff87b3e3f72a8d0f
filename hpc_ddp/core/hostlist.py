"""Slurm hostlists (``gpu[01-04,07]``) expanded and compressed in pure Python.

Why not call ``scontrol show hostnames``: it needs a Slurm config on the node,
costs a process per call, and is absent in the local simulation. The rules
below are Slurm 22.05's (checked against ``scontrol show hostnames``, see
``tests/core/test_hostlist.py``):

* items are separated by commas or whitespace; empty items are skipped;
* a bracket group holds comma-separated numbers or ``lo-hi`` ranges; the width
  of ``lo`` sets the zero padding (``[009-011]``, but ``[8-10]`` is unpadded);
  one range may hold at most 65,536 hosts;
* an item may hold several bracket groups, but text after the last ``]`` is
  invalid (``d[1-2].x`` is rejected by Slurm too);
* with groups g1..gk, the last group varies fastest, then g1, g2, ... g(k-1)
  slowest (Slurm's recursive expansion; for two groups this is the plain
  Cartesian product).

Text Slurm would only accept by accident (``n[1 -2]``, ``a]``, an unclosed
``[``) is rejected here with the position of the problem.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from hpc_ddp.core.errors import SlurmEnvError, explain

SEPARATORS = frozenset(" \t\n,")
MAX_RANGE = 65536  # Slurm's limit on the hosts of one lo-hi range
MAX_HOSTS = 1 << 20  # our guard against a typo that would expand to billions
_MAX_DIGITS = 18  # keeps every number inside Slurm's unsigned long


def _malformed(text: str, pos: int, problem: str, expected: str) -> SlurmEnvError:
    """A SlurmEnvError that quotes the hostlist and points at the position."""
    caret = " " * (pos + 4) + "^"
    message = explain(
        f"malformed Slurm hostlist {text!r}: {problem} at position {pos}",
        expected=expected,
        hint="node lists look like 'node[01-04,07],gpu1'; run `scontrol show hostnames LIST` to "
        "see how Slurm reads it",
    )
    return SlurmEnvError(f"{message}\n    {text}\n{caret}")


def _items(text: str) -> list[tuple[int, str]]:
    """Split at separators outside brackets; return (start position, item) pairs."""
    items: list[tuple[int, str]] = []
    start, open_at = 0, -1
    for pos, char in enumerate(text):
        if char == "[":
            if open_at >= 0:
                raise _malformed(text, pos, "'[' inside brackets", "']' before the next '['")
            open_at = pos
        elif char == "]":
            if open_at < 0:
                raise _malformed(text, pos, "']' without '['", "a '[' before every ']'")
            open_at = -1
        elif char in SEPARATORS and open_at < 0:
            if pos > start:
                items.append((start, text[start:pos]))
            start = pos + 1
    if open_at >= 0:
        raise _malformed(text, open_at, "'[' is never closed", "a matching ']'")
    if len(text) > start:
        items.append((start, text[start:]))
    return items


def _number(text: str, pos: int, digits: str) -> int:
    if not digits.isdigit() or not digits.isascii():
        raise _malformed(text, pos, f"{digits!r} is not a number", "digits, e.g. [01-04,07]")
    if len(digits) > _MAX_DIGITS:
        raise _malformed(text, pos, f"{digits!r} is too long", f"at most {_MAX_DIGITS} digits")
    return int(digits)


def _group(text: str, pos: int, body: str) -> list[str]:
    """Expand the inside of one bracket group that starts at ``text[pos] == '['``."""
    names: list[str] = []
    offset = pos + 1
    for part in body.split(","):
        lo_text, dash, hi_text = part.partition("-")
        lo = _number(text, offset, lo_text)
        hi = _number(text, offset + len(lo_text) + 1, hi_text) if dash else lo
        if hi < lo:
            raise _malformed(text, offset, f"range {part!r} runs backwards", "lo <= hi")
        if hi - lo + 1 > MAX_RANGE:
            raise _malformed(text, offset, f"range {part!r} is too large",
                             f"at most {MAX_RANGE} hosts")
        width = len(lo_text)
        names.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
        offset += len(part) + 1
    return names


def _expand_item(text: str, start: int, item: str) -> list[str]:
    literals: list[str] = []
    groups: list[list[str]] = []
    rest, at = item, start
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        literals.append(head)
        groups.append(_group(text, at + len(head), body))
        at += len(head) + len(body) + 2
    if groups and rest:
        raise _malformed(text, at, f"text {rest!r} after the last ']'",
                         "',' or the end of the list")
    literals.append(rest)
    if math.prod(len(g) for g in groups) > MAX_HOSTS:
        raise _malformed(text, start, "the item expands to too many hosts", f"at most {MAX_HOSTS}")
    if not groups:
        return [item]
    # Slurm's loop nest, outermost first: g(k-1), ..., g1, then gk innermost.
    k = len(groups)
    order = list(range(k - 2, -1, -1)) + [k - 1]
    hosts = []
    for choice in itertools.product(*(groups[i] for i in order)):
        picked = dict(zip(order, choice))
        hosts.append(literals[0] + "".join(picked[i] + literals[i + 1] for i in range(k)))
    return hosts


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in Slurm's order, duplicates kept.

    >>> expand_hostlist("gpu[01-02,07],login")
    ['gpu01', 'gpu02', 'gpu07', 'login']

    Raises :class:`SlurmEnvError` (with the position) for malformed text.
    """
    if not isinstance(text, str):
        raise SlurmEnvError(explain("a hostlist must be text", found=text, expected="a str"))
    hosts: list[str] = []
    for start, item in _items(text):
        hosts.extend(_expand_item(text, start, item))
        if len(hosts) > MAX_HOSTS:
            raise _malformed(text, start, "the list expands to too many hosts",
                             f"at most {MAX_HOSTS}")
    return hosts


def _split_number(name: str) -> tuple[str, str]:
    """'node017' -> ('node', '017'); 'login' -> ('login', '')."""
    stem = name.rstrip("0123456789")
    return stem, name[len(stem):]


def compress_hostlist(hosts: Sequence[str]) -> str:
    """The inverse of :func:`expand_hostlist` for names that end in a number.

    Order is kept (adjacent names with one prefix share a bracket), so
    ``expand_hostlist(compress_hostlist(h)) == list(h)`` for any valid names:
    ``['node0', 'node1', 'gpu7']`` -> ``'node[0-1],gpu7'``.
    """
    groups: list[tuple[str, list[list[str]]]] = []  # (prefix, runs of digit strings)
    for name in hosts:
        if not name or any(c in name for c in "[], \t\n"):
            raise SlurmEnvError(explain("cannot compress host name", found=name,
                                        expected="a non-empty name without brackets, commas or "
                                                 "spaces"))
        prefix, digits = _split_number(name)
        if not digits:
            groups.append((name, []))
            continue
        if groups and groups[-1][0] == prefix and groups[-1][1]:
            run = groups[-1][1][-1]
            width = len(run[0])
            if int(digits) == int(run[-1]) + 1 and f"{int(digits):0{width}d}" == digits:
                run.append(digits)
            else:
                groups[-1][1].append([digits])
        else:
            groups.append((prefix, [[digits]]))
    parts = []
    for prefix, runs in groups:
        if not runs:
            parts.append(prefix)
        elif len(runs) == 1 and len(runs[0]) == 1:
            parts.append(prefix + runs[0][0])
        else:
            ranges = [r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
            parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)
