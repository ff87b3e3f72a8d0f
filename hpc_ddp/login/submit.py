"""``python -m hpc_ddp.submit CONFIG.yaml [key=value ...]``: run a config as a Slurm job.

Submits through submitit (nodes x tasks_per_node tasks, each running the
worker) after preflight checks; ``--local`` rehearses the job on this machine
(nodes x tasks_per_node gloo processes with the Slurm variables srun would set);
``--dry-run`` shows the sbatch script and what every rank would derive;
``--multirun`` submits a job array, one run per combination. Login-node safe:
nothing here imports torch or runs the task's code.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.rundir import layout
from hpc_ddp.core.batching import node_counts, plan, resume_batch_problem, slurm_nodes
from hpc_ddp.core.config import RunConfig, config_diff, describe_diff, flat_values, load_config, save_config
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.login.sbatch import LAUNCHERS, held_nodes, render, submitit_parameters
from hpc_ddp.core.slurm_env import from_environ, simulated_environ

EPILOG = """\
examples:
  python -m hpc_ddp.submit examples/mlp.yaml slurm.partition=gpu slurm.gpus_per_node=4 slurm.tasks_per_node=4
  python -m hpc_ddp.submit examples/mlp.yaml --resume                     # continue a stopped run, new job
  python -m hpc_ddp.submit runs/mlp --resume train.max_steps=200           # the run dir stands in for the YAML
  python -m hpc_ddp.submit examples/mlp.yaml slurm.nodes=1-2 train.global_batch_size=256   # 1 or 2 nodes
  python -m hpc_ddp.submit examples/mlp.yaml --emit-sbatch job.sbatch && sbatch job.sbatch
  python -m hpc_ddp.submit examples/mlp.yaml --emit-sbatch job.sbatch --launcher torchrun   # torchrun per node
  python -m hpc_ddp.submit examples/mlp.yaml --multirun train.lr=0.1,0.01 train.seed=1,2   # 4-run job array
  python -m hpc_ddp.submit examples/mlp.yaml --local                      # 2 nodes x 2 tasks on this machine
  python -m hpc_ddp.submit examples/mlp.yaml --local slurm.nodes=1 train.max_steps=20
  python -m hpc_ddp.submit examples/mlp.yaml --dry-run slurm.nodes=4 slurm.tasks_per_node=8
  python -m hpc_ddp.submit examples/mlp.yaml --local --preempt-at 7,19 --timeout-at 31   # stops, requeues, resumes
  python -m hpc_ddp.submit examples/mlp.yaml --local slurm.spare_nodes=1 --fail-at 30     # a node lost, healed
  python -m hpc_ddp.submit examples/mlp.yaml --local --freeze-at 30:0 dist.liveness_s=5  # a node frozen, found
  python -m hpc_ddp.submit examples/mlp.yaml --local --resume slurm.nodes=1 train.global_batch_size=128
                                            # continue a 2 x 2 rehearsal on 1 node, same global batch

