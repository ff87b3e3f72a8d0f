"""Healing inside the allocation on the real local cluster (three slurmd nodes): a killed rank, a node that
Slurm marks down, with a spare (bit-exact) and with a node range (fewer nodes, same global batch), and the
requeue path once in-job restarts are used up. One uninterrupted local rehearsal is the reference for all."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpc_ddp.core.hostlist import expand_hostlist
from hpc_ddp.rundir.ledger import attempt_key, attempt_tag, read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import FAKE_IMAGE, container_calls, fake_apptainer, finished, losses, wait_until

if TYPE_CHECKING:
    from tests.cluster.conftest import Rehearsal

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slurm
# 2 nodes x 2 tasks, or 1 x 2 with twice the accumulation: the same global batch either way
OPTIONS = ["examples/mlp.yaml", "train.task=tests.tasks:Faulty", "train.max_steps=40", "snapshot.every_steps=10",
           "train.log_every=5", "train.global_batch_size=128"]


def submit(run_dir: Path, fault: str, *options: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *OPTIONS, *options, f"run_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "HPC_DDP_TEST_FAULT": fault})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]


def scontrol(*args: str, check: bool = False) -> str:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    assert not check or proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc.stdout


def step_on(job: str, node: str) -> bool:
    """A step of the job (not its batch or extern step) runs on ``node``, as Slurm lists it."""
    listed = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %N"], capture_output=True,
                            text=True).stdout.split("\n")
    return any(len(line.split()) == 2 and line.split()[0].split(".")[-1].isdigit()
               and node in expand_hostlist(line.split()[1]) for line in listed)


def wait_done(run_dir: Path) -> None:
    status = lambda: subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run_dir)], capture_output=True,  # noqa: E731
                                    text=True).stdout
    assert wait_until(lambda: finished(run_dir), 240), status()


def lose_a_node(run_dir: Path, *options: str) -> tuple[list[dict], str]:
    """Submit a slowed run; once it has logged step 15, mark its second node down (as Slurm's own tests do);
    wait for the end, put the node back. Returns the ledger and the node."""
    job = submit(run_dir, "slow:-1:0.15", *options)
    metrics = run_dir / "metrics.jsonl"
    assert wait_until(lambda: metrics.exists() and max(losses(run_dir), default=0) >= 15, 120)
    node = expand_hostlist(subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True,
                                          text=True).stdout.strip())[1]
    scontrol("update", f"nodename={node}", "state=down", "reason=hpc_ddp-heal-test")
    try:
        wait_done(run_dir)
    finally:
        scontrol("update", f"nodename={node}", "state=resume")
    return read_attempts(run_dir), node


def _idle_nodes() -> int:
    """The cluster's nodes that Slurm lists idle."""
    out = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], capture_output=True, text=True).stdout
    return len(set(out.split()))


def wrapped_steps(record: Path, run_dir: Path, ranks: int, hosts: list[str]) -> list[list[tuple[str, str, str]]]:
    """The stand-in apptainer's calls (:func:`tests.helpers.fake_apptainer`): every one with the run dir and the
    submit directory mounted, the config's mounts and args, the image; one per rank of the first step and of
    the heal step, on their ``hosts``; and at least one probe, one task per probed node, also in the container.
    Returns the two steps' calls."""
    prefix = f"exec --bind {run_dir},{ROOT},/tmp:/scratch --writable-tmpfs {FAKE_IMAGE} "
    calls = container_calls(record)
    assert calls and all(args.startswith(prefix) for lines in calls.values() for *_, args in lines), calls
    probes = {step: lines for step, lines in calls.items() if all(args == prefix + "true" for *_, args in lines)}
    steps = [lines for step, lines in sorted(calls.items(), key=lambda item: int(item[0])) if step not in probes]
    assert [sorted(int(task) for _, task, _ in lines) for lines in steps] == [list(range(ranks))] * 2, calls
    assert [{node for node, *_ in lines} for lines in steps] == [set(expand_hostlist(h)) for h in hosts], calls
    assert probes and all(sorted(n for n, *_ in lines) == sorted(set(n for n, *_ in lines)) and
                          set(n for n, *_ in lines) <= set(expand_hostlist(hosts[1])) for lines in probes.values())
    return steps


