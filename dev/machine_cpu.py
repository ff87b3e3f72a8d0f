"""How fast this machine was during a test run, so that a run's minutes can be read against it.

The suite is bound by the machine's CPU (~85-90% of 2 cores), and this machine's speed varies from
day to day: the same suite took 25 minutes on 2026-12-02 and 27-30 on 2026-12-03, when
`import torch, torch._dynamo` (what every rank process pays first) took 2.7-3.1 CPU-s. ``start``
measures that import once (the reference), then keeps ``/proc/stat``'s counters; ``end`` prints
the run's CPU use (every process on the machine, killed ones included) and the run in units of the
reference::

    python dev/machine_cpu.py start .machine-cpu.json
    ... the run ...
    python dev/machine_cpu.py end .machine-cpu.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REFERENCE = "import torch, torch._dynamo"


def counters() -> tuple[float, float]:
    """The machine's busy and total CPU-seconds since boot (``/proc/stat``'s first line; iowait and
    idle count as not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / hz, sum(fields[:8]) / hz


def reference_cpu_s() -> float:
    """The CPU-seconds of one ``python -c REFERENCE`` (user + system of the child)."""
    before = os.times()
    subprocess.run([sys.executable, "-c", REFERENCE], check=True)
    after = os.times()
    return round((after.children_user - before.children_user)
                 + (after.children_system - before.children_system), 2)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "end"):
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[1])
    if argv[0] == "start":
        reference = reference_cpu_s()
        busy, total = counters()
        path.write_text(json.dumps({"busy": busy, "total": total, "wall": time.time(),
                                    "reference_s": reference}))
        return 0
    start = json.loads(path.read_text())
    busy, total = counters()
    used, wall = busy - start["busy"], time.time() - start["wall"]
    print(f"== this machine during the run: {used:.0f} CPU-s busy of {total - start['total']:.0f} "
          f"({used / max(total - start['total'], 1e-9):.0%}) in {wall:.0f} s; `{REFERENCE}` took "
          f"{start['reference_s']} CPU-s at the start (2.7-3.1 on 2026-12-03): the run "
          f"was {wall / start['reference_s']:.0f} such imports long")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