Arguments ending in .yaml/.yml are config files (merged in order); KEY=VALUE arguments override them
(see docs/config.md for every key). The resolved config is written to RUN_DIR/config.yaml; with
--multirun each combination gets RUN_DIR/<label>, e.g. runs/mlp/lr=0.1,seed=1. With --resume the run's
own RUN_DIR/config.yaml is the base: only the KEY=VALUE given with --resume change it.
Also installed as the console script `hpc-ddp-submit`.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.submit", description=for_help(__doc__), epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(parser)
    parser.add_argument("items", nargs="+", metavar="CONFIG.yaml | KEY=VALUE",
                        help="config files, then overrides such as train.lr=0.01")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="rehearse the job on this machine with gloo")
    mode.add_argument("--dry-run", action="store_true", help="show every rank's derived environment; run nothing")
    mode.add_argument("--emit-sbatch", type=Path, metavar="PATH",
                      help="write a standalone sbatch script for this config (from slurm/ddp.sbatch, or "
                      "slurm/ddp_torchrun.sbatch with --launcher torchrun); submit it yourself with `sbatch PATH`")
    parser.add_argument("--launcher", choices=sorted(LAUNCHERS), default="srun",
                        help="with --emit-sbatch: srun starts every worker (default), or one torchrun per node")
    parser.add_argument("--multirun", action="store_true",
                        help="KEY=V1,V2 overrides sweep: one job array, one run dir per combination")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in RUN_DIR from its newest snapshot (a new job; with --local, a "
                        "new rehearsal), with the run's own config.yaml and only the KEY=VALUE given now on top; "
                        "CONFIG may be the run dir")
    parser.add_argument("--no-preflight", action="store_true",
                        help="submit without the login-node checks (Slurm commands, partition, run dir, "
                        "geometry, task module)")
    parser.add_argument("--preempt-at", type=_steps, default=[], metavar="STEPS",
                        help="with --local: preempt (SIGTERM every rank) after these steps, e.g. 7,19 (0: before the "
                        "first step)")
    parser.add_argument("--timeout-at", type=_steps, default=[], metavar="STEPS",
                        help="with --local: send the time-out warning signal after these steps, e.g. 31")
    parser.add_argument("--fail-at", type=_fail_at, default=[], metavar="STEP[:NODE],...",
                        help="with --local: lose a simulated node (SIGKILL its ranks) after STEP, e.g. 30, 30:0 or "
                        "30,60 (NODE: its index among the training nodes, from 0; default the last). The rehearsal "
                        "heals as the batch shell would: a spare takes its place (slurm.spare_nodes), or the run "
                        "goes on with fewer nodes (a slurm.nodes range); else the requeue path (slurm.max_failures)")
    parser.add_argument("--freeze-at", type=_fail_at, default=[], metavar="STEP[:NODE],...",
                        help="with --local: freeze a simulated node (SIGSTOP its ranks) after STEP, as --fail-at "
                        "names it; nothing closes, so the rank watching it declares it lost after dist.liveness_s "
                        "and the step ends (exit 6), healed like --fail-at")
    return parser


