"""Preflight's checks of the run dir: writable, shared between nodes (not node-local), and not
writable by others beyond ``run_dir_mode``.

Apart because they read the filesystem (the mounts table is a seam), not the config's numbers or
Slurm. No torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.run_dir_mode import loose_folders, run_dir_folders
from hpc_ddp.login.preflight.finding import Finding

# the local test cluster's shared root (hpc_ddp.slurm_local.conf.ClusterSpec.shared, checked equal
# by a test): not imported from there, the local cluster's package costs the CLI ~9 ms (issue 56)
LOCAL_CLUSTER_SHARED = Path("/var/tmp/hpc_ddp-shared")
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")
NODE_LOCAL_FSTYPES = ("tmpfs", "ramfs")


def _mount_of(path: Path, mounts: str) -> tuple[str, str]:
    """(mount point, fstype) of the longest mount point containing ``path``, from /proc/mounts
    text."""
    best = ("/", "")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and (str(path) == fields[1]
                                 or str(path).startswith(fields[1].rstrip("/") + "/")):
            if len(fields[1]) >= len(best[0]):
                best = (fields[1], fields[2])
    return best


def check_run_dir(run_dir: Path, mounts: str | None = None) -> list[Finding]:
    """Writable (the nearest existing parent, if it does not exist yet) and shared between nodes."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    findings = []
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        findings.append(Finding("error", "run_dir", f"cannot write the run dir {run_dir} "
                                                    f"({existing} is not a "
                                "writable directory)", "set run_dir=... to a directory you can "
                                                       "write on a "
                                "shared filesystem (e.g. $HOME or /scratch/$USER)"))
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            mounts = ""
    point, fstype = _mount_of(run_dir, mounts)
    under = next((prefix for prefix in NODE_LOCAL_PREFIXES if str(run_dir).startswith(prefix + "/")
                  or str(run_dir) == prefix), None)
    # the local cluster's shared root: every node sees it
    if LOCAL_CLUSTER_SHARED in (run_dir, *run_dir.parents):
        under = None
    if under or fstype in NODE_LOCAL_FSTYPES:
        where = f"it is under {under}" if under else f"{point} is {fstype}"
        findings.append(Finding("warning", "run_dir", f"run dir {run_dir} looks node-local "
                                                      f"({where}): other "
                                "nodes, and a requeued job on another node, will not see its "
                                "snapshots",
                                "use a shared filesystem (e.g. $HOME or /scratch/$USER) unless the "
                                "job runs "
                                "on this one machine"))
    return findings


def check_run_dir_writers(cfg: RunConfig) -> list[Finding]:
    """A run dir, slurm/ or compile_cache/ that others may write beyond run_dir_mode: they could run
    code as you (docs/security.md). A run dir not made yet is made with run_dir_mode."""
    return [Finding("warning", "run_dir_mode", what, fix)
            for what, fix in loose_folders(run_dir_folders(cfg.run_dir), cfg.run_dir_mode)]
