"""``python -m hpc_ddp.status RUN_DIR``: where a run stands, from its files and Slurm.

Job state (squeue, else sacct), the attempts ledger as a table, progress with an ETA, the newest
committed snapshot, the timeline of the last heal or requeue (:mod:`hpc_ddp.core.timeline`), and the
last error lines of the log that says why when the run is not going well (the first rank's own
exception, not a survivor's view of it: :mod:`hpc_ddp.login.failure_logs`). ``--json`` prints the
same as one object; ``--plot loss.png`` draws the loss curve and every other logged metric
(matplotlib, the ``plot`` extra). A directory of run dirs (``runs/``) is shown as one line per run;
``--follow`` refreshes until the runs end. The exit code says how the run stands
(:data:`hpc_ddp.core.codes.STATUS_OK` and after: 0 pending, running or finished; 1 failed; 3
stopped, --resume continues it; 4 unknown; 2 not a run dir). No torch. Also installed as the console
script ``hpc-ddp-status``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hpc_ddp.core.codes import STATUS_USAGE
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.login.status.plot import plot
from hpc_ddp.login.status.read import collect
from hpc_ddp.login.status.render import render
from hpc_ddp.login.status.runs import exit_code, find_runs, follow, table
from hpc_ddp.rundir import layout

BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell tool that died of it returns (git, cat)

EPILOG = """\
examples:
  python -m hpc_ddp.status runs/mlp
  python -m hpc_ddp.status runs/mlp --json | jq .progress
  python -m hpc_ddp.status runs/mlp --plot loss.png          # needs: pip install 'hpc_ddp[plot]'
  python -m hpc_ddp.status runs/                             # every run under runs/, one line each
  python -m hpc_ddp.status runs/mlp --follow --every 10 && echo ok  # every 10 s until it ends

exit codes: 0 pending, running or finished; 1 failed; 2 not a run dir; 3 stopped short of its end
(a cap of time-outs or preemptions, a scancel: submit --resume continues it); 4 unknown (no job, no
attempt yet).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.status", description=for_help(__doc__),
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    parser.add_argument("run_dir", type=Path, help="the run directory (printed by submit), or a "
                                                   "directory of them")
    parser.add_argument("--json", action="store_true", help="print one JSON object (a list for a "
                                                            "directory of runs)")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="also write the loss curve to this image")
    parser.add_argument("--follow", action="store_true",
                        help="refresh every --every seconds until the run, or every run, has ended")
    parser.add_argument("--every", type=float, default=30.0, metavar="SECONDS",
                        help="with --follow: seconds between two views (default 30)")
    return parser


def _refusal(args: argparse.Namespace, runs: list[Path]) -> str | None:
    """Why these arguments show nothing: not a run dir (nor a directory of them), or --plot of
    several runs."""
    if not runs:
        found = ("does not exist)" if not args.run_dir.exists()
                 else f"has no {layout.CONFIG}), nor holds one")
        return (f"{args.run_dir} is not a run directory (it {found}.\nHINT: pass the run dir that "
                "submit printed, "
                "e.g. runs/NAME, or the directory that holds your runs, e.g. runs/")
    if args.plot and runs != [args.run_dir]:
        return (f"--plot draws one run; {args.run_dir} holds {len(runs)}.\nHINT: pass one of them, "
                "e.g. "
                f"python -m hpc_ddp.status {runs[0]} --plot {args.plot}")
    return None


def main(argv: list[str] | None = None) -> int:
    """``status``'s entry point. Its output piped into a reader that closes early (``status RUN |
    head``) ends it quietly, as the shell tools do: Python ignores SIGPIPE, so the write raises
    BrokenPipeError instead."""
    try:
        code = _main(argv)
        # here, not at the interpreter's exit, where the error would print unhandled
        sys.stdout.flush()
    except BrokenPipeError:
        # the idiom of Python's signal docs
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.every <= 0:
        parser.error(f"--every must be a number of seconds > 0; found {args.every:g}")
    one = layout.config(args.run_dir).is_file()
    runs = [args.run_dir] if one else find_runs(args.run_dir)
    problem = _refusal(args, runs)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return STATUS_USAGE
    if args.plot:
        try:
            print(plot(runs[0], args.plot), file=sys.stderr if args.json else sys.stdout)
        except HpcDdpError as err:
            print(f"error: {err}", file=sys.stderr)
            return STATUS_USAGE

    def show() -> tuple[str, list[str]]:
        infos = [collect(run) for run in runs]
        if args.json:
            text = json.dumps(infos[0] if one else infos, default=str)
        else:
            text = render(infos[0]) if one else table(infos, args.run_dir)
        return text, [info["verdict"] for info in infos]

    if args.follow:
        return follow(show, args.every)
    text, verdicts = show()
    print(text)
    return exit_code(verdicts)


if __name__ == "__main__":
    sys.exit(main())