def _steps(text: str) -> list[int]:
    try:
        steps = sorted(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers like 7,19; found {text!r}") from None
    if any(s < 0 for s in steps):
        raise argparse.ArgumentTypeError(f"steps are >= 0 (0: after start-up, before the first step); found {text!r}")
    return steps


def _fail_at(text: str) -> list[tuple[int, int | None]]:
    from hpc_ddp.rehearsal.local_heal import parse_fail_at

    try:
        return parse_fail_at(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def split_items(items: list[str]) -> tuple[list[str], list[str]]:
    """Config files (``*.yaml``/``*.yml``, or a run dir: its config.yaml) and ``key=value`` overrides, each in
    the given order."""
    def as_path(item: str) -> str | None:
        if "=" in item:
            return None
        if item.endswith((".yaml", ".yml")):
            return item
        return str(layout.config(item)) if layout.config(item).is_file() else None

    found = [(item, as_path(item)) for item in items]
    return [p for _, p in found if p], [item for item, p in found if p is None]


def resolve(paths: list[str], overrides: list[str] | tuple[str, ...], label: str = "",
            resume: bool = False) -> RunConfig:
    """The run's config. With ``resume``, the run's own config.yaml (its earlier overrides included) with
    only this command line's ``overrides`` on top: the CONFIG file serves to find the run dir."""
    cfg = load_config(paths, list(overrides))
    run_dir = Path(cfg.run_dir).expanduser().resolve()  # workers may start elsewhere
    cfg.run_dir = str(run_dir / label if label else run_dir)
    saved = layout.config(cfg.run_dir)
    if resume and saved.is_file():
        named = {item.split("=", 1)[0].lstrip("+~") for item in overrides}
        try:
            own = load_config([saved], [o for o in overrides if not o.startswith("run_dir=")])
        except HpcDdpError as err:
            raise HpcDdpError(f"--resume reads the run's own config, {saved}, and it cannot be used: {err}",
                              key="run_dir") from None
        _note_file_differences(paths, flat_values(cfg), flat_values(own), named)
        own.run_dir = cfg.run_dir
        return own
    return cfg


def _note_file_differences(paths: list[str], from_file: dict[str, Any], own: dict[str, Any],
                           named: set[str]) -> None:
    """Say which keys the CONFIG file now sets otherwise than the run: --resume keeps the run's values."""
    ignored = [d for d in config_diff(own, from_file) if d[0] not in named and d[0] != "run_dir"]
    if ignored and paths:
        print(f"--resume continues the run with its own config; {', '.join(paths)} differs in "
              f"{describe_diff(ignored)}, which is not applied (name a key on the command line to change it)",
              flush=True)


def resolve_all(items: list[str], multirun: bool, resume: bool = False) -> list[RunConfig]:
    """The run's config, or with ``multirun`` one config per combination (each in RUN_DIR/<label>)."""
    paths, overrides = split_items(items)
    if not multirun:
        return [resolve(paths, overrides, resume=resume)]
    from hpc_ddp.login.sweep import expand

    return [resolve(paths, combo.overrides, combo.label, resume) for combo in expand(overrides)]


def healing_line(slurm: Any) -> str:
    """What a failure costs this run: spares, in-job restarts, then requeues (docs/faults.md, healing)."""
    spares = (f"{slurm.spare_nodes} spare node(s) (the job holds {held_nodes(slurm)})"
              if slurm.spare_nodes else "no spare node" + (", fewer nodes within slurm.nodes"
                                                          if len(node_counts(slurm.nodes)) > 1 else ""))
    return (f"on a failure: {slurm.max_restarts_in_job} in-job restart(s) (slurm.max_restarts_in_job), {spares}; "
            f"then {slurm.max_failures} requeue(s) (slurm.max_failures)")


def submitit_script(cfg: RunConfig, array: int | None = None, python: str = sys.executable,
                    cfgs: list[RunConfig] | None = None) -> str:
    """The sbatch script submitit writes for this config (the same call it makes when submitting)."""
    from submitit.slurm.slurm import _make_sbatch_string  # no public renderer; pinned by a golden file

    folder = _log_folder(cfg, array)
    command = f"{shlex.quote(python)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=folder, map_count=array,
                               **submitit_parameters(cfg, _config_paths(cfgs or [cfg]), python))


def _config_paths(cfgs: list[RunConfig]) -> list[str]:
    return [str(layout.config(c.run_dir)) for c in cfgs]


def _log_folder(cfg: RunConfig, array: int | None) -> Path:
    """submitit's folder: RUN_DIR/slurm, or for a job array the sweep's base dir's slurm/."""
    return (Path(cfg.run_dir).parent if array else Path(cfg.run_dir)) / layout.SLURM_LOGS


def dry_run(cfgs: list[RunConfig], checks: bool = True) -> int:
    from hpc_ddp.core.whoami import table

    cfg, array = cfgs[0], (len(cfgs) if len(cfgs) > 1 else None)
    print("# the sbatch script submit would hand to Slurm (through submitit):\n"
          + submitit_script(cfg, array, cfgs=cfgs))
    if array:
        print(f"job array of {array} runs ({{config}} in the teardown line: each element's RUN_DIR/config.yaml):")
        print("\n".join(f"  [{i}] {c.run_dir}" for i, c in enumerate(cfgs)))
    nodes = node_counts(cfg.slurm.nodes)
    environs = simulated_environ(nodes[-1], cfg.slurm.tasks_per_node, job_id=4242)
    print(f"run {cfg.name}: {shape(slurm_nodes(cfg.slurm.nodes), cfg.slurm.tasks_per_node)}, "
          f"run dir {cfg.run_dir}")
    print(f"program: {program_line(cfg)}")
    print(healing_line(cfg.slurm))
    if not cfg.train.script:
        print(batch_plans(cfg))
    print(f"every rank as Slurm job 4242 would derive it{f' on {nodes[-1]} nodes' if len(nodes) > 1 else ''} "
          "(nodes named node0..; the port follows the job id):")
    print(table([from_environ(e) for e in environs], [e["SLURMD_NODENAME"] for e in environs]))
    if not checks:
        return 0
    from hpc_ddp.login.preflight import preflight  # here: --no-preflight need not import it (benchmark B1)

    findings = preflight(cfg)
    if findings:
        print(f"preflight: {len(findings)} finding(s)")
        print("\n".join(f"  {line}" for f in findings for line in str(f).splitlines()))
    else:
        print("preflight: all checks pass")
    errors = sum(f.level == "error" for f in findings)
    if errors:  # a "dry-run first" gate must stop here, as the submit would
        print(f"preflight found {errors} error(s): submitting would be refused", file=sys.stderr)
        return 2
    return 0


def program_line(cfg: RunConfig) -> str:
    """What every task runs, as --dry-run shows it: the script's command line resolved, or the loop or task."""
    train = cfg.train
    if train.script:
        resume = f" (then on every attempt that continues the run: + {shlex.join(train.resume_args)})" \
            if train.resume_args else ""
        return f"python {shlex.join([train.script, *train.args])}{resume}"
    if train.loop:
        return f"train.loop={train.loop}, called as {train.loop.rsplit(':', 1)[-1]}(run) in every task"
    return f"train.task={train.task}, trained by hpc_ddp's Trainer in every task"


def batch_plans(cfg: RunConfig) -> str:
    """How each node count Slurm may grant splits the global batch (one line per count)."""
    rows = [f"{n} node{'s' if n > 1 else ' '} -> {plan(cfg.train, n * cfg.slurm.tasks_per_node)}"
            for n in node_counts(cfg.slurm.nodes)]
    fixed = (f"train.global_batch_size={cfg.train.global_batch_size}: the accumulation follows the node count"
             if cfg.train.global_batch_size else "train.global_batch_size unset: the batch follows the world size")
    whose = "; run.batch gives a train.loop this plan, a loop that sizes its own batches ignores it" \
        if cfg.train.loop else ""
    return f"batch ({fixed}{whose}):\n" + "\n".join(f"  {row}" for row in rows)


def run_local(cfg: RunConfig, preempt_at: list[int], timeout_at: list[int], resume: bool = False,
              again: str = "", fail_at: list[tuple[int, int | None]] | None = None,
              freeze_at: list[tuple[int, int | None]] | None = None) -> int:
    """Rehearse ``cfg`` here; ``again`` is the command that continues it (shown after Ctrl-C)."""
    from hpc_ddp.core.codes import EXIT_INTERRUPTED
    from hpc_ddp.rehearsal.local import rehearse
    from hpc_ddp.core.stopping import signal_number
    from hpc_ddp.rundir.snapshot import committed_steps

    run_dir = Path(cfg.run_dir)
    _check_free(cfg, resume)
    config_path = _write_config(cfg, resume)
    job_id = int(time.time()) % 10**6
    _write_job(run_dir, {"job_id": job_id, "local": True, "host": socket.gethostname(), "pid": os.getpid()})
    counts = node_counts(cfg.slurm.nodes)
    nodes = counts[-1]  # a range: as many nodes as Slurm could grant on an idle cluster
    print(f"rehearsing {cfg.name} as {shape(nodes, cfg.slurm.tasks_per_node)} on this machine"
          + (f" (slurm.nodes={slurm_nodes(cfg.slurm.nodes)}: the most; --resume slurm.nodes=N continues at "
             "another count)" if len(counts) > 1 else "") + f"; run dir {run_dir}", flush=True)
    try:
        code = rehearse(config_path, run_dir, nodes, cfg.slurm.tasks_per_node, job_id=job_id,
                        preempt_at=preempt_at, timeout_at=timeout_at, warning_signal=signal_number(cfg.slurm.signal),
                        fail_at=fail_at or [], freeze_at=freeze_at or [])
        code = 128 - code if code < 0 else code  # a rank killed by a signal: as a shell reports it (-9 -> 137)
    except KeyboardInterrupt:  # between attempts: the ranks are gone already
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        steps = committed_steps(run_dir)
        kept = f"snapshot of step {steps[0]} committed" if steps else "no snapshot committed yet"
        print(f"interrupted: {kept}; continue with:\n  {again or 'the same command with --resume'}", flush=True)
        return code
    ignored = _ignored_stop(run_dir, job_id)
    if code == 0 and ignored:
        code = 1  # a rehearsal that would lose the run on the cluster has not passed
    metrics = layout.metrics(run_dir)
    print(f"{_outcome(run_dir, code, ignored)}: " + (f"metrics in {metrics}, " if metrics.exists() else "")
          + f"logs in {run_dir / 'logs'}", flush=True)
    return code


def _outcome(run_dir: Path, code: int, ignored: dict[str, Any] | None = None) -> str:
    """How a rehearsal ended, in one word or three: a stop at a requeue cap is not a failure."""
    from hpc_ddp.rundir.ledger import REASONS_CAPPED, read_attempts

    last = (read_attempts(run_dir) or [{}])[-1]
    if code == 0:
        return "finished"
    if last.get("reason") == "finished" and not ignored:
        return "FAILED: the run finished, but a stop it was asked to rehearse never happened (the error above)"
    if ignored:
        note = str(ignored.get("note", ""))
        why = note if note.startswith("the script") else "the loop never called run.boundary(step)"
        return (f"FAILED: {ignored['stop_ignored']} was sent but never acted on (attempt {ignored['restart_count']}): "
                f"{why}; on a cluster this job is killed with nothing saved")
    if last.get("capped") and last.get("reason") in ("timeout", "preemption"):
        return f"STOPPED at step {last.get('last_step')} (slurm.{REASONS_CAPPED[last['reason']]} reached; " \
               "--resume continues it)"
    return f"FAILED (exit code {code})"


def _ignored_stop(run_dir: Path, job_id: int | None) -> dict[str, Any] | None:
    """This rehearsal's attempt whose loop got a stop signal and never acted on it, if any."""
    from hpc_ddp.rundir.ledger import read_attempts

    return next((a for a in read_attempts(run_dir) if a.get("stop_ignored") and a.get("job_id") == job_id), None)


def _write_config(cfg: RunConfig, resume: bool) -> Path:
    """RUN_DIR/config.yaml; on --resume, first say which keys differ from the run's previous config, and after
    it start the run's requeue caps afresh (a ledger line: :func:`hpc_ddp.rundir.ledger.start_caps_afresh`)."""
    path = layout.config(cfg.run_dir)
    if resume and path.exists():
        try:
            diff = [d for d in config_diff(flat_values(load_config([path])), flat_values(cfg)) if d[0] != "run_dir"]
        except HpcDdpError:
            diff = []  # an unreadable old config: it is replaced, as before
        if diff:
            print(f"resuming with a changed config: {describe_diff(diff)}\n"
                  "  (the snapshot's optimizer state is kept; a changed learning rate takes effect, with the "
                  "schedule continuing from the snapshot's step: docs/resume.md)", flush=True)
    if resume:
        from hpc_ddp.login.finished import set_aside

        kept = set_aside(Path(cfg.run_dir))
        if kept:
            print(f"the run had finished: its DONE.json is kept as {kept}; it goes on from its newest snapshot",
                  flush=True)
    saved = save_config(cfg, path)  # first: a run dir it cannot write is refused here, with the fix
    if resume:
        from hpc_ddp.rundir.ledger import start_caps_afresh

        start_caps_afresh(Path(cfg.run_dir))  # a person's --resume: the requeue caps count from here
    return saved


def _write_job(run_dir: Path, record: dict[str, object]) -> None:
    """RUN_DIR/job.json: who runs this run now (a Slurm job, or a local rehearsal's launcher)."""
    layout.job(run_dir).write_text(json.dumps({**record, "submitted": time.time()}) + "\n")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def live_holder(run_dir: Path) -> tuple[str, str] | None:
    """(who, how to stop it) for a job or rehearsal still using the run dir, else None.

    Asked before anything is written: RUN_DIR/job.json names the last job submitted
    (pending or running while squeue lists it) or local rehearsal (while its launcher
    lives); RUN_DIR/lock.json names the job whose ranks are running now.
    """
    from hpc_ddp.core.slurm_jobs import job_state
    from hpc_ddp.rundir.runlock import holder_alive

    job = _read_json(layout.job(run_dir)) or {}
    if job.get("local") and holder_alive({"local": True, "host": job.get("host"), "pid": job.get("pid")}):
        return (f"job {job.get('job_id')} (a local rehearsal: launcher pid {job.get('pid')} on {job.get('host')})",
                "wait for it, or press Ctrl-C in its terminal")
    if "job_id" in job and not job.get("local"):
        state = job_state(str(job["job_id"]))
        if state:
            return f"job {job['job_id']} ({state})", f"wait for it, or cancel it: scancel {job['job_id']}"
    lock = _read_json(layout.lock(run_dir))
    if lock and holder_alive(lock):
        return (f"job {lock.get('job')} (it holds {layout.lock(run_dir)}: host {lock.get('host')}, pid {lock.get('pid')})",
                f"wait for it or stop it; if you are sure nothing uses the run dir, delete {layout.lock(run_dir)}")
    return None


def _check_free(cfg: RunConfig, resume: bool, earlier: bool = True) -> None:
    """Refuse, before anything is written, a run dir in use; and (``earlier``) an earlier run without
    ``resume``, or ``resume`` where there is no earlier run."""
    from hpc_ddp.rundir.runlock import in_use

    run_dir = Path(cfg.run_dir)
    live = live_holder(run_dir)
    if live:
        raise in_use(run_dir, live[0], f"nothing in it was changed; {live[1]}")
    if earlier:
        _check_earlier(run_dir, resume)
        if resume:
            from hpc_ddp.login import finished

            finished.check(cfg)
        if resume and not cfg.train.script:  # a task or a loop: both take run.batch's share of the global batch
            _check_resume_batch(cfg)


def _check_resume_batch(cfg: RunConfig) -> None:
    """Refuse a resume at another world size that would change the global batch (manifests only: no torch)."""
    from hpc_ddp.rundir.snapshot import committed_steps, read_manifest, step_dir

    run_dir = Path(cfg.run_dir)
    steps = committed_steps(run_dir)
    manifest = read_manifest(step_dir(run_dir, steps[0])) if steps else None
    problem = resume_batch_problem(manifest, cfg.train, cfg.slurm.nodes, cfg.slurm.tasks_per_node) if manifest else None
    if problem:
        raise HpcDdpError(problem, key="train.global_batch_size")


def _check_earlier(run_dir: Path, resume: bool) -> None:
    from hpc_ddp.rundir.snapshot import committed_steps  # manifests only: no torch

    earlier = bool(committed_steps(run_dir)) or layout.done(run_dir).exists()
    if earlier and not resume:
        raise HpcDdpError(explain(f"{run_dir} holds an earlier run (snapshots or DONE.json)",
                                  hint="add --resume to continue it from its newest snapshot, or choose a new "
                                  "run with run_dir=..."), key="run_dir")
    started = earlier or any((run_dir / name).exists() for name in (layout.CONFIG, layout.LEDGER))
    if resume and not started:
        raise HpcDdpError(explain(f"--resume: there is no earlier run in {run_dir}",
                                  found=sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else
                                  "no such directory",
                                  expected="the config.yaml, attempts.jsonl or snapshots/ that an earlier submit "
                                  "of this run wrote there",
                                  hint="check run_dir=... (or name=..., which sets the default run_dir "
                                  "runs/NAME); to start a new run, drop --resume"), key="run_dir")


def shape(nodes: int | str, tasks: int) -> str:
    """'1 node x 1 task', '2-4 nodes x 8 tasks': what the job asks of Slurm, in words."""
    return f"{nodes} node{'' if str(nodes) == '1' else 's'} x {tasks} task{'' if tasks == 1 else 's'}"


def check_preflight(cfg: RunConfig, slurm: bool = True) -> None:
    """Print the warnings; raise with every error when there is one."""
    from hpc_ddp.login.preflight import preflight

    findings = preflight(cfg, slurm=slurm)
    for finding in findings:
        if finding.level == "warning":
            print(finding, file=sys.stderr)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise HpcDdpError("preflight found problems; nothing was submitted (--no-preflight skips the checks)\n"
                          + "\n".join(map(str, errors)), key=errors[0].key)


def submit_slurm(cfgs: list[RunConfig], resume: bool) -> int:
    """One job (or a job array, one element per config) through submitit; job.json in each run dir."""
    import submitit

    from hpc_ddp.worker import job_main

    for cfg in cfgs:
        _check_free(cfg, resume)
    paths = [str(_write_config(cfg, resume)) for cfg in cfgs]
    cfg, array = cfgs[0], len(cfgs) > 1
    folder = _log_folder(cfg, len(cfgs) if array else None)
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**submitit_parameters(cfg, paths, sys.executable))
    jobs = executor.map_array(job_main, paths) if array else [executor.submit(job_main, paths[0])]
    for job, one in zip(jobs, cfgs):
        _write_job(Path(one.run_dir), {"job_id": job.job_id, "logs": str(folder)})
    first = jobs[0].job_id.split("_")[0]
    what = f"job array {first} ({len(jobs)} runs)" if array else f"job {first}"
    print(f"submitted {what}: {cfg.name}, {shape(slurm_nodes(cfg.slurm.nodes), cfg.slurm.tasks_per_node)}")
    for job, one in zip(jobs, cfgs):
        log_path = folder / f"{job.job_id}_0_log.out"
        print(f"{'  [' + job.job_id + ']' if array else ''}\n  run dir  {one.run_dir}\n  logs     {folder} "
              f"(rank 0: {log_path})\n  watch    python -m hpc_ddp.status {one.run_dir}\n"
              f"  tail     tail -f {log_path}")
    print(f"  cancel   scancel {first}")
    return 0


