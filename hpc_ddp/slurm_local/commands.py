"""The throw-away cluster's primitives: find a daemon's binary, run a command against our
slurm.conf, read a pid file, wait for a daemon to answer.

Apart from :mod:`hpc_ddp.slurm_local.daemons`, which starts and stops the daemons in order,
because every step of it is made of these and they know nothing of the order: a command, a file,
a deadline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_ddp.core.errors import ClusterError, explain
from hpc_ddp.slurm_local.conf import ClusterSpec


def which(name: str) -> str | None:
    """shutil.which, plus the sbin directories a non-login root shell may lack on PATH."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _env(spec: ClusterSpec) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(spec.conf_path)}


def run_command(spec: ClusterSpec, cmd: Sequence[str], check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), env=_env(spec), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(explain(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}",
                                   found=(proc.stderr or proc.stdout).strip()[-600:],
                                   hint=f"see the logs under {spec.path('log')}"))
    return proc


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_for(what: str, ready: Callable[[], bool], spec: ClusterSpec, timeout: float = 30,
             log: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.1)
    tail = ""
    if log and (spec.path("log", log)).exists():
        tail = "\n" + "\n".join(spec.path("log",
                                          log).read_text(errors="replace").splitlines()[-15:])
    raise ClusterError(explain(f"{what} did not become ready within {timeout:.0f} s",
                               hint=f"see {spec.path('log', log or '')}") + tail)
