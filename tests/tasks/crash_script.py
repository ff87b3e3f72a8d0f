"""A torchrun-style script (fault injection) whose rank 1 raises at step 5; the others train on, slowly, until
they are ended. It needs no process group: the crash and how the job treats it are the point."""

from __future__ import annotations

import os
import time

rank = int(os.environ["RANK"])
for step in range(1, 200):
    print(f"step {step}", flush=True)
    if rank == 1 and step == 5:
        raise RuntimeError("a deterministic bug on rank 1 at step 5")
    time.sleep(0.1)
