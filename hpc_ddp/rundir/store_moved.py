"""Where rank 0 says that it serves the attempt's store on another of its ports
(:mod:`hpc_ddp.core.store_ports`): the first one was taken on its node. The other ranks, waiting to
connect, look here as they look for rank 0's recorded error (``RUN_DIR/errors/``, read by name).
Rare: a taken port of 22,000 that nobody can guess. No torch.
"""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rundir import layout


def path(run_dir: Path | str, tag: str) -> Path:
    return layout.errors(run_dir) / f"{tag}-store-port.txt"


def announce(run_dir: Path | str, tag: str, port: int) -> None:
    target = path(run_dir, tag)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, f"{port}\n")


def announced(run_dir: Path | str, tag: str) -> int | None:
    """The port rank 0 moved to, if it said so."""
    try:
        text = path(run_dir, tag).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