def _squat_on_every_node(cluster: ClusterSpec, port: int) -> list[subprocess.Popen[bytes]]:
    """Another program holds ``port`` on every node of the cluster of machines (in each node's network
    namespace), until killed; none where the nodes share this machine's network (the caller holds it here)."""
    if "network" not in cluster.isolated:
        return []
    from hpc_ddp.slurm_local.isolation import machine_of

    hold = ("import socket, sys, time\ns = socket.socket()\ns.bind(('', int(sys.argv[1])))\ns.listen(8)\n"
            "print('held', flush=True)\ntime.sleep(3600)")
    held = []
    for name in cluster.node_names:
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{machine_of(cluster, name).netns}", sys.executable,
                                 "-c", hold, str(port)], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        held.append(proc)
    return held


def test_failures_heal_inside_the_job_on_a_spare_or_fewer_nodes(slurm_cluster: ClusterSpec, tmp_path: Path,
                                                                 rehearsal: Callable[..., Rehearsal]) -> None:
    """Cases (f), (a), (g) and (e) are submitted side by side (two 2-tasks-a-node jobs fill the 4-CPU nodes;
    Slurm starts the others as CPUs free up), and the reference rehearsal runs on this machine while they idle
    (the frozen node's liveness wait); then (d) (an 8 s watchdog) alone; (b) and (c) mark a node down, so they
    run last, each alone."""
    import socket

    reference = rehearsal(tmp_path / "reference", *OPTIONS)
    killed, hung, frozen, clash, requeued = (tmp_path / name for name in ("killed", "hung", "frozen", "clash",
                                                                           "requeued"))
    jobs = {frozen: submit(frozen, "stop:1:23", "slurm.spare_nodes=1")}  # the longest: it waits dist.liveness_s
    container, record = fake_apptainer(tmp_path, hook=True)  # and enroot's PyTorch hook's variables (issue 57)
    jobs[killed] = submit(killed, "kill:1:23", "slurm.spare_nodes=1", *container)
    with socket.socket() as squatter:  # (g)'s port is held by another program until its job is done
        squatter.bind(("", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        squatters = _squat_on_every_node(slurm_cluster, port)  # each node is a machine with its own ports
        jobs[clash] = submit(clash, "none:-1:-1", "slurm.spare_nodes=1", f"dist.master_port={port}")
        jobs[requeued] = submit(requeued, "kill:1:23", "slurm.max_restarts_in_job=0", "slurm.max_failures=1")
        try:
            reference.done()
            for run_dir in jobs:
                wait_done(run_dir)
        finally:
            for held in squatters:
                held.kill()
    # (d) alone: its watchdog's 8 s (16 s where every rank waits) would count the start-up of ranks slowed by
    # other jobs' start-ups as a hang; a heal's start-up took 5.5 s on a slow machine (a CI run, 2026-11-27)
    submit(hung, "sleep:1:23", "slurm.spare_nodes=1", "dist.timeout_s=8")
    wait_done(hung)
    expected = json.loads((tmp_path / "reference" / "DONE.json").read_text())["params_sha256"]
    expected_losses = losses(tmp_path / "reference")

    # (a) rank 1 is SIGKILLed at step 23; a spare takes its node's place: same job, no requeue, bit-exact. Every
    # rank runs in a container (a stand-in apptainer on the job's PATH only): submitit's step, the heal step, probes
    job = jobs[killed]
    attempts = read_attempts(killed)
    assert [(a["reason"], a["job_id"], a.get("in_job", 0)) for a in attempts] == [
        ("failed", int(job), 0), ("finished", int(job), 1)]
    healed = attempts[1]["healed"]
    assert attempts[0]["hosts"] == "n[2-3]"  # n1 runs the batch shell: with a spare it is the spare
    assert healed["how"] == "replaced" and list(healed["excluded"]) == ["n2"]  # ranks 0-1 were on n2
    assert attempts[1]["hosts"] == "n[1,3]"
    # the survivors wrote step 22, the last every rank finished (rank 1 died in step 23): no step was lost
    assert attempts[1]["resumed_from"] == attempts[0]["jit_snapshot"]["step"] == attempts[0]["last_step"] == 22
    assert "Restarts=0" in scontrol("show", "job", job)
    assert losses(killed) == expected_losses  # every step once, and the same numbers
    assert json.loads((killed / "DONE.json").read_text())["params_sha256"] == expected
    first, healed = wrapped_steps(record, killed, ranks=4, hosts=["n[2-3]", attempts[1]["hosts"]])
    assert all(" -u -m submitit.core._submit " in args for *_, args in first)  # submitit's python, wrapped
    assert all(f"{sys.executable} -m hpc_ddp.worker --config {killed}/config.yaml" in args for *_, args in healed)
    # the stand-in hook's RANK, WORLD_SIZE, MASTER_ADDR (the job's first node, n1: not in the first step) and fixed
    # MASTER_PORT gave way to Slurm's, and the ranks said so
    said = "\n".join(f.read_text(errors="replace") for f in (killed / "slurm").iterdir() if f.is_file())
    assert "MASTER_ADDR=n1 is a node of the job this step does not run on (the step's first node n2 is used)" in said
    assert "MASTER_PORT=29500 (set with them) gives way to the attempt's own port" in said

    # (b) Slurm marks a training node down mid-run: the job keeps its other nodes (--no-kill), the spare joins
    lost = tmp_path / "lost"
    attempts, node = lose_a_node(lost, "slurm.spare_nodes=1")
    assert [a["reason"] for a in attempts] == ["failed", "finished"]
    assert attempts[1]["healed"]["how"] == "replaced" and node in attempts[1]["healed"]["excluded"]
    assert node not in expand_hostlist(attempts[1]["hosts"]) and attempts[1]["world_size"] == 4
    assert json.loads((lost / "DONE.json").read_text())["params_sha256"] == expected

    # (c) no spare, slurm.nodes=1-2: the run goes on with the one node left, the same global batch. Slurm starts a
    # range on what is free: (b)'s node back from down, and the other tests' jobs gone, so that it starts on two
    # (ci47, ci48: it started on one, and its loss was retried, not shrunk). The 2-node start is read from
    # the step's shape, not node 1's beat, which n1's cached view could still call absent (a landing CI:
    # "started on n1" while squeue listed two nodes)
    assert wait_until(lambda: _idle_nodes() >= 2, 120), scontrol("show", "nodes")
    shrunk = tmp_path / "shrunk"
    attempts, node = lose_a_node(shrunk, "slurm.nodes=1-2")
    assert len(expand_hostlist(attempts[0]["hosts"])) == 2, f"the range job started on {attempts[0]['hosts']}"
    assert [(a["reason"], a["nodes"]) for a in attempts[1:]] == [("finished", 1)]
    assert attempts[1]["healed"]["how"] == "shrunk" and attempts[1]["grad_accum"] == 2
    got = losses(shrunk)
    assert sorted(got) == sorted(expected_losses)
    assert all(abs(got[s] - v) <= 1e-5 * abs(v) for s, v in expected_losses.items()), (got, expected_losses)

    # (d) rank 1 stops making progress at step 23: the watchdog names it, and its node is replaced by the spare
    attempts = read_attempts(hung)
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("hung", 0), ("finished", 1)]
    assert attempts[0]["stuck_ranks"] == [1] and attempts[1]["healed"]["how"] == "replaced"
    assert attempts[1]["resumed_from"] == attempts[0]["jit_snapshot"]["step"] == 22  # the waiting ranks wrote it
    assert "rank 1 was stuck (watchdog)" in attempts[1]["healed"]["excluded"]["n2"]  # ranks 0-1 are on n2
    assert json.loads((hung / "DONE.json").read_text())["params_sha256"] == expected

    # (f) rank 1 freezes at step 23 (SIGSTOP: no socket closes, srun sees nothing): its peer misses its beats for
    # dist.liveness_s (30 s by default) and ends the step; the frozen node is excluded, the spare joins. Without
    # liveness the step would wait out dist.timeout_s (600 s), past wait_done's limit.
    job = jobs[frozen]
    attempts = read_attempts(frozen)
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("failed", 0), ("finished", 1)], attempts
    assert attempts[0]["lost_ranks"] == [1] and attempts[0]["lost_hosts"] == ["n2"]  # ranks 0-1 are on n2
    # rank 0 found it, and wrote step 22 (rank 1 froze in step 23) from its liveness thread before it left
    assert attempts[1]["resumed_from"] == attempts[0]["jit_snapshot"]["step"] == 22, attempts
    assert "stopped beating" in attempts[1]["healed"]["excluded"]["n2"] and attempts[1]["hosts"] == "n[1,3]"
    assert "Restarts=0" in scontrol("show", "job", job)
    assert json.loads((frozen / "DONE.json").read_text())["params_sha256"] == expected

    # (g) another program holds the rendezvous port: a failure the next step retries on a port of its own (before:
    # exit 2, a configuration error, never healed or requeued)
    attempts = read_attempts(clash)
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("failed", 0), ("finished", 1)], attempts
    assert f"rendezvous port {port}" in (clash / "errors" / f"job-{attempts[0]['job_id']}-restart-0.txt").read_text()

    # (e) in-job restarts used up (0 allowed): the requeue path under slurm.max_failures, as before healing
    job = jobs[requeued]
    attempts = read_attempts(requeued)
    assert [(a["reason"], a["restart_count"], a["job_id"]) for a in attempts] == [
        ("failed", 0, int(job)), ("finished", 1, int(job))]
    assert attempts[0]["last_step"] == attempts[1]["resumed_from"] == 22 and attempts[0]["exit_code"] != 0  # jit
    assert json.loads((requeued / "DONE.json").read_text())["params_sha256"] == expected
    log = (requeued / "slurm" / f"{job}_0_log.err").read_text(errors="replace")
    assert "not healed in the job: slurm.max_restarts_in_job=0 in-job restarts used" in log


