"""``status`` over several runs and over time: a directory of run dirs as one line per run, the exit
code that says how the runs stand, and ``--follow``'s refresh loop (its clock and sleep are seams,
so a test drives it with a fake clock). No torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.core import codes
from hpc_ddp.rundir import layout

# verdict -> exit code; a set of runs exits with the first of these that one of its runs has
EXIT = {"failed": codes.STATUS_FAILED, "stopped": codes.STATUS_STOPPED,
        "unknown": codes.STATUS_UNKNOWN,
        "active": codes.STATUS_OK, "finished": codes.STATUS_OK}


def exit_code(verdicts: list[str]) -> int:
    """The status of a set of runs: failed over stopped over unknown over running or finished."""
    return next((EXIT[v] for v in EXIT if v in verdicts), codes.STATUS_OK)


def find_runs(root: Path, depth: int = 2) -> list[Path]:
    """The run dirs under ``root`` (directories holding a config.yaml), ``depth`` levels down:
    ``runs/`` holds runs, and a sweep's base dir (``runs/mlp``) holds one run per combination."""
    found: list[Path] = []
    for child in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if layout.config(child).is_file():
            found.append(child)
        elif depth > 1:
            found.extend(find_runs(child, depth - 1))
    return found


def run_line(info: dict[str, Any], root: Path) -> list[str]:
    """One run's columns: name, state, step/max, its last attempt, job."""
    progress, attempts = info["progress"], info["attempts"]
    reached = [a["last_step"] for a in attempts if isinstance(a.get("last_step"), int)]
    current = progress.get("step") if progress.get("step") is not None else (reached[-1] if reached
                                                                             else None)
    # no metrics logged yet: how far the ledger says it got
    step = "-" if current is None else str(current)
    if progress.get("max_steps") and current is not None:
        step += f"/{progress['max_steps']}"
    if attempts:
        last = attempts[-1]
        attempt = f"#{len(attempts) - 1} {last.get('reason', '?')}" + (" (cap)"
                                                                       if last.get("capped")
                                                                       else "")
    else:
        attempt = "-"
    state = "FINISHED" if info["done"] else (info["state"] or "unknown")
    if info.get("pending_reason"):
        state += f" ({info['pending_reason']})"
    path = Path(info["run_dir"])
    name = str(path.relative_to(root)) if path.is_relative_to(root) else info["run_dir"]
    return [name, state, step, attempt, str(info["job_id"] or "-")]


def table(infos: list[dict[str, Any]], root: Path) -> str:
    """The runs under ``root``, one line each, in aligned columns."""
    rows = [["run", "state", "step", "last attempt", "job"]] + [run_line(info, root)
                                                                for info in infos]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)


def follow(show: Callable[[], tuple[str, list[str]]], every: float, *,
           out: Callable[[str], None] = print,
           sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.time) -> int:
    """Print ``show()`` (text, the runs' verdicts) every ``every`` seconds until no run is active;
    the exit code of the last view. Each view is headed by the time it was taken."""
    while True:
        text, verdicts = show()
        out(f"--- {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(clock()))} ---\n{text}")
        if "active" not in verdicts:
            return exit_code(verdicts)
        sleep(every)
