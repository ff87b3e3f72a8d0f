"""``python -m hpc_ddp.status``: where a run stands, from its files and Slurm. No torch.

One module per job: :mod:`~hpc_ddp.login.status.cli` (the command line and its exit code),
:mod:`~hpc_ddp.login.status.read` (what a run dir and Slurm say, as plain data),
:mod:`~hpc_ddp.login.status.render` (one run as text), :mod:`~hpc_ddp.login.status.runs` (a
directory of runs, ``--follow``) and :mod:`~hpc_ddp.login.status.plot` (``--plot``). The names
that code and tests import from ``hpc_ddp.login.status`` are here too.
"""

from __future__ import annotations

from hpc_ddp.login.status.cli import BROKEN_PIPE, EPILOG, build_parser, main
from hpc_ddp.login.status.plot import plot
from hpc_ddp.login.status.read import collect, duration
from hpc_ddp.login.status.render import (broken_stop_note, chain_line, compile_note, done_line,
                                         healed_note, lost_note, network_line, render)
from hpc_ddp.login.status.runs import exit_code, find_runs, follow, table

__all__ = ["BROKEN_PIPE", "EPILOG", "broken_stop_note", "build_parser", "chain_line", "collect",
           "compile_note", "done_line", "duration", "exit_code", "find_runs", "follow",
           "healed_note", "lost_note", "main", "network_line", "plot", "render", "table"]