PER_RANK = ["examples/own_loop_gpt.yaml", "train.loop=tests.tasks.loops:nanogpt_shaped", "train.max_steps=30",
            "train.log_every=1", "snapshot.every_steps=null", "snapshot.every_minutes=null"]


def test_a_lost_ranks_per_rank_state_comes_from_its_buddy_killed_or_frozen(
        slurm_cluster: ClusterSpec, node_faults: ClusterSpec, tmp_path: Path,
        rehearsal: Callable[..., Rehearsal]) -> None:
    """Issue 35 on the real cluster: an own loop with dropout and per_rank objects, no periodic snapshot. Rank 1
    (node 1 of 2, whose buddy is rank 3 on the other node) is SIGKILLed in step 23: the survivors' snapshot holds
    step 22 with rank 1's own state from rank 3, and the run ends bit-identical to the local rehearsal, every
    rank's own state included. Then a frozen node at 2 x 2: node 1's freezer cgroup frozen, slurmd with it
    (:func:`_frozen_node_healed`)."""
    # one after the other (a frozen node freezes every job on it), the rehearsal on this machine meanwhile
    killed, frozen = tmp_path / "kill", tmp_path / "frozen"
    _per_rank_submit(killed, "kill:1:23", "slurm.spare_nodes=1")
    reference = rehearsal(tmp_path / "reference", *PER_RANK)
    wait_done(killed)
    _per_rank_submit(frozen, "freezenode:1:23", "slurm.spare_nodes=1")
    reference = reference.done()
    attempts = read_attempts(killed)
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("failed", 0), ("finished", 1)], attempts
    assert attempts[1]["resumed_from"] == attempts[0]["jit_snapshot"]["step"] == 22, attempts
    manifest = json.loads((killed / "snapshots" / "step-00000022" / "manifest.json").read_text())
    assert manifest["jit"]["per_rank_from"]["1"] == 3, manifest["jit"]  # rank 1's buddy
    assert losses(killed) == losses(reference)
    assert json.loads((killed / "DONE.json").read_text()) == json.loads((reference / "DONE.json").read_text())
    wait_done(frozen)
    _frozen_node_healed(frozen, reference, per_node=2, node=1)


