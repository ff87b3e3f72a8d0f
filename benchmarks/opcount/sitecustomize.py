"""B14's counter (benchmarks/run_dir_ops.py): every Python process started with this folder first on PYTHONPATH
counts its operations on one run dir, through the interpreter's audit hook, whatever code path makes them.

Counted under ``HPC_DDP_OPS_RUN_DIR`` (liveness/ apart): opens for reading, opens that may write or create,
renames, unlinks, directory listings, mkdirs and rmdirs. Each process keeps its counts in a small file of its
own under ``HPC_DDP_OPS_OUT``, written through a memory map, so a rank that ends with ``os._exit`` or is
SIGKILLed still leaves what it counted; with ``HPC_DDP_OPS_TRACE`` set, each operation's path too (a
``.trace`` file beside the counts). Without those variables it does nothing.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading

KINDS = ("open_read", "open_write", "rename", "unlink", "listdir", "mkdir", "rmdir")
BEATS = ("beat_open_read", "beat_open_write")  # liveness/: per period, not per event: counted apart
METRICS = ("metrics_line",)  # metrics.jsonl: one append per line the loop logs (train.log_every): counted apart
# logs/ is the rehearsal's own (one file per rank, its launcher's: on a cluster srun writes the task logs) and is
# not counted
FIELDS = KINDS + BEATS + METRICS


def _install() -> None:
    run_dir, out = os.environ.get("HPC_DDP_OPS_RUN_DIR"), os.environ.get("HPC_DDP_OPS_OUT")
    if not run_dir or not out:
        return
    run_dir = os.path.realpath(run_dir)
    beats = os.path.join(run_dir, "liveness")
    logs = os.path.join(run_dir, "logs") + os.sep
    metrics = os.path.join(run_dir, "metrics.jsonl")
    os.makedirs(out, exist_ok=True)
    role = "rank" if "SLURM_PROCID" in os.environ else "other"  # the rehearsal's ranks have Slurm's variables
    name = os.path.join(out, f"{os.getpid()}-{role}.ops")
    fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8 * len(FIELDS))
    counts = mmap.mmap(fd, 8 * len(FIELDS))
    os.close(fd)
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    busy = threading.local()  # per thread: the hook's own operations are not counted, a peer's are
    trace = open(name[:-4] + ".trace", "a", buffering=1) if os.environ.get("HPC_DDP_OPS_TRACE") else None

    def bump(field: str) -> None:
        at = 8 * FIELDS.index(field)
        counts[at:at + 8] = struct.pack("q", struct.unpack("q", counts[at:at + 8])[0] + 1)

    def under(path: object) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        try:
            text = os.fsdecode(os.fspath(path))  # type: ignore[arg-type]
        except TypeError:
            return None
        full = os.path.abspath(text)
        return full if full == run_dir or full.startswith(run_dir + os.sep) else None

    def hook(event: str, args: tuple) -> None:
        if getattr(busy, "on", False) or not args:
            return
        busy.on = True
        try:
            path = under(args[0])
            if path is None or path.startswith(logs):
                return
            beat = path.startswith(beats + os.sep)
            if path == metrics and event == "open":
                bump("metrics_line")
                return
            if trace is not None:
                trace.write(f"{event} {args[1] if event == 'open' and len(args) > 1 else ''} {path}\n")
            if event == "open":
                mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
                write = bool((flags or 0) & writes) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
                bump(("beat_" if beat else "") + ("open_write" if write else "open_read"))
            elif not beat and event == "os.rename":
                bump("rename")
            elif not beat and event == "os.remove":
                bump("unlink")
            elif not beat and event in ("os.listdir", "os.scandir"):
                bump("listdir")
            elif not beat and event == "os.mkdir":
                bump("mkdir")
            elif not beat and event == "os.rmdir":
                bump("rmdir")
        finally:
            busy.on = False

    sys.addaudithook(hook)


_install()
