"""The batch shell's supervisor through its seams (a fake Slurm runner, a fake srun, a clock): every failure
path ends with the attempt in the ledger and either a new step or the requeue path, never silently."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.shell import heal, shell_rules
from hpc_ddp.core.config import load_config
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.shell.supervise import Step, main, supervise
from hpc_ddp.shell.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
SRUN = ["srun", "--kill-on-bad-exit=1", "python", "-m", "hpc_ddp.worker", "--config", "c.yaml"]


class FakeSlurm:
    """scontrol, squeue, sacct and probe steps, answered from a few facts that a test changes as it goes."""

    def __init__(self, held: list[str], *, batch_host: str = "n1", down: Sequence[str] = (),
                 silent: Sequence[str] = (), end: str | None = None, state: str = "RUNNING") -> None:
        self.held, self.batch_host, self.down, self.silent, self.end = held, batch_host, set(down), set(silent), end
        self.state = state  # squeue's %T
        self.probes: list[list[str]] = []
        self.requeued = 0

    def __call__(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        out, code = "", 0
        if argv[:3] == ["scontrol", "show", "job"]:
            out = f"JobId=7 JobState=RUNNING\n   NodeList={','.join(self.held)} BatchHost={self.batch_host}\n"
        elif argv[:3] == ["scontrol", "show", "node"]:
            out = "".join(f"NodeName={n} State={'DOWN' if n in self.down else 'ALLOCATED'}\n" for n in self.held)
        elif argv[:2] == ["scontrol", "requeue"]:
            self.requeued += 1
        elif argv[0] == "squeue" and "%T" in argv:
            out = self.state
        elif argv[0] == "squeue":
            out, code = (self.end or ""), 0 if self.end else 1
        elif argv[0] == "srun":  # a probe step
            nodes = next(a for a in argv if a.startswith("--nodelist=")).partition("=")[2].split(",")
            self.probes.append(nodes)
            code = 1 if set(nodes) & self.silent else 0
        return subprocess.CompletedProcess(list(argv), code, out, "")


class FakeSrun:
    """The steps the supervisor starts: each returns the next scripted (code, srun lines)."""

    def __init__(self, *outcomes: tuple[int, list[str]]) -> None:
        self.outcomes, self.calls = list(outcomes), []

    def __call__(self, argv: Sequence[str], env: Mapping[str, str], warn_in: float | None) -> tuple[int, list[str]]:
        self.calls.append({"argv": list(argv), "env": dict(env), "warn_in": warn_in})
        return self.outcomes.pop(0)


def make(tmp_path: Path, *overrides: str, slurm: FakeSlurm, srun: FakeSrun, environ: Mapping[str, str] = (),
         command: Sequence[str] = SRUN, clock: float = 1_000_000.0) -> Supervisor:
    cfg = load_config([ROOT / "examples" / "mlp.yaml"],
                      [f"run_dir={tmp_path / 'run'}", "slurm.nodes=1", "slurm.tasks_per_node=2", *overrides])
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": ",".join(slurm.held), "SLURM_RESTART_COUNT": "0",
           "SLURMD_NODENAME": slurm.batch_host, **dict(environ)}
    sup = Supervisor(cfg, env, command, runner=slurm, srun=srun, clock=lambda: clock)
    sup.say = []  # type: ignore[attr-defined]
    return sup


def run(sup: Supervisor, first: Step | None = None) -> int:
    return supervise(sup, first, sup.say.append)  # type: ignore[attr-defined]


def nodelist(call: Mapping[str, Any]) -> str:
    return next(a for a in call["argv"] if a.startswith("--nodelist=")).partition("=")[2]


def test_the_batch_host_trains_last_and_two_nodes_lost_in_a_row_both_heal(tmp_path: Path) -> None:
    """A 1-node job with two spares: n1 runs the batch shell, so n2 trains; n2 is lost, n3 takes over; n3 is
    lost before the run logs another step (the same point): hardware, not a bug, so it heals again, onto the
    batch host, the only node left. Before: n1 trained first, and the second loss ended the run."""
    slurm = FakeSlurm(["n1", "n2", "n3"])
    srun = FakeSrun((137, ["srun: error: Node failure on n2"]), (137, ["srun: error: Node failure on n3"]), (0, []))
    sup = make(tmp_path, "slurm.spare_nodes=2", "slurm.max_failures=0", slurm=slurm, srun=srun)

    def lose(node: str) -> None:
        slurm.held.remove(node)
    def finish() -> None:
        (tmp_path / "run" / "DONE.json").write_text("{}")
    outcomes = iter([lambda: lose("n2"), lambda: lose("n3"), finish])
    original = srun.__call__

    def step(argv: Sequence[str], env: Mapping[str, str], warn_in: float | None) -> tuple[int, list[str]]:
        result = original(argv, env, warn_in)
        next(outcomes)()
        return result
    sup.srun = step
    assert run(sup) == 0
    assert [nodelist(c) for c in srun.calls] == ["n2", "n3", "n1"]
    attempts = read_attempts(tmp_path / "run")
    assert [(a["reason"], a.get("in_job", 0), a["hosts"]) for a in attempts] == [("failed", 0, "n2"),
                                                                                   ("failed", 1, "n3")]
    assert attempts[1]["healed"]["how"] == "replaced"  # the killed healed step keeps how it came to be


def test_torchrun_ranks_are_mapped_to_nodes_by_the_workers_world_not_srun_tasks(tmp_path: Path) -> None:
    """One torchrun per node (SLURM_NTASKS_PER_NODE=1) with 2 ranks each: rank 1 runs on n1, not n2."""
    slurm = FakeSlurm(["n1", "n2", "n3"])
    sup = make(tmp_path, "slurm.nodes=2", "slurm.spare_nodes=1", slurm=slurm, srun=FakeSrun(),
               environ={"SLURM_NTASKS_PER_NODE": "1"})
    record = {"reason": "hung", "stuck_ranks": [1], "world_size": 4, "nodes": 2}
    _, hard, soft = sup.suspects(Step(["n1", "n2"], 0, 4), record)
    assert soft == {"n1": "rank 1 was stuck (watchdog)"} and not hard
    assert heal.stuck_nodes([1], ["n1", "n2"], heal.ranks_per_node(record, ["n1", "n2"], 1)) == soft


def test_a_healer_that_raises_still_leaves_the_line_and_requeues(tmp_path: Path) -> None:
    slurm = FakeSlurm(["n1", "n2"])
    sup = make(tmp_path, "slurm.max_failures=1", slurm=slurm, srun=FakeSrun())

    def broken(step: Step, record: Mapping[str, Any]) -> str | None:
        raise ValueError("cannot read scontrol's line")
    sup.heal = broken  # type: ignore[method-assign]
    assert run(sup, Step(["n2"], 0, 137)) == 137
    [line] = read_attempts(tmp_path / "run")
    assert line["reason"] == "failed" and line["heal_error"] == "ValueError: cannot read scontrol's line"
    assert slurm.requeued == 1 and line["capped"] is False
    raw = (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()
    assert json.loads(raw[0])["reason"] == "failed"  # the line came first, the decision after


def test_no_step_starts_after_a_stop_or_without_the_walltime_to_reach_a_boundary(tmp_path: Path) -> None:
    # a SIGTERM to the batch shell while the probes ran: no new step, the line is there
    slurm = FakeSlurm(["n1", "n2", "n3"])
    sup = make(tmp_path / "a", "slurm.spare_nodes=1", "slurm.max_failures=0", slurm=slurm, srun=FakeSrun())
    probe = sup.probe

    def stopped_while_probing(nodes: Sequence[str]) -> bool:
        sup.stopping = True
        return probe(nodes)
    sup.probe = stopped_while_probing  # type: ignore[method-assign]
    assert run(sup, Step(["n2"], 0, 137, ["srun: error: n2: task 0: Killed"])) == 137
    assert "not healed in the job: a stop signal reached the batch shell" in sup.say[-1]  # type: ignore[attr-defined]
    assert [a["reason"] for a in read_attempts(tmp_path / "a" / "run")] == ["failed"]
    # 100 s left with a 120 s warning: a new step would be killed at the limit; the requeue path instead
    slurm = FakeSlurm(["n1", "n2", "n3"], end="1970-01-12T13:48:20")
    clock = shell_rules_epoch("1970-01-12T13:48:20") - 100
    sup = make(tmp_path / "b", "slurm.spare_nodes=1", "slurm.max_failures=1", slurm=slurm, srun=FakeSrun(),
               clock=clock)
    assert run(sup, Step(["n2"], 0, 137, ["srun: error: n2: task 0: Killed"])) == 137
    assert "100 s of walltime left, less than the stop warning's 120 s" in sup.say[-1]  # type: ignore[attr-defined]
    assert slurm.requeued == 1
    # a node taken down: Slurm is ending the job, and squeue's end is its actual end (now), not the time limit's:
    # the trial's hint said "0 s of walltime left" with 58 minutes to go
    slurm = FakeSlurm(["n1", "n2", "n3"], end="1970-01-12T13:48:20", state="NODE_FAIL")
    sup = make(tmp_path / "c", "slurm.spare_nodes=1", "slurm.max_failures=0", slurm=slurm, srun=FakeSrun(),
               clock=shell_rules_epoch("1970-01-12T13:48:20"))
    assert run(sup, Step(["n2"], 0, 137, ["srun: error: Node failure on n2"])) == 137
    said = sup.say[-1]  # type: ignore[attr-defined]
    assert "walltime left" not in said and "Slurm is ending the job (its state is NODE_FAIL" in said, said


def shell_rules_epoch(text: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(text).timestamp()


def test_a_step_started_inside_the_warning_window_gets_the_warning_from_the_batch_shell() -> None:
    end = 10_000.0
    assert shell_rules.warning_due_in(end, start=5_000.0, now=5_000.0, signal_delay_s=120) is None  # Slurm's
    assert shell_rules.warning_due_in(end, start=9_850.0, now=9_850.0, signal_delay_s=120) == 30.0
    assert shell_rules.warning_due_in(end, start=9_900.0, now=9_900.0, signal_delay_s=120) == 0.0
    assert shell_rules.warning_due_in(None, start=9_900.0, now=9_900.0, signal_delay_s=120) is None
    assert shell_rules.walltime_problem(end, 9_700.0, 120) == ""
    assert "179 s of walltime left" in shell_rules.walltime_problem(end, 9_821.0, 120)


def test_in_job_restarts_leave_the_port_to_the_attempt_unless_you_chose_one(tmp_path: Path) -> None:
    slurm = FakeSlurm(["n1", "n2", "n3"])
    srun = FakeSrun((0, []))
    sup = make(tmp_path, "slurm.spare_nodes=1", slurm=slurm, srun=srun)
    run(sup, Step(["n2"], 0, 137, ["srun: error: n2: task 0: Killed"]))
    # the restarted step's ranks draw their own unguessable ports from the run's secret (core/store_ports.py)
    assert "MASTER_PORT" not in srun.calls[0]["env"]
    # a port the user chose is theirs: moved on by the restart's number
    sup = make(tmp_path / "b", "slurm.spare_nodes=1", slurm=FakeSlurm(["n1", "n2", "n3"]), srun=FakeSrun((0, [])),
               environ={"MASTER_PORT": "29500"})
    run(sup, Step(["n2"], 0, 137, ["srun: error: n2: task 0: Killed"]))
    assert sup.srun.calls[0]["env"]["MASTER_PORT"] == "29501"  # type: ignore[attr-defined]


def test_a_taken_rendezvous_port_is_a_failure_to_heal_not_a_configuration_error() -> None:
    from hpc_ddp.rank.group.distributed import RendezvousError
    assert RendezvousError("taken").retry_may_help


def test_only_the_nodes_the_plan_uses_are_probed_in_one_step(tmp_path: Path) -> None:
    held = [f"n{i}" for i in range(1, 10)]  # 8 training nodes and a spare (the batch host, n1)
    slurm = FakeSlurm(held, silent=["n2"])
    sup = make(tmp_path, "slurm.nodes=8", "slurm.spare_nodes=1", slurm=slurm, srun=FakeSrun())
    said = sup.heal(Step(held[1:], 0, 137, ["srun: error: n5: task 8: Killed"]), {"reason": "failed"})
    assert said is not None and said.startswith("replaced")
    # the plan without n5 takes n1 (the only spare); one step over those 8 fails (n2 is silent), its halves are
    # probed, then the failing half's halves, down to n2 alone; the plan made again has no node left to replace
    # n2: a retry keeps n5 (soft)
    assert slurm.probes[0] == ["n1", "n2", "n3", "n4", "n6", "n7", "n8", "n9"]
    rounds = [slurm.probes[1:3], slurm.probes[3:5], slurm.probes[5:7]]  # a round's probes run at once, any order
    assert [sorted(r) for r in rounds] == [[["n1", "n2", "n3", "n4"], ["n6", "n7", "n8", "n9"]],
                                           [["n1", "n2"], ["n3", "n4"]], [["n1"], ["n2"]]]
    assert len(slurm.probes) == 1 + 6 + 1
    assert "n2" not in sup.healer.next_nodes and "n2" in sup.healer.healed["excluded"]


def test_the_silent_nodes_are_found_by_halves_in_log2_rounds_not_one_by_one() -> None:
    """At 512 nodes one silent node cost 512 probes in 32 rounds of 16 (each up to 20 s); by halves it is
    2 x log2(512) probes in 9 rounds, and three silent nodes about three times that."""
    from hpc_ddp.shell.heal import bisect_silent

    nodes = [f"n{i}" for i in range(512)]
    for silent in (["n300"], ["n7", "n8", "n400"]):
        probes: list[list[str]] = []

        def probe(group: Sequence[str], bad: list[str] = silent) -> bool:
            probes.append(list(group))
            return not set(group) & set(bad)

        assert bisect_silent(nodes, probe) == silent
        assert len(probes) <= 2 * 9 * len(silent), len(probes)
        assert max(len(p) for p in probes) == 256 and min(len(p) for p in probes) == 1


def test_a_probe_that_times_out_has_its_step_cancelled(tmp_path: Path) -> None:
    """Killing srun at the timeout leaves its step at slurmctld, holding the node: the step, found by its name in
    squeue, is cancelled."""
    class Hung(FakeSlurm):
        def __call__(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
            self.calls = getattr(self, "calls", []) + [list(argv)]
            if argv[0] == "srun":
                self.name = next(a for a in argv if a.startswith("--job-name=")).partition("=")[2]
                raise subprocess.TimeoutExpired(list(argv), 20)
            if argv[0] == "squeue":
                return subprocess.CompletedProcess(list(argv), 0, f"7.0 hpc_ddp\n7.4 {self.name}\n", "")
            return super().__call__(argv, **kwargs)

    slurm = Hung(["n1", "n2"])
    sup = make(tmp_path, slurm=slurm, srun=FakeSrun())
    assert sup.probe(["n2"]) is False
    assert ["scancel", "7.4"] in slurm.calls and ["scancel", "7.0"] not in slurm.calls


def test_an_unexpected_command_under_exit_code_still_settles_and_requeues(tmp_path: Path, capsys) -> None:
    config = tmp_path / "c.yaml"
    from hpc_ddp.core.config import save_config
    save_config(load_config([ROOT / "examples" / "mlp.yaml"], [f"run_dir={tmp_path / 'run'}",
                                                                "slurm.max_failures=1"]), config)
    slurm = FakeSlurm(["n1"])
    import hpc_ddp.shell.supervise as module
    real = module.Supervisor

    class Faked(real):  # type: ignore[misc, valid-type]
        def __init__(self, cfg: Any, environ: Any, command: Any, **_: Any) -> None:
            super().__init__(cfg, environ, command, runner=slurm, srun=FakeSrun())
    module.Supervisor = Faked  # type: ignore[misc]
    try:
        code = main(["--exit-code", "137", str(config), "--", "python", "-m", "hpc_ddp.worker"],
                    {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURMD_NODENAME": "n1"})
    finally:
        module.Supervisor = real  # type: ignore[misc]
    assert code == 137 and slurm.requeued == 1
    assert [a["reason"] for a in read_attempts(tmp_path / "run")] == ["failed"]
    assert "hpc_ddp.supervise runs an srun command" in capsys.readouterr().err


def test_a_step_lost_with_the_batch_host_is_recorded_by_the_next_batch_shell(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shell_rules.note_step(run_dir, 7, 0, 1, "n1", 100.0)  # the shell died with this step: no line
    assert shell_rules.settle_lost_step(run_dir, 7, 0, 200.0) is None  # its own attempt: not judged
    line = shell_rules.settle_lost_step(run_dir, 9, 0, 200.0)  # a --resume under a new job
    assert line is not None and line["reason"] == "lost" and line["in_job"] == 1 and line["hosts"] == "n1"
    assert [a["reason"] for a in read_attempts(run_dir)] == ["lost"]
    assert shell_rules.settle_lost_step(run_dir, 9, 0, 300.0) is None  # written once


def test_the_supervisor_forwards_the_warning_with_srun(tmp_path: Path) -> None:
    from hpc_ddp.shell.steps import run_srun
    script = tmp_path / "srun"
    script.write_text("#!/bin/sh\ntrap 'echo got-usr2 >&2; exit 3' USR2\nwhile :; do sleep 0.05; done\n")
    script.chmod(0o755)
    code, _ = run_srun([str(script)], {"PATH": "/usr/bin:/bin"}, warn_in=0.2, warning=signal.SIGUSR2)
    assert code == 3


@pytest.mark.parametrize("spares, nodes, first", [(0, "1", ["n1"]), (1, "1", ["n2"]), (2, "1", ["n2"]),
                                                  (1, "2", ["n2", "n3"])])
def test_the_first_step_leaves_the_batch_host_idle_when_there_are_spares(tmp_path: Path, spares: int, nodes: str,
                                                                         first: list[str]) -> None:
    slurm = FakeSlurm(["n1", "n2", "n3"][:int(nodes) + spares])
    sup = make(tmp_path, f"slurm.spare_nodes={spares}", f"slurm.nodes={nodes}", slurm=slurm, srun=FakeSrun())
    assert sup.first_nodes() == first


def test_after_a_hang_srun_s_first_exit_is_the_watchdog_s_recorder_not_the_culprit(tmp_path: Path) -> None:
    """Seen on the local cluster under the torchrun template: rank 0 (n2) records the hang and exits first, srun
    names n2; blaming it too left no clean pair of nodes, and the step was retried on the stuck node."""
    slurm = FakeSlurm(["n1", "n2", "n3"])
    sup = make(tmp_path, "slurm.nodes=2", "slurm.tasks_per_node=2", "slurm.spare_nodes=1", slurm=slurm,
               srun=FakeSrun(), environ={"SLURM_NTASKS_PER_NODE": "1"})
    record = {"reason": "hung", "stuck_ranks": [2], "world_size": 4, "nodes": 2, "job_id": 7, "restart_count": 0}
    step = Step(["n2", "n3"], 0, 1, ["srun: error: n2: task 0: Exited with exit code 1",
                                     "srun: launch/slurm: _step_signal: Terminating StepId=14.0"])
    said = sup.heal(step, record)
    assert said is not None and sup.healer.next_nodes == ["n1", "n2"], said
    assert list(sup.healer.healed["excluded"]) == ["n3"]


@pytest.mark.parametrize(("reason", "requeued"), [("preemption", True), ("cancelled", False), ("timeout", True),
                                                 ("requeued", False)])  # Slurm requeued it already: nobody again
def test_a_step_a_stop_broke_without_a_ledger_line_is_that_stop_never_a_failure(tmp_path: Path, reason: str,
                                                                               requeued: bool) -> None:
    """A rank marked its step broken by a stop signal and rank 0 wrote no line (killed at the grace time's end):
    the batch shell records the stop Slurm says it was, requeues it unless cancelled, and heals nothing."""
    from hpc_ddp.rundir import jit_files
    from hpc_ddp.shell.settle import settle

    folder = jit_files.folder(tmp_path, 7, 0, 0)
    folder.mkdir(parents=True)
    jit_files.prepare_mark(folder / jit_files.BROKEN_STOP_MARK)  # rank 0's, empty: nobody marked yet
    assert not jit_files.broken_stop_marked(tmp_path, 7, 0, 0)
    (folder / jit_files.BROKEN_STOP_MARK).write_text("broken by a stop signal\n")  # a rank marks it
    requeues: list[int] = []
    outcome = settle(tmp_path, job_id=7, restart_count=0, exit_code=1, limits={"max_preemptions": 3,
                     "max_timeouts": 3, "max_failures": 0}, requeue_job=lambda: requeues.append(1),
                     heal=lambda record: pytest.fail("a stop is never healed"), stop_reason=lambda: reason)
    [line] = read_attempts(tmp_path)
    assert line["reason"] == reason and "recorded by the batch shell" in line["note"]
    assert bool(requeues) == requeued and reason in outcome


def test_the_first_steps_nodes_come_from_its_shape_on_the_jobs_nodes_when_it_left_no_line(tmp_path: Path) -> None:
    """A step that lost a node writes no ledger line, sacct may not have its record yet, scontrol no longer
    lists the lost node, and another node's beat is a name the batch host's cached view may still call absent
    (a CI run recorded a 2-node step as n1's alone, from node 0's beat, and healed it as a 1-node step).
    submitit's step has the shape the login node gave its srun, on the nodes the batch shell started with."""
    from types import SimpleNamespace

    from hpc_ddp.shell.shell_rules import submitit_step_nodes

    def slurm(nodes: int | str, spare_nodes: int) -> SimpleNamespace:
        return SimpleNamespace(nodes=nodes, spare_nodes=spare_nodes)

    job = {"SLURM_JOB_NODELIST": "n[1-3]"}
    assert submitit_step_nodes(job, slurm(2, 1)) == ["n2", "n3"]  # with a spare: --relative=1 --nodes=2
    assert submitit_step_nodes(job, slurm(1, 2)) == ["n2"]
    assert submitit_step_nodes(job, slurm(2, 0)) == ["n1", "n2", "n3"]  # none: the whole allocation
    assert submitit_step_nodes({"SLURM_JOB_NODELIST": "n[1-2]"}, slurm("1-2", 0)) == ["n1", "n2"]  # a 1-2 range on two
    assert submitit_step_nodes({}, slurm(2, 0)) == []
    # the batch shell: Slurm removed n2 from the job (--no-kill), it still trained in step 0
    sup = make(tmp_path, "slurm.nodes=2", "slurm.spare_nodes=1", slurm=FakeSlurm(["n1", "n3"]), srun=FakeSrun(),
               environ=job)
    assert sup.first_step_nodes() == ["n2", "n3"]
