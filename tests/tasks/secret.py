"""An own loop that shows what the ranks got from ``${oc.env:...}`` without writing it (tests/core/test_security_boundary.py)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def digests_user_token(run: Any) -> None:
    """Each rank writes RUN_DIR/token-RANK.json: the sha256 of user.token and user.copy as the rank resolved them
    (the values themselves must stay out of the run dir); trains two steps so the run finishes."""
    user = run.config.user
    seen = {key: hashlib.sha256(str(user[key]).encode()).hexdigest() for key in ("token", "copy")}
    (run.run_dir / f"token-{run.rank}.json").write_text(json.dumps(seen))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = run.resume(model=model, optimizer=optimizer)
    while step < 2:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if run.boundary(step):
            return
