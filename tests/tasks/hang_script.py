"""A torchrun-style script (fault injection) that prints three progress lines and then hangs, as one stuck in a
collective or a data loader would: it never exits on its own."""

from __future__ import annotations

import time

for step in range(1, 4):
    print(f"step {step}", flush=True)
    time.sleep(0.1)
time.sleep(3600)
