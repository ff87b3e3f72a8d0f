"""A collective mismatch: the ranks called different collectives, a bug of the program that no retry
fixes.

The usual cause is a branch that only some ranks take with a collective in it: an evaluation on rank
0 alone that runs the DDP model (whose forward broadcasts its buffers) or all-reduces a count. gloo
notices when the sizes differ and aborts the rank from one of its own threads (``terminate called
after throwing an instance of 'gloo::EnforceNotMet'``, then ``Is there a distributed collective
mismatch in your code?``): the process dies of SIGABRT without a Python traceback, and its peers
fail a moment later with ``Connection closed by peer``, the survivors' view. With
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (gloo or NCCL) torch says ``Detected mismatch between collectives
on ranks`` in a Python error instead. Whoever reads the text (a rank's own exception, the batch
shell or the rehearsal reading the logs of a step that ended without a ledger line, ``status``)
calls
:func:`mismatch_line`, and records the attempt as an ``error``: never retried, never healed, no
advice to raise ``slurm.max_failures``. Pure: no imports of hpc_ddp beyond core.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hpc_ddp.core.errors import explain

# Printed by the rank that noticed (gloo's enforce message, torch's DETAIL check, libstdc++'s
# terminate line), the most telling first: the line shown is the first found of the first sign
# present.
MISMATCH_SIGNS = ("Is there a distributed collective mismatch",
                  "Detected mismatch between collectives on ranks",
                  "op.preamble.length <= op.nbytes",
                  "terminate called after throwing an instance of 'gloo::EnforceNotMet'")
_SOURCE = re.compile(r"\[enforce fail at [^\]]*\]\s*|^\s*what\(\):\s*")
SECTION = "docs/troubleshooting.md#the-ranks-disagree-on-the-collectives-a-collective-mismatch"
HINT = (f"every rank must call the same collectives in the same order ({SECTION}): evaluate on "
        "rank 0 with the "
        "unwrapped module (`model.module(x)`, which broadcasts nothing), or run the evaluation on "
        "every rank; no "
        "`dist.all_reduce` inside `if rank == 0:`. A bug of the program: not retried, since every "
        "retry would "
        "meet it again")


def mismatch_line(lines: Iterable[str]) -> str | None:
    """The line that best says the ranks disagreed on a collective, without gloo's source location;
    None if none does."""
    lines = list(lines)
    for sign in MISMATCH_SIGNS:
        for line in lines:
            if sign in line:
                return _SOURCE.sub("", line).strip()
    return None


def mismatch_message(line: str, where: str = "") -> str:
    """The error recorded for an attempt that ended in a collective mismatch: what was said, where,
    the fix."""
    return explain(f"the ranks disagreed on a collective, a bug of the program ({SECTION}); "
                   f"{f'{where} says' if where else 'torch says'}: \"{line.strip()[:400]}\"",
                   hint=HINT)