def test_a_frozen_node_heals_from_its_buddies_at_3_tasks_per_node(
        slurm_cluster: ClusterSpec, node_faults: ClusterSpec, tmp_path: Path,
        rehearsal: Callable[..., Rehearsal]) -> None:
    """Issue 55 at 2 x 3: node 1's freezer cgroup frozen (ranks 3-5 and that node's slurmd) at the default
    dist.liveness_s. Node 0's ranks declare it, hold step 22 and their wards' states, and the spare takes its
    place (:func:`_frozen_node_healed`)."""
    geometry = "slurm.tasks_per_node=3"
    _per_rank_submit(tmp_path / "frozen", "freezenode:1:23", geometry, "slurm.spare_nodes=1")
    reference = rehearsal(tmp_path / "reference", *PER_RANK, geometry).done()
    wait_done(tmp_path / "frozen")
    _frozen_node_healed(tmp_path / "frozen", reference, per_node=3, node=1)


def _offers(run_dir: Path, tag: str, nodes: int = 2) -> list[dict]:
    """Every offer of the attempt's survivors' snapshot, from its nodes' files (as the survivors read them: a
    node file a frozen node's rank had only begun is empty)."""
    from hpc_ddp.rundir import jit_offers

    return jit_offers.offers(run_dir / "jit" / tag, nodes)