def emit_sbatch(cfg: RunConfig, path: Path, launcher: str) -> int:
    _check_free(cfg, resume=True, earlier=False)  # a live run's config is never rewritten
    config_path = save_config(cfg, layout.config(cfg.run_dir))
    layout.slurm_logs(cfg.run_dir).mkdir(parents=True, exist_ok=True)  # Slurm does not create --output's dir
    workdir = os.getcwd()  # where train.task's module was found: the job runs there, wherever sbatch is called
    path.write_text(render(cfg, str(config_path), python=sys.executable, launcher=launcher, workdir=workdir))
    path.chmod(0o755)
    print(f"wrote {path} ({launcher} launcher) for run {cfg.name} (config {config_path}); "
          f"submit it from any directory with: sbatch {path}\n"
          f"  the job runs in {workdir} (its WORKDIR line), {_found_from(cfg)}\n"
          f"  {healing_line(cfg.slurm)}")
    return 0


def _found_from(cfg: RunConfig) -> str:
    """Where the job finds its program: relative to the WORKDIR line."""
    train = cfg.train
    if train.script:
        return f"where train.script={train.script} is found"
    key, value = ("train.loop", train.loop) if train.loop else ("train.task", train.task)
    return f"where {key}={value} is imported from"


def _usage_error(args: argparse.Namespace) -> str | None:
    if (args.preempt_at or args.timeout_at or args.fail_at or args.freeze_at) and not args.local:
        return ("--preempt-at, --timeout-at and --fail-at go with --local, as does --freeze-at. HINT: they rehearse "
                "stops and failures on this machine; add --local (a job on the cluster gets its stops from Slurm)")
    if args.launcher != "srun" and not args.emit_sbatch:
        return "--launcher goes with --emit-sbatch (submit and --local start one worker per task)"
    if args.multirun and args.emit_sbatch:
        return "--multirun submits a job array; --emit-sbatch writes one script for one run (drop one of them)"
    return None


