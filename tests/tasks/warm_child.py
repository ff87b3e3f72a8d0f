"""A module the warm-start tests run as a rank would run ``hpc_ddp.worker``: it reports what a fresh
interpreter would have (its session, environment, argv, output) as one JSON line, then exits with the code
given, or waits to be signalled."""

from __future__ import annotations

import gc
import json
import os
import sys
import time

if __name__ == "__main__":
    import numpy
    import torch

    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv[1:], "main": __name__,
                      "spec": __spec__.name if __spec__ else None, "mark": os.environ.get("WARM_MARK"),
                      "per_rank": os.environ.get("SLURM_PROCID"), "frozen": gc.get_freeze_count() > 0,
                      "cwd": os.getcwd(), "numpy_draw": int(numpy.random.randint(1 << 30)),
                      "torch_draw": int(torch.randint(1 << 30, (1,)))}), flush=True)
    if sys.argv[1] == "wait":
        time.sleep(300)
    sys.exit(int(sys.argv[1]))
