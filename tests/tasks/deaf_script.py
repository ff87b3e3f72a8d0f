"""A torchrun-style script (fault injection) that does not act on stop signals: its handlers only say so,
and it prints `step N` until its last step, then exits 0. A restarted attempt (HPC_DDP_RESTART_COUNT > 0)
exits 0 at once, as a script resuming from its own final checkpoint would. No process group: how the job
judges the script is the point."""

from __future__ import annotations

import argparse
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--every", type=float, default=0.1, help="seconds per step")
args = parser.parse_args()
for signum in (signal.SIGUSR2, signal.SIGTERM):
    signal.signal(signum, lambda got, frame: print(f"got {signal.Signals(got).name}: not acting on it", flush=True))
if int(os.environ.get("HPC_DDP_RESTART_COUNT", "0")):
    print("restarted: nothing left to train", flush=True)
    raise SystemExit(0)
for step in range(1, args.steps + 1):
    time.sleep(args.every)
    print(f"step {step}", flush=True)
