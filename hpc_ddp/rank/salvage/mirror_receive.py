"""The per-rank mirror's receiver (:mod:`hpc_ddp.rank.salvage.mirror`): a thread that keeps the
ward's newest whole state and the one before it, whatever messages brought them (whole, delta,
unchanged).

Apart from the sender (:mod:`~hpc_ddp.rank.salvage.mirror_send`): the two share a lock and the
message format (:mod:`~hpc_ddp.rank.salvage.mirror_wire`), nothing else; a :class:`Receiver` is one
side of a :class:`~hpc_ddp.rank.salvage.mirror.Mirror`.

**Memory, reused.** The receiver keeps its ward's newest whole state and the one before it in two of
three buffers and receives into the third: a whole message is kept where it arrived and the kept one
becomes the one before (the three turn, no copy). A delta is written onto the kept one, after the
old bytes of the leaves it changes were copied into the third buffer (an undo: the state before is
the kept one with them written back, put together only when ``held`` asks; a copy of the leaves that
change, not of the whole state, each step); an "unchanged" message makes the kept bytes the state of
both steps. A refused change (a delta or "unchanged" whose base is not the step kept) alters
neither.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from hpc_ddp.core.errors import first_line
from hpc_ddp.rank.salvage import flat
from hpc_ddp.rank.salvage.mirror_wire import (BYTES, DELTA, END, FIRST_SIZE, FLAT, GROW, HEADER,
                                              WHOLE)

log = logging.getLogger("hpc_ddp.mirror")


class Receiver:
    """The receiving side of a mirror: the receiver thread (:meth:`_receive`) and the ward's last
    two states for ``held``. The mirror sets the fields it shares with the sender (``ward``,
    ``group``, ``_lock``, ``broken``) before :meth:`__init__`."""

    ward: int
    group: dist.ProcessGroup
    _lock: threading.Lock  # the kept state while ``held`` copies it
    broken: str | None  # why the receiver or the sender stopped before the end (a peer died)

    def __init__(self) -> None:
        # the ward's newest whole state: (step, its buffer, kind, size); only the receiver thread
        # replaces it
        self.kept: tuple[int, torch.Tensor, int, int] | None = None
        # the ward's state before that: (step, kind, size, undo); undo WHOLE: its body is in
        # ``_spare``; else it is the kept body with the first ``undo`` bytes of ``_spare`` (a delta:
        # the old bytes of the leaves the last delta changed) written onto a copy of it (0: the kept
        # bytes as they are, "unchanged")
        self.kept_before: tuple[int, int, int, int] | None = None
        # the receiver's third buffer: that state, or its undo
        self._spare = torch.empty(0, dtype=torch.uint8)
        # deltas and unchanged messages this receiver did not apply (not on the step it holds)
        self.refused = 0
        self._stale = False  # refusing since the last whole state

    def _ward_bodies(self) -> list[tuple[int, int, torch.Tensor]]:
        """The ward's kept state and the one before it (:attr:`kept_before`): (step, kind, body),
        newest first (under the lock). The one before is put together in a copy where it is the kept
        one with an undo, and is the kept body itself where an "unchanged" message made it the same
        bytes."""
        kept, before = self.kept, self.kept_before
        if kept is None:
            return []
        newest = kept[1][HEADER:HEADER + kept[3]]
        out = [(kept[0], kept[2], newest)]
        if before is not None:
            step, kind, size, undo = before
            body = (self._spare[HEADER:HEADER + size] if undo == WHOLE else newest if undo == 0
                    else newest.clone())
            if undo > 0:
                flat.apply_delta(body, self._spare[:undo])
            out.append((step, kind, body))
        return out

    def _receive(self) -> None:
        """Receives into one buffer while the ward's newest whole state is kept in another and the
        one before it in a third (:meth:`_keep`): a whole message is kept where it arrived (the
        three turn, no copy); a delta or "unchanged" applies to the kept one when it is of the step
        they name, and is refused otherwise (``held`` reads both under the same lock)."""
        size, into = FIRST_SIZE, torch.empty(FIRST_SIZE, dtype=torch.uint8)
        try:
            while True:
                if into.numel() < size:
                    into = torch.empty(size, dtype=torch.uint8)
                dist.recv(into, self.ward, group=self.group)
                step, length, following, kind, base, full = into[:HEADER].view(torch.int64).tolist()
                if step == END:
                    return
                if step == GROW:  # the next message is larger: received into a larger buffer
                    size = following
                    continue
                into = self._keep(step, kind, base, full, into, length)
        except Exception as err:  # noqa: BLE001
            # its ward was lost, or the pair broke: a failure can lack its state
            self.broken = first_line(err)
            kept = [held[0] for held in (self.kept, self.kept_before) if held is not None] or None
            log.warning("the per-rank mirror of rank %d stopped (%s); this rank holds rank %d's "
                        "state of steps %s. If rank %d was lost in this failure, that is expected: "
                        "the survivors' snapshot takes its state from here. If it is alive, a "
                        "later failure may fall back to the periodic snapshot (a survivors' "
                        "snapshot needs each rank's state of the step it commits; with "
                        "per_rank(..., mirror=N), of a boundary at most 2 N - 1 steps before it)",
                        self.ward, self.broken, self.ward, kept, self.ward)

    def _keep(self, step: int, kind: int, base: int, full: int, got: torch.Tensor,
              length: int) -> torch.Tensor:
        """Keep what ``got`` brings (under the lock), and the state it replaces as the one before
        (what that was is dropped); returns the buffer to receive the next message into. A refused
        change changes neither."""
        with self._lock:
            kept = self.kept
            if kind in (BYTES, FLAT):
                self._stale = False
                free = torch.empty(0, dtype=torch.uint8)
                # three buffers in turn, no copy: the state before the kept one is dropped
                if kept is not None:
                    free, self._spare = self._spare, kept[1]
                self.kept_before = (kept[0], kept[2], kept[3], WHOLE) if kept is not None else None
                self.kept = (step, got, kind, full)
                return free
            if kept is None or kept[0] != base or kept[3] != full:
                self._refuse(step, base, kept)
                return got
            undo = 0
            if kind == DELTA:
                undo = self._apply(kept[1][HEADER:HEADER + full], got[HEADER:HEADER + length],
                                   got.numel())
            self.kept_before = (kept[0], kept[2], kept[3], undo)
            self.kept = (step, *kept[1:])
            return got

    def _apply(self, body: torch.Tensor, delta: torch.Tensor, room: int) -> int:
        """Write ``delta`` onto the kept ``body``, the old bytes of its leaves first kept aside in
        ``_spare`` (the state before it, for ``held``: a copy of the leaves that change, not of the
        whole state); returns their size. A delta whose leaves do not fit raises before anything
        changed."""
        leaves = flat.delta_leaves(delta, body.numel())
        need = flat.delta_size(leaves)
        self.kept_before = None  # its bytes in ``_spare`` are about to go
        # as large as a receive buffer: it takes a turn as one after a whole state
        if self._spare.numel() < need:
            self._spare = torch.empty(max(need, room), dtype=torch.uint8)
        flat.write_delta(self._spare, body, leaves)
        flat.apply_delta(body, delta)
        return need

    def _refuse(self, step: int, base: int,
                kept: tuple[int, torch.Tensor, int, int] | None) -> None:
        """A change not to the step kept: nothing is written, and one warning per stretch of
        refusals."""
        if not self._stale:
            log.warning("the per-rank mirror of rank %d refused its state of step %d (a change to "
                        "step %d; it holds step %s): it keeps that until a whole state comes",
                        self.ward, step, base, kept[0] if kept is not None else None)
        self.refused += 1
        self._stale = True
