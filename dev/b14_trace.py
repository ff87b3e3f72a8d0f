"""Which run-dir paths make B14's failure row grow with the ranks per node: B14's rehearsals of two geometries,
traced per path (``HPC_DDP_OPS_TRACE=1``), and the paths whose failure count (failure minus the 16-step run)
differs between them, numbers folded to N.

    .venv/bin/python dev/b14_trace.py 8x1 8x4 [SCRATCH]

Prints, per differing path: the difference, the path (event, open mode, path with numbers as N), and the count at
each geometry. Beats (liveness/) are included here; B14 counts them apart.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def traced(scratch: Path, geometry: str) -> collections.Counter[str]:
    """Failure minus the 16-step run, per path, at ``geometry`` (NxR)."""
    os.environ["HPC_DDP_OPS_TRACE"] = "1"
    sys.path.insert(0, str(ROOT))
    from benchmarks import run_dir_ops

    nodes, per_node = map(int, geometry.split("x"))
    found: dict[str, collections.Counter[str]] = {}
    keep = run_dir_ops.shutil.rmtree
    try:  # the counts' folder is kept for its traces; the run dirs go as B14's do
        run_dir_ops.shutil.rmtree = lambda p, *a, **k: None if str(p).endswith(".ops") else keep(p, *a, **k)
        for scenario in ("long", "failure"):
            run_dir_ops.counted(scratch, nodes, per_node, scenario)
            counts: collections.Counter[str] = collections.Counter()
            for trace in (scratch / f"b14-{geometry}-{scenario}.ops").glob("*.trace"):
                for line in trace.read_text().splitlines():
                    event, mode, path = (line.split(" ", 2) + ["", ""])[:3]
                    path = re.sub(r"\d+", "N", path.split(f"/b14-{geometry}-{scenario}/")[-1])
                    counts[f"{event} {mode.strip(chr(39))} {path}"] += 1
            found[scenario] = counts
    finally:
        run_dir_ops.shutil.rmtree = keep
    found["failure"].subtract(found["long"])
    return found["failure"]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 2
    scratch = Path(argv[2]) if len(argv) > 2 else Path(tempfile.mkdtemp(prefix="b14-trace-"))
    try:
        first, second = (traced(scratch, g) for g in argv[:2])
        print(f"failure minus the 16-step run: {argv[0]} {sum(first.values())}, {argv[1]} {sum(second.values())}")
        rows = sorted(((second[k] - first[k], k, first[k], second[k]) for k in set(first) | set(second)
                       if first[k] != second[k]), reverse=True)
        for diff, path, a, b in rows:
            print(f"{diff:+5d}  {path}  ({a} -> {b})")
    finally:
        if len(argv) <= 2:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