def resume_command(items: list[str], multirun: bool) -> str:
    """The command that continues this rehearsal (printed after Ctrl-C)."""
    return shlex.join(["python", "-m", "hpc_ddp.submit", *items, "--local", "--resume",
                       *(["--multirun"] if multirun else [])])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # options may come between overrides
    problem = _usage_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfgs = resolve_all(args.items, args.multirun, args.resume)
        if args.dry_run:
            return dry_run(cfgs, checks=not args.no_preflight)
        if args.local:
            from hpc_ddp.core.extras import require_extras

            for cfg in cfgs:  # the Slurm path checks this in preflight
                require_extras(cfg.metrics)
            again = resume_command(args.items, args.multirun)
            codes = [run_local(cfg, args.preempt_at, args.timeout_at, args.resume, again, args.fail_at, args.freeze_at)
                     for cfg in cfgs]
            return next((code for code in codes if code), 0)
        if not args.no_preflight:
            check_preflight(cfgs[0], slurm=not args.emit_sbatch)
        if args.emit_sbatch:
            return emit_sbatch(cfgs[0], args.emit_sbatch, args.launcher)
        return submit_slurm(cfgs, args.resume)
    except HpcDdpError as err:
        from hpc_ddp.core.codes import EXIT_LOCKED
        from hpc_ddp.rundir.runlock import RunLockedError

        print(f"error: {err}", file=sys.stderr)
        return EXIT_LOCKED if isinstance(err, RunLockedError) else 2


if __name__ == "__main__":
    sys.exit(main())
