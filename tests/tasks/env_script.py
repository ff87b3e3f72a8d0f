"""A torchrun-style script that records what its environment holds (what a cluster profile's setup line and srun
argument export, the config's user section) to RUN_DIR/env-RANK.json, then ends: the observable of the profile and
user-section tests. It needs no process group."""

from __future__ import annotations

import json
import os
from pathlib import Path

WATCHED = ("PROFILE_SET", "PROFILE_SRUN", "SLURM_JOB_PARTITION", "HPC_DDP_USER")
rank = os.environ["RANK"]
seen = {k: v for k, v in os.environ.items() if k in WATCHED or k.startswith("HPC_DDP_USER_")}
print(f"step 1 rank {rank}", flush=True)
(Path(os.environ["HPC_DDP_RUN_DIR"]) / f"env-{rank}.json").write_text(json.dumps(seen))