def _frozen_node_healed(run_dir: Path, reference: Path, per_node: int, node: int) -> None:
    """Every rank of one node frozen by its freezer cgroup at the start of step 23, once each had sent its
    state of step 22 to its buddy (a node hung in its kernel: no socket closes, srun and Slurm see nothing, and
    no SIGCONT wakes it), the default dist.liveness_s, per_rank state, no periodic snapshot, a spare. A rank of
    the other node finds the node's beat silent and declares every rank on it; every survivor writes what it
    holds and exits. The run resumes from step 22 (the last logged step), every frozen rank's own state from its
    buddy, and ends bit-identical to the rehearsal; no frozen rank wrote anything (it never ran again)."""
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("failed", 0), ("finished", 1)], attempts
    frozen = list(range(node * per_node, (node + 1) * per_node))
    assert attempts[0]["lost_ranks"] == frozen, attempts[0]  # the node before it declares the node, every rank on it
    assert attempts[1]["resumed_from"] == attempts[0]["jit_snapshot"]["step"] == 22, attempts
    manifest = json.loads((run_dir / "snapshots" / "step-00000022" / "manifest.json").read_text())
    world = 2 * per_node
    assert sorted(int(r) for r in manifest["jit"]["per_rank_from"]) == list(range(world)), manifest["jit"]
    # a frozen rank's own state from its buddy on the other node, a survivor's from itself
    buddy = {r: (r + per_node) % world for r in range(world)}
    assert {int(r): h for r, h in manifest["jit"]["per_rank_from"].items()} == {
        r: buddy[r] if r in frozen else r for r in range(world)}, manifest["jit"]
    survivors = [r for r in range(world) if r not in frozen]
    assert manifest["jit"]["sources"] == survivors and manifest["jit"]["writer"] in survivors, manifest["jit"]
    offers = _offers(run_dir, _tag(attempts[0]))
    assert sorted(o["rank"] for o in offers) == survivors, offers  # no frozen rank offered or wrote anything
    # srun would wait for the frozen node until slurmctld marks it down (SlurmdTimeout): the watcher beside
    # submitit's srun ended it once every survivor's task had ended (hpc_ddp.shell.lost_wait)
    shell_log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*_0_log.err"))
    assert "hpc_ddp.supervise --watch: srun still waits for " in shell_log, shell_log[-3000:]
    assert "Node failure on" not in shell_log.split("hpc_ddp.supervise --watch:")[0], shell_log[-3000:]
    assert losses(run_dir) == losses(reference)
    assert json.loads((run_dir / "DONE.json").read_text()) == json.loads((reference / "DONE.json").read_text())


