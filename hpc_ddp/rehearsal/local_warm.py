"""The rehearsal's ranks, forked from one warm process instead of each starting a fresh interpreter.

A rank's start is mostly importing torch (about 2 CPU-s of 2.1): on a laptop's 2 cores a 2 x 2
rehearsal spent more of its first seconds importing than training, and the test suite, which
rehearses hundreds of attempts, a third of its CPU. :func:`warm_starts` (around one rehearsal)
starts ``python -m hpc_ddp.rank.warm`` once, which imports torch and then forks each rank on
request (:mod:`hpc_ddp.rank.warm`); :func:`start` hands back a :class:`Started`, which the
launcher's code treats as the ``subprocess.Popen`` it was (``pid``, ``poll()``, ``stdout``): the
rank is its own session, signals and SIGSTOP reach it by pid as before, and its exit status comes
from the warm process that reaps it.

A rank is started cold, as before, when no warm process runs (outside :func:`warm_starts`, or
``HPC_DDP_LOCAL_COLD=1``), when it could not start or has gone, and when the rank's environment
differs from the warm process's in anything but the variables the launcher sets per rank
(``SLURM*``, ``HPC_DDP_*``, ``MASTER_*``): a variable torch reads at import is then the rank's.
No torch in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from hpc_ddp.core import processes
from hpc_ddp.core.shutdown import die_with_parent

COLD_VAR = "HPC_DDP_LOCAL_COLD"
# what the launcher sets per rank (SLURMD_NODENAME too: a simulated node's name)
PER_RANK = ("SLURM", "HPC_DDP_", "MASTER_")
# the warm process's first import of torch, on a loaded 2-core machine
READY_S = 180.0
MESSAGE_BYTES = 1 << 16


class Started:
    """A rank forked by the warm process, as the launcher uses a ``subprocess.Popen``."""

    def __init__(self, warm: Warm, pid: int, stdout: IO[bytes] | None) -> None:
        self.pid, self.stdout, self._warm = pid, stdout, warm
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The rank's exit code (minus the signal's number), None while it runs."""
        if self.returncode is None:
            self.returncode = self._warm.code(self.pid)
        return self.returncode


class Warm:
    """The launcher's end of one warm process (:mod:`hpc_ddp.rank.warm`)."""

    def __init__(self, environ: Mapping[str, str], config_path: Path) -> None:
        self.common = _common(environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hpc_ddp.rank.warm", "--fd", str(theirs.fileno()),
                 "--config", str(config_path)],
                env=dict(environ), pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        self.sock, self.ready, self.gone = ours, False, False
        self.codes: dict[int, int] = {}
        self.lock = threading.Lock()

    def fits(self, environ: Mapping[str, str]) -> bool:
        """Whether a rank with this environment may start here (nothing read at import differs)."""
        return not self.gone and self.proc.poll() is None and _common(environ) == self.common

    def start(self, environ: Mapping[str, str], args: list[str], out: int) -> int:
        """Fork a rank running ``python -m MODULE ARGS`` (``args``: ``[-m, MODULE, ARGS...]``) with
        ``out`` as its stdout and stderr; its pid. OSError when the warm process is gone or never
        became ready."""
        request = {"env": dict(environ), "module": args[1], "argv": list(args[2:]),
                   "cwd": os.getcwd()}
        with self.lock:
            if not self.ready:
                self._answer("ready", READY_S)
                self.ready = True
            socket.send_fds(self.sock, [json.dumps(request).encode()], [out])
            return int(self._answer("started", READY_S))  # type: ignore[call-overload]

    def code(self, pid: int) -> int | None:
        """``pid``'s exit status once the warm process reaped it (no wait). Were the warm process
        gone, its ranks died with it (PR_SET_PDEATHSIG): a rank no longer there reads as
        SIGKILLed."""
        with self.lock:
            while pid not in self.codes and not self.gone:
                try:
                    self._receive(blocking=False)
                except BlockingIOError:
                    break
                except OSError:
                    self.gone = True
            if pid not in self.codes and self.gone and not processes.exists(pid):
                self.codes[pid] = -signal.SIGKILL
            return self.codes.get(pid)

    def close(self) -> None:
        """End the warm process (its ranks are ended by now; any left die with it)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _answer(self, key: str, timeout_s: float) -> object:
        """Read messages, keeping exit codes, until one with ``key``; its value."""
        self.sock.settimeout(timeout_s)
        try:
            while True:
                message = self._receive(blocking=True)
                if key in message:
                    return message[key]
        except OSError:
            self.gone = True
            raise
        finally:
            self.sock.settimeout(None)

    def _receive(self, blocking: bool) -> dict[str, Any]:
        data = self.sock.recv(MESSAGE_BYTES, 0 if blocking else socket.MSG_DONTWAIT)
        if not data:
            raise OSError("the warm process has gone")
        message = json.loads(data)
        if "exited" in message:
            self.codes[int(message["exited"])] = int(message["code"])
        return message


class _Slot:
    """One rehearsal's warm process, started by its first rank (whose environment it takes)."""

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.warm: Warm | None = None

    def for_rank(self, environ: Mapping[str, str]) -> Warm | None:
        if self.warm is None:
            self.warm = Warm(environ, self.config_path)
        return self.warm if self.warm.fits(environ) else None


_SLOTS: list[_Slot] = []


@contextlib.contextmanager
def warm_starts(config_path: Path, environ: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Within: the ranks :func:`start` starts are forked from one warm process (started with the
    first of them), unless ``HPC_DDP_LOCAL_COLD`` is set in ``environ``."""
    if environ.get(COLD_VAR):
        yield
        return
    slot = _Slot(config_path)
    _SLOTS.append(slot)
    try:
        yield
    finally:
        _SLOTS.remove(slot)
        if slot.warm is not None:
            slot.warm.close()


def start(cmd: list[str], environ: Mapping[str, str],
          out: int | IO[bytes]) -> subprocess.Popen[bytes] | Started:
    """Rank ``cmd`` (``[python, -m, module, ...]``): forked warm where it may be, else a fresh
    process; ``out`` is ``subprocess.PIPE`` (rank 0's, read by the tee), ``subprocess.DEVNULL`` or
    an open log file."""
    warm = _SLOTS[-1].for_rank(environ) if _SLOTS and cmd[1:2] == ["-m"] else None
    if warm is not None:
        reader, writer = os.pipe() if out == subprocess.PIPE else (None, None)
        if out == subprocess.DEVNULL:
            writer = os.open(os.devnull, os.O_WRONLY)
        target = writer if writer is not None else out.fileno()  # type: ignore[union-attr]
        try:
            pid: int | None = warm.start(environ, cmd[1:], target)
        except OSError:
            pid = None
        finally:
            if writer is not None:
                os.close(writer)
        if pid is not None:
            return Started(warm, pid, os.fdopen(reader, "rb") if reader is not None else None)
        if reader is not None:
            os.close(reader)
    return subprocess.Popen(cmd, env=dict(environ), stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)


def _common(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a rank shares with every other (what may be read at import)."""
    return {k: v for k, v in environ.items() if not k.startswith(PER_RANK)}
