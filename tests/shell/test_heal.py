"""Healing inside the allocation, the pure part: what Slurm says, who is suspect, which nodes run next."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.shell import heal
from hpc_ddp.rundir.ledger import cap_reached, healed_in_job
from hpc_ddp.shell.settle import settle
from hpc_ddp.shell.supervise import srun_lines_before

SHOW_JOB = ("JobId=41 JobName=mlp\n   UserId=root(0) JobState=RUNNING Reason=None Restarts=0\n"
            "   NodeList=n[1,3] BatchHost=n1\n   NumNodes=2 NumCPUs=4\n")


def test_the_job_holds_what_scontrol_says_now() -> None:
    assert heal.job_nodes(SHOW_JOB) == ["n1", "n3"]
    assert heal.job_nodes("JobId=41 ReqNodeList=(null) NodeList=(null)") == []


def test_node_states_and_which_are_bad() -> None:
    text = ("NodeName=n1 Arch=x86_64 State=ALLOCATED ThreadsPerCore=1\n"
            "NodeName=n2 Arch=x86_64 State=DOWN+NOT_RESPONDING ThreadsPerCore=1\n"
            "NodeName=n3 Arch=x86_64 State=MIXED+DRAIN ThreadsPerCore=1\n"
            "NodeName=n4 Arch=x86_64 State=IDLE* ThreadsPerCore=1\n")
    states = heal.node_states(text)
    assert states == {"n1": "ALLOCATED", "n2": "DOWN+NOT_RESPONDING", "n3": "MIXED+DRAIN", "n4": "IDLE*"}
    assert [n for n, s in states.items() if heal.bad_state(s)] == ["n2", "n3", "n4"]


def test_srun_blames_the_first_task_to_die_and_every_lost_node() -> None:
    lines = ["srun: error: n2: task 3: Killed",
             "srun: launch/slurm: _step_signal: Terminating StepId=41.0",
             "srun: error: n1: tasks 0-1: Killed", "srun: error: n2: task 2: Killed"]
    assert heal.culprits(lines) == {"n2": "a task died first there (Killed)"}
    lost = ["srun: error: Node failure on n3", "srun: error: n1: task 0: Killed"]
    assert heal.culprits(lost) == {"n3": "node failure (srun)"}  # n1's task died of n3's loss
    assert heal.culprits(["srun: error: n1: task 0: Exited with exit code 1"]) == {
        "n1": "a task died first there (Exited with exit code 1)"}
    # the killed rank's peer exited (a reset connection) and was reported first: the signal names the culprit
    seen = ["srun: error: n1: task 0: Exited with exit code 1", "srun: error: n2: task 1: Killed",
            "srun: launch/slurm: _step_signal: Terminating StepId=5.0", "srun: error: n3: task 2: Killed"]
    assert heal.culprits(seen) == {"n2": "a task died first there (Killed)"}


def test_the_rank_that_raised_is_blamed_by_its_offer_not_the_bystander_that_exited_first(tmp_path: Path) -> None:
    """The rank that raised wrote its node's share of the survivors' snapshot, so its peers (their collectives
    failed when it left) exited first: srun's first line and the rehearsal's first failed rank named node n1. The
    offers say who raised (an error that is not a peer's loss) and when."""
    from hpc_ddp.rundir import jit_files
    from hpc_ddp.shell.shell_rules import raised_first

    key, nodes = (7, 0, 1), ["n1", "n2"]
    assert raised_first(tmp_path, key, nodes, 2) == {}  # snapshot.jit off: nobody said
    where = jit_files.folder(tmp_path, *key)
    where.mkdir(parents=True)
    peer = "Connection closed by peer [127.0.0.1]:15011. This is typically caused by a remote worker crashing."
    (where / "node-0.json").write_text(json.dumps({"node": 0, "offers": [
        {"rank": 0, "host": "n1", "error": peer, "time": 10.2}, {"rank": 1, "host": "n1", "error": peer}]}))
    assert raised_first(tmp_path, key, nodes, 2) == {}  # only bystanders: srun's culprits decide
    (where / "node-1.json").write_text(json.dumps({"node": 1, "offers": [
        {"rank": 2, "host": "n2", "error": "injected failure on rank 2 at step 5", "time": 10.1},
        {"rank": 3, "error": "ValueError: later, and of its own", "time": 10.3}]}))
    assert raised_first(tmp_path, key, nodes, 2) == {
        "n2": "rank 2 raised first there (injected failure on rank 2 at step 5)"}
    # the rehearsal's node names differ from the hosts the offers carry: the rank's place decides
    assert raised_first(tmp_path, key, ["node0", "node1"], 2) == {
        "node1": "rank 2 raised first there (injected failure on rank 2 at step 5)"}


def test_srun_lines_of_the_step_submitit_ran_are_read_back_from_the_shell_log(tmp_path) -> None:
    log = tmp_path / "1_0_log.err"
    log.write_text("srun: error: n1: task 0: Killed\nhpc_ddp.supervise: attempt 0 ...: failed; requeued\n"
                   "[rank 0] resuming\nsrun: error: n2: task 1: Killed\n")
    assert srun_lines_before(log) == ["srun: error: n2: task 1: Killed"]
    assert srun_lines_before(tmp_path / "missing") == []


def test_two_failures_at_the_same_point_are_not_healed_again() -> None:
    assert heal.failed_at_same_point(-1, 20) == "" and heal.failed_at_same_point(20, 30) == ""
    assert "twice in a row with the run at step 20" in heal.failed_at_same_point(20, 20)
    assert "before its first step" in heal.failed_at_same_point(None, None)


def test_stuck_ranks_name_their_nodes() -> None:
    assert heal.stuck_nodes([3], ["n1", "n2"], 2) == {"n2": "rank 3 was stuck (watchdog)"}
    assert heal.stuck_nodes([9], ["n1", "n2"], 2) == {}


def test_a_node_left_out_only_for_a_hang_is_not_blamed_as_a_node_a_spare_would_cure() -> None:
    """Two hangs in a row on n2 (at different steps) without a spare: the requeue's reason says a hang in the
    program repeats on any node; a node that died keeps the spare advice alone."""
    healer = heal.Healer(cap=3, counts=range(2, 3))
    stuck = heal.stuck_nodes([3], ["n1", "n2"], 2)
    assert healer.decide({"reason": "hung"}, 0, ["n1", "n2"], ["n1", "n2"], {}, dict(stuck), 10) is not None
    assert healer.decide({"reason": "hung"}, 1, ["n1", "n2"], ["n1", "n2"], {}, dict(stuck), 20) is None
    assert "slurm.spare_nodes=1" in healer.why_not and "a hang in the program repeats on any node" in healer.why_not
    dead = heal.Healer(cap=3, counts=range(2, 3))
    assert dead.decide({"reason": "failed"}, 0, ["n1", "n2"], ["n1", "n2"], {"n2": "Slurm says State=DOWN"}, {},
                       10) is None
    assert "slurm.spare_nodes=1" in dead.why_not and "hang" not in dead.why_not


def test_a_hard_suspect_is_never_trained_on_again_in_the_job_though_the_next_line_does_not_name_it() -> None:
    """A sick node left out (still held by the job) came back at the next heal of a CI run: n3 failed its health
    check on n[2-3], n1 replaced it, n2 then failed, and the healer chose n[1,3]. It now remembers every hard
    suspect of the job and shrinks or requeues rather than train on one again."""
    healer = heal.Healer(cap=3, counts=range(1, 3))
    held = ["n1", "n2", "n3"]
    sick = {"n3": "failed its health check (a matmul at 5 GFLOP/s)"}
    assert healer.decide({"reason": "slow"}, 0, held, ["n2", "n3"], dict(sick), {}, 1) is not None
    assert healer.next_nodes == ["n1", "n2"]
    assert healer.decide({"reason": "slow"}, 1, held, ["n1", "n2"], {"n2": "failed its health check"}, {}, 2)
    assert healer.next_nodes == ["n1"] and healer.healed is not None and healer.healed["how"] == "shrunk"
    assert healer.healed["excluded"]["n3"] == "failed its health check (a matmul at 5 GFLOP/s) (an earlier step)"


@pytest.mark.parametrize("held, training, hard, soft, counts, nodes, how", [
    # a spare takes the suspect's place: the same world size (bit-exact)
    (["n1", "n2", "n3"], ["n1", "n2"], {}, {"n2": "died"}, range(2, 3), ["n1", "n3"], "replaced"),
    # Slurm removed n2 from the job: the spare n3 replaces it
    (["n1", "n3"], ["n1", "n2"], {"n2": "gone"}, {}, range(2, 3), ["n1", "n3"], "replaced"),
    # no spare, a fixed size: the once-failed node is tried again
    (["n1", "n2"], ["n1", "n2"], {}, {"n2": "died"}, range(2, 3), ["n1", "n2"], "retried"),
    # no spare, a range: go on with fewer nodes rather than reuse a hard suspect
    (["n1", "n2"], ["n1", "n2"], {"n2": "down"}, {}, range(1, 3), ["n1"], "shrunk"),
    # the failure was elsewhere (no suspect): the same nodes again
    (["n1", "n2", "n3"], ["n1", "n2"], {}, {}, range(2, 3), ["n1", "n2"], "retried"),
    # the spare keeps the job's order (srun numbers nodes that way)
    (["n1", "n2", "n3"], ["n2", "n3"], {"n2": "down"}, {}, range(2, 3), ["n1", "n3"], "replaced"),
    # a node lost and another one suspect once, one spare: the spare joins, the suspect is kept
    (["n1", "n3"], ["n1", "n2"], {"n2": "gone"}, {"n1": "died"}, range(2, 3), ["n1", "n3"], "replaced"),
    # below the minimum: requeue
    (["n1", "n2"], ["n1", "n2"], {"n1": "down", "n2": "down"}, {}, range(1, 3), [], "requeue"),
    (["n1", "n2"], ["n1", "n2"], {"n2": "down"}, {}, range(2, 3), [], "requeue"),
])
def test_the_next_step_prefers_spares_then_retry_then_fewer_nodes(held, training, hard, soft, counts, nodes,
                                                                     how) -> None:
    plan = heal.plan(held, training, hard=hard, soft=soft, counts=counts)
    assert (plan.nodes, plan.how) == (nodes, how)
    assert plan.heals == bool(nodes)
    assert set(plan.excluded).isdisjoint(plan.nodes)
    assert set(hard) & (set(held) | set(training)) <= set(plan.excluded)


def test_failures_healed_in_the_job_do_not_count_against_max_failures() -> None:
    attempts = [{"job_id": 7, "restart_count": 0, "reason": "failed"},
                {"job_id": 7, "restart_count": 0, "in_job": 1, "reason": "failed"},
                {"job_id": 7, "restart_count": 0, "in_job": 2, "reason": "failed"}]
    assert healed_in_job(attempts) == {(7, 0, 0), (7, 0, 1)}
    assert cap_reached("failed", attempts, {"max_failures": 1}) is None
    assert "slurm.max_failures=0" in cap_reached("failed", attempts, {"max_failures": 0})


def test_settle_heals_a_failure_but_never_an_error(tmp_path) -> None:
    limits = {"max_timeouts": 1, "max_preemptions": 1, "max_failures": 0}
    requeued = []
    asked = []

    def heal_it(record):
        asked.append(record["reason"])
        return "replaced: restarting inside the job on n[1,3]"
    out = settle(tmp_path, job_id=5, restart_count=0, exit_code=137, limits=limits,
                 requeue_job=lambda: requeued.append(1), heal=heal_it, extra={"hosts": "n[1-2]"})
    assert out.startswith("failed; replaced") and not requeued and asked == ["failed"]
    line = (tmp_path / "attempts.jsonl").read_text()
    assert '"hosts": "n[1-2]"' in line and '"capped"' not in line
    out = settle(tmp_path, job_id=5, restart_count=0, exit_code=2, limits=limits, requeue_job=None,
                 in_job=1, heal=heal_it)
    assert out.startswith("error") and asked == ["failed"]
    # the healer declines: the requeue path as before
    out = settle(tmp_path, job_id=5, restart_count=0, exit_code=1, limits=limits,
                 requeue_job=lambda: requeued.append(1), in_job=2, heal=lambda record: None)
    assert out.startswith("failed; not requeued") and "failures and hangs once" in out and not requeued


def test_the_batch_shell_supervisor_imports_no_torch_and_dry_run_says_what_a_failure_costs() -> None:
    code = ("import sys, hpc_ddp.supervise; from hpc_ddp.core.config import load_config; "
            "from hpc_ddp.login.submit import healing_line; "
            "cfg = load_config(['examples/mlp.yaml'], ['slurm.spare_nodes=1', 'slurm.max_failures=2']); "
            "print(healing_line(cfg.slurm)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.splitlines()
    assert out == ["on a failure: 3 in-job restart(s) (slurm.max_restarts_in_job), 1 spare node(s) (the job holds "
                   "3); then 2 requeue(s) (slurm.max_failures)", "False"]


def test_spares_with_a_node_range_are_refused_with_the_choice_explained() -> None:
    from hpc_ddp.core.config import load_config
    from hpc_ddp.core.errors import HpcDdpError

    with pytest.raises(HpcDdpError, match="needs a fixed node count") as err:
        load_config(["examples/mlp.yaml"], ["slurm.nodes=1-2", "slurm.spare_nodes=1",
                                            "train.global_batch_size=128"])
    assert err.value.key == "slurm.spare_nodes"


LOCAL = ["examples/mlp.yaml", "--local", "slurm.tasks_per_node=1", "train.max_steps=40", "snapshot.every_steps=10",
         "train.log_every=5", "train.global_batch_size=64"]


def rehearse(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *LOCAL, f"run_dir={run_dir}", *args],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)


def test_the_rehearsal_loses_a_node_and_heals_on_a_spare_or_on_fewer_nodes(tmp_path: Path) -> None:
    """--fail-at kills one simulated node's ranks; the rehearsal chooses as the batch shell would."""
    from hpc_ddp.rundir.ledger import read_attempts
    from tests.helpers import done, losses

    clean = rehearse(tmp_path / "clean", "slurm.nodes=2")
    spare = rehearse(tmp_path / "spare", "slurm.nodes=2", "slurm.spare_nodes=1", "--fail-at", "23")
    shrunk = rehearse(tmp_path / "shrunk", "slurm.nodes=1-2", "--fail-at", "23:0")
    wrong = rehearse(tmp_path / "wrong", "slurm.nodes=2", "slurm.spare_nodes=1", "--fail-at", "23:2")
    assert wrong.returncode == 2 and "names training node 2, but the rehearsal trains on 2 node(s)" in wrong.stderr
    for proc in (clean, spare, shrunk):
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = read_attempts(tmp_path / "spare")
    assert (first["reason"], first["hosts"], second["in_job"], second["hosts"]) == ("failed", "node[0-1]", 1,
                                                                                    "node[0,2]")
    assert second["healed"]["how"] == "replaced" and "--fail-at" in second["healed"]["excluded"]["node1"]
    assert done(tmp_path / "spare")["params_sha256"] == done(tmp_path / "clean")["params_sha256"]
    assert "losing node1 (--fail-at 23): SIGKILL to its rank 1" in spare.stderr
    # a tidy run dir: the failed attempt keeps its seal and the offers its kept survivors' snapshot is checked by
    *earlier, last = sorted((tmp_path / "spare" / "jit").iterdir(), key=lambda p: len(p.name))
    assert earlier and all({f.name for f in e.iterdir()} <= {"commit", "node-0.json", "node-1.json"}
                           for e in earlier), [sorted(f.name for f in e.iterdir()) for e in earlier]
    assert last.name.endswith("-step-1") and (last / "stopped-mid-step").exists()
    first, second = read_attempts(tmp_path / "shrunk")
    assert (second["healed"]["how"], second["hosts"], second["world_size"], second["grad_accum"]) == (
        "shrunk", "node1", 1, 2)
    expected, got = losses(tmp_path / "clean"), losses(tmp_path / "shrunk")
    assert sorted(got) == sorted(expected)
    assert all(abs(got[s] - v) <= 1e-5 * abs(v) for s, v in expected.items())