def _tag(attempt: dict) -> str:
    """The attempt's folder name under jit/."""
    return attempt_tag(*attempt_key(attempt))


def test_a_partitioned_node_heals_bit_exact_and_is_fenced(
        slurm_cluster: ClusterSpec, node_faults: ClusterSpec, tmp_path: Path,
        rehearsal: Callable[..., Rehearsal]) -> None:
    """Issue 55: 2 x 2 with a spare, per_rank state, no periodic snapshot; node 1 cuts its own link once its ranks
    reached step 23 (no FIN, no RST; it still sees its view of the run dir, and beats into it). Issue 60: node 0's
    watcher gets no answer over the training network for 3 s and declares node 1's ranks lost, saying how it was
    noticed (its beats in the run dir still came); node 1's watcher finds its own link down and declares no other node.
    Node 1's ranks, declared, offer nothing (fenced): the survivors commit step 22, each its own and its ward's
    state, and the batch shell seals the commit when the step ends. The spare replaces the cut-off node (its probe
    finds no answer) and the run ends bit-identical to the rehearsal."""
    run_dir = tmp_path / "cut"
    # dist.timeout_s=20: the hang watchdog as a backstop (it ended this test's attempt before the net beat), well
    # before slurmctld finds the cut-off node not responding (SlurmdTimeout, 60 s here, 300 s by default), which
    # would SIGKILL the survivors' tasks too; liveness (and the node's watcher with it) stays on at half of it
    _per_rank_submit(run_dir, "partitionnode:1:23", "slurm.spare_nodes=1", "dist.timeout_s=20", "dist.liveness_s=6")
    reference = rehearsal(tmp_path / "reference", *PER_RANK).done()
    wait_done(run_dir)
    attempts = read_attempts(run_dir)
    assert [a.get("in_job", 0) for a in attempts] == [0, 1] and attempts[1]["reason"] == "finished", attempts
    assert attempts[0]["reason"] == "failed" and attempts[0]["lost_ranks"] == [2, 3], attempts[0]
    cut = expand_hostlist(attempts[0]["hosts"])[1]
    # declared by the net beat. What the message adds of the run dir's beats ("while its beats ... still came" or
    # "nor a new beat") is what node 0's cached view of the run dir showed: a CI run, where the store's hand-over
    # had the pings start before node 0 had read a fresh beat of node 1, said "nor a new beat" of the cut node
    assert attempts[0]["message"].startswith(
        f"ranks 2, 3 on {cut} lost (no answer over the training network for 3s"), attempts[0]["message"]
    assert "seen by node 0's watcher" in attempts[0]["message"], attempts[0]["message"]
    assert attempts[1]["resumed_from"] == 22, attempts
    assert cut not in expand_hostlist(attempts[1]["hosts"]), attempts  # the cut-off node left out
    tag = _tag(attempts[0])
    offers = _offers(run_dir, tag)
    assert sorted(o["rank"] for o in offers) == [0, 1], offers  # the declared ranks offered nothing
    commits = [o for o in offers if str(o.get("outcome", "")).startswith("committed")]
    assert len(commits) == 1, offers  # one commit in the attempt
    assert (run_dir / "jit" / tag / "commit").read_text().strip() == "step 22"
    logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*_log.*"))
    assert "this node's link (eth0) is down: it is the one cut off, and declares nobody else" in logs, logs[-3000:]
    assert losses(run_dir) == losses(reference)
    assert json.loads((run_dir / "DONE.json").read_text()) == json.loads((reference / "DONE.json").read_text())


