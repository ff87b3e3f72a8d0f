"""The per-rank mirror's wire format (:mod:`hpc_ddp.rank.salvage.mirror`): a message's header, the
kinds of body, a state as the boundary packed it, and a body read back as a state or as snapshot
bytes.

Apart from the sender (:mod:`~hpc_ddp.rank.salvage.mirror_send`) and the receiver
(:mod:`~hpc_ddp.rank.salvage.mirror_receive`) because both speak it, and what a survivor gives a
snapshot is read back with it.

Each message is one buffer: a header (step, byte count, next size, kind, base, the state's size) and
the bytes. One message, not a header and then the bytes, because the receiver must have its buffer
posted when the bytes arrive: gloo drops what came for a buffer not yet posted when the sender's
connection closes, and a sender killed just after posting is the case that matters. The receiver
posts a buffer of a size both sides know (4 KiB at first) and a message may be shorter (gloo fills
the front of a larger posted buffer: a header alone is 48 bytes on the wire). A message that would
outgrow the size is preceded by a header that says the new size (a sixteenth more than it needs, so
that is rare). Step -1 ends the exchange at the end of an attempt (every rank sends one, so every
receiver leaves its loop and nothing is in flight when the process group is destroyed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpc_ddp.rank.salvage import flat
from hpc_ddp.rank.state import tracked

END = -1  # the header step that ends the exchange
GROW = -2  # the header step that says the next message is larger
# bytes: int64 step, byte count, next size, kind, base step, the state's size
# (16 | 48: any dtype views)
HEADER = 48
# a body of bytes (torch.save's), salvage/flat.py's layout, none, leaves
BYTES, FLAT, UNCHANGED, DELTA = 0, 1, 2, 3
# the ward's state before the kept one is a whole body of its own (not the kept one with an undo)
WHOLE = -1
# bytes the receiver posts at first (both sides start with it; grown as the state needs)
FIRST_SIZE = 4096


@dataclass
class Packed:
    """One state as the boundary wrote it: ``buf`` holds room for a header, then the body (``size``
    bytes of ``kind`` BYTES or FLAT, whose leaves are ``leaves``); ``ready``: the CUDA events its
    copies complete at."""
    step: int
    buf: torch.Tensor
    size: int
    kind: int
    leaves: list[flat.Segment]
    ready: list[torch.cuda.Event] | None
    pinned: bool = False

    def body(self) -> torch.Tensor:
        return self.buf[HEADER:HEADER + self.size]


def grown(nbytes: int) -> int:
    """A buffer size for ``nbytes``: a sixteenth more, in whole 4 KiB pages (a state that grows a
    little fits)."""
    return -(-nbytes * 17 // 16 // 4096) * 4096


def copies(bodies: list[tuple[int, int, torch.Tensor]]) -> list[tuple[int, Any]]:
    """(step, a copy of what its body holds) for each, one copy for a body that is the one before
    it."""
    out: list[tuple[int, Any]] = []
    for i, (step, kind, body) in enumerate(bodies):
        out.append((step, out[-1][1] if i and body is bodies[i - 1][2] else read(body, kind)))
    return out


def read(body: torch.Tensor, kind: int) -> Any:
    """A copy of what a body holds (a state with tensors of its own, or bytes): made under the
    lock."""
    return flat.read(body) if kind == FLAT else body.numpy().tobytes()


def snapshot_bytes(packed: Packed) -> bytes:
    """This rank's own state as snapshot bytes (``torch.save``'s), once its copies from the GPU are
    in it."""
    for event in packed.ready or ():
        event.synchronize()
    got = read(packed.body(), packed.kind)
    return got if isinstance(got, bytes) else tracked.pack(got)


def step_of(m: torch.Tensor) -> int:
    return int(m[:8].view(torch.int64)[0])


def header(step: int, size: int, following: int, kind: int = BYTES, base: int = -1,
           full: int = 0) -> torch.Tensor:
    """A message's header, alone a message (its end, a new size, "unchanged") or the front of
    one."""
    fields = torch.tensor([step, size, following, kind, base, full], dtype=torch.int64)
    return fields.view(torch.uint8)
