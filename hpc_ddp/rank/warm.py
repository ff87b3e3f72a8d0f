"""``python -m hpc_ddp.rank.warm``: import torch once, then fork each of the rehearsal's ranks.

A rank's start is mostly imports: ``torch`` and ``torch._dynamo`` (which torch's own
``@_disable_dynamo`` on ``Optimizer.add_param_group`` pulls in at the first optimizer) cost about
2 CPU-s of the 2.1 a rank spends before its first step. A 2 x 2 rehearsal with three attempts
starts 12 ranks; the test suite starts hundreds. The local rehearsal
(:mod:`hpc_ddp.rehearsal.local_warm`) starts this process once per run with the ranks' common
environment; it imports those modules and then, for each request on its socket, forks a rank: the
child takes the rank's own environment, output, working directory and session and runs
``hpc_ddp.worker`` as ``python -m`` would (a fresh ``__main__``, ``sys.argv``, the interpreter's
exit with its ``atexit`` handlers). This process answers with the child's pid, and with its exit
status (``os.waitstatus_to_exitcode``: minus the signal's number for a signal) once it is reaped.

On Slurm every rank is a task of its own, started by srun: nothing there uses this. No thread in
this process (``fork`` copies the calling thread only); of hpc_ddp only the package's root and
:mod:`hpc_ddp.core.shutdown` are imported before the fork, neither reading a variable: each rank
imports the rest with its own environment.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
from typing import Any

from hpc_ddp.core.shutdown import die_with_parent

# what every rank imports first (rank/worker.py's path to the first step); nothing reads a
# variable the ranks set apart at import (the launcher starts a rank cold where others differ)
PRELOAD = ("torch", "torch._dynamo", "omegaconf")
MESSAGE_BYTES = 1 << 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.rank.warm",
                                     description="The rehearsal's warm start of its ranks (started "
                                                 "by hpc_ddp.rehearsal.local_warm, not by hand).")
    parser.add_argument("--fd", type=int, required=True, help="the launcher's socket (SEQPACKET)")
    parser.add_argument("--config", help="the run's config (shown by ps, as a rank's would be)")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports made is never collected: a rank's collector would otherwise walk it and
    # write into every page it shares with this process (copied on write, about 1 s a rank)
    gc.collect()
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        _report_exits(sock)
        if sock in readable:
            data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_BYTES, 1)
            if not data:
                return  # the launcher left: the ranks (PR_SET_PDEATHSIG) go with this process
            pid = _fork(json.loads(data), fds[0], (sock.fileno(), wake_r, wake_w))
            os.close(fds[0])
            sock.send(json.dumps({"started": pid}).encode())


def _report_exits(sock: socket.socket) -> None:
    """Every child that ended since the last look: its pid and exit status, to the launcher."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork(request: dict[str, Any], out: int, own_fds: tuple[int, ...]) -> int:
    """A child that becomes the rank ``request`` describes; its pid, once it leads a session of its
    own (the launcher may signal its group at once: Popen returns after the same step)."""
    sys.stdout.flush()
    sys.stderr.flush()
    settled, child_settled = os.pipe()
    pid = os.fork()
    if pid:
        os.close(child_settled)
        os.read(settled, 1)  # end of file: the child closed its end (or died)
        os.close(settled)
        return pid
    try:
        os.close(settled)
        _become(request, out, own_fds)
        os.close(child_settled)
    except BaseException as exc:  # noqa: BLE001  (never back into the server's loop)
        os.write(2, f"hpc_ddp.rank.warm: could not start the rank: {exc!r}\n".encode())
        os._exit(127)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)  # as the interpreter ends a module that returned: atexit handlers, then 0


def _become(request: dict[str, Any], out: int, own_fds: tuple[int, ...]) -> None:
    """In the child: what ``subprocess.Popen(start_new_session=True, preexec_fn=die_with_parent,
    stdin=DEVNULL, stdout=out, stderr=STDOUT, env=..., cwd=...)`` of a fresh interpreter gives."""
    os.setsid()
    die_with_parent()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in own_fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in (devnull, out):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # a fresh interpreter's NumPy and torch draw their own seeds (Python's random reseeds itself at
    # a fork): forked with this process's, every rank drew the same unseeded torch.randn (a
    # module-level random target, identical on every rank here and different on each of the
    # cluster's, so the rehearsal hid what the cluster would train on)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].default_generator.seed()
    sys.argv = ["-m", *request["argv"]]  # run_module puts the module's file first


if __name__ == "__main__":
    main()