def _per_rank_submit(run_dir: Path, fault: str, *options: str) -> None:
    """The PER_RANK own loop submitted to the cluster with ``fault`` (the ``rehearsal`` fixture runs it locally)."""
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *PER_RANK, *options, f"run_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "HPC_DDP_TEST_FAULT": fault})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_both_templates_heal_a_killed_rank_on_a_spare_with_plain_sbatch(
        slurm_cluster: ClusterSpec, tmp_path: Path, rehearsal: Callable[..., Rehearsal]) -> None:
    """The emitted scripts (srun per task, torchrun per node), `sbatch`ed as a user would: rank 1 SIGKILLed at
    step 23, a spare node takes its node's place inside the job, and both end as the uninterrupted run. Both run
    every rank in a container (a stand-in apptainer): the first step, the heal step and the probes."""
    import os

    options = [*OPTIONS[1:], "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.spare_nodes=1"]
    runs = {}
    for launcher in ("srun", "torchrun"):
        run_dir, script = tmp_path / launcher, tmp_path / f"{launcher}.sbatch"
        container, _ = fake_apptainer(tmp_path / f"{launcher}-container")
        emitted = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", OPTIONS[0], "--emit-sbatch", str(script),
                                  "--launcher", launcher, *options, *container, f"run_dir={run_dir}"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
        assert emitted.returncode == 0, emitted.stderr
        text = script.read_text()
        assert "#SBATCH --nodes=3" in text and "#SBATCH --no-kill" in text and "hpc_ddp.supervise" in text
        job = subprocess.run(["sbatch", "--parsable", str(script)], cwd=ROOT, check=True, capture_output=True,
                             text=True, env={**os.environ, "HPC_DDP_TEST_FAULT": "kill:1:23"}).stdout.strip()
        runs[launcher] = (run_dir, job)  # both side by side (a CPU a node each)
    rehearsal(tmp_path / "reference", OPTIONS[0], *options).done()
    for run_dir, _ in runs.values():
        wait_done(run_dir)
    expected = json.loads((tmp_path / "reference" / "DONE.json").read_text())["params_sha256"]
    for launcher, (run_dir, job) in runs.items():
        attempts = read_attempts(run_dir)
        log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*.out"))
        assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("failed", 0), ("finished", 1)], (
            launcher, attempts, log[-3000:])
        # srun names the node whose task died first (under torchrun: whose torchrun exited first)
        assert attempts[0]["hosts"] == "n[2-3]", (launcher, attempts)  # the batch host n1 is the spare
        assert attempts[1]["healed"]["how"] == "replaced" and attempts[1]["hosts"] in ("n[1,3]", "n[1-2]"), (
            launcher, attempts)
        assert "Restarts=0" in scontrol("show", "job", job)
        assert json.loads((run_dir / "DONE.json").read_text())["params_sha256"] == expected, launcher
        record = tmp_path / f"{launcher}-container" / "container-calls.txt"
        program = "bash -c" if launcher == "torchrun" else f"{sys.executable} -m hpc_ddp.worker --config"
        steps = wrapped_steps(record, run_dir, ranks=2, hosts=[attempts[0]["hosts"], attempts[1]["hosts"]])
        assert all(f"{FAKE_IMAGE} {program}" in args for lines in steps for *_, args in lines), (launcher, steps)


def test_two_nodes_lost_in_a_row_heal_twice_and_the_batch_host_trains_last(
        slurm_cluster: ClusterSpec, tmp_path: Path, rehearsal: Callable[..., Rehearsal]) -> None:
    """A 1-node job with two spares (the whole cluster): n1 runs the batch shell, so n2 trains; n2 is marked
    down, n3 takes over; n3 is marked down before the run logs another step (the same point: before, the
    second loss was "failed twice in a row" and, with max_failures=0, the end of the run). It heals twice in
    the same job, the batch host trains last, and the run ends bit-identical to an uninterrupted one.

    n3 goes down once its step is listed and a second has passed: a kill Slurm sends between the step's creation
    and its tasks' launch on the node misses them (a CI run's step on n3 then trained to the end). 80 steps:
    the step on n3 is still training when it goes down, under any load."""
    options = ["slurm.nodes=1", "slurm.spare_nodes=2", "slurm.max_failures=0", "train.max_steps=80"]
    reference = rehearsal(tmp_path / "reference", *OPTIONS, "slurm.nodes=1", "train.max_steps=80")
    run_dir = tmp_path / "twice"
    job = submit(run_dir, "slow:-1:0.15", *options)
    metrics = run_dir / "metrics.jsonl"
    assert wait_until(lambda: metrics.exists() and max(losses(run_dir), default=0) >= 15, 120)
    downed = []
    try:
        for node in ("n2", "n3"):  # the first training node, then the spare that replaced it
            if node == "n3":  # the batch shell starts the next step: take its node before it logs a step
                step = run_dir / "step.json"
                started = lambda: step.exists() and json.loads(step.read_text()).get("in_job") == 1  # noqa: E731
                assert wait_until(lambda: started() and step_on(job, "n3"), 120), read_attempts(run_dir)
                time.sleep(1.0)
            scontrol("update", f"nodename={node}", "state=down", "reason=hpc_ddp-heal-test", check=True)
            downed.append(node)
        wait_done(run_dir)
    finally:
        for node in downed:
            scontrol("update", f"nodename={node}", "state=resume")
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a.get("in_job", 0), a["hosts"]) for a in attempts] == [
        ("failed", 0, "n2"), ("failed", 1, "n3"), ("finished", 2, "n1")], attempts
    assert [a["healed"]["how"] for a in attempts[1:]] == ["replaced", "replaced"]
    assert "Restarts=0" in scontrol("show", "job", job)
    expected = json.loads((reference.done() / "DONE.json").read_text())
    assert json.loads((run_dir / "DONE.json").read_text())["params_sha256"] == expected["params_sha256"]


def test_the_torchrun_template_excludes_the_node_of_the_stuck_rank(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    """One torchrun per node with two ranks each (srun's tasks per node is 1): rank 2 stops making progress on
    the second training node. Before, the batch shell mapped rank 2 with srun's 1 task per node to a third node
    that does not exist, blamed nobody and retried on the same nodes; now that node is left out."""
    import os

    run_dir, script = tmp_path / "torchrun-hang", tmp_path / "hang.sbatch"
    options = [*OPTIONS[1:], "slurm.nodes=2", "slurm.tasks_per_node=2", "slurm.spare_nodes=1", "dist.timeout_s=10"]
    emitted = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", OPTIONS[0], "--emit-sbatch", str(script),
                              "--launcher", "torchrun", *options, f"run_dir={run_dir}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert emitted.returncode == 0, emitted.stderr
    subprocess.run(["sbatch", "--parsable", str(script)], cwd=ROOT, check=True, capture_output=True, text=True,
                   env={**os.environ, "HPC_DDP_TEST_FAULT": "sleep:2:23"})
    wait_done(run_dir)
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("hung", 0), ("finished", 1)], attempts
    first = expand_hostlist(attempts[0]["hosts"])
    assert attempts[0]["stuck_ranks"] == [2] and len(first) == 2, attempts  # ranks 2-3 ran on the second node
    assert list(attempts[1]["healed"]["excluded"]) == [first[1]], attempts
    assert "rank 2 was stuck (watchdog)" in attempts[1]["healed"]["excluded"][first[1]]
