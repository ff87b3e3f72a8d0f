"""The batch shell stops waiting for srun once only nodes the survivors declared lost are left
(:mod:`hpc_ddp.shell.lost_wait`): the tables, the grace, and both places that end a real srun (the
batch shell's own steps, and the watcher beside submitit's first step)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpc_ddp.rundir import layout, lost
from hpc_ddp.rundir.ledger import attempt_tag
from hpc_ddp.shell import lost_wait
from hpc_ddp.shell.steps import run_srun

FROZEN_N3 = ["srun: error: n2: task 1: Exited with exit code 1",
             "srun: launch/slurm: _step_signal: Terminating StepId=1.0",
             "srun: error: n2: tasks 0,2: Exited with exit code 6"]


def test_srun_lines_say_which_tasks_of_which_node_ended() -> None:
    assert lost_wait.task_ids("0-2,5") == {0, 1, 2, 5} and lost_wait.task_ids("7") == {7}
    assert lost_wait.ended_tasks([*FROZEN_N3, "srun: error: Node failure on n3",
                                  "srun: error: n4: tasks 6-7: Killed"]) == {"n2": {0, 1, 2}, "n4": {6, 7}}


@pytest.mark.parametrize(("ended", "lost", "left"), [
    ({"n2": {0, 1, 2}}, {"n3": "frozen"}, ["n3"]),  # the survivors are done; only the declared node is left
    ({"n2": {0, 1}}, {"n3": "frozen"}, []),  # a survivor still runs (writing what it holds)
    ({"n2": {0, 1, 2}}, {}, []),  # nobody declared n3: srun waits as it always did
    ({"n2": {0, 1, 2}, "n3": {3, 4, 5}}, {"n3": "frozen"}, []),  # every task ended: srun ends by itself
    ({}, {"n2": "x", "n3": "y"}, ["n2", "n3"]),  # every node declared (each by the other)
])
def test_only_nodes_declared_lost_may_be_left(ended: dict, lost: dict, left: list) -> None:
    assert lost_wait.left_on_lost(["n2", "n3"], 3, ended, lost) == left


def test_the_wait_ends_only_after_the_grace_and_never_once_srun_ended() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s
    lines: list[str] = []
    reads = []

    def lost() -> dict[str, str]:
        reads.append(now[0])
        return {"n3": "ranks 3, 4, 5 stopped beating"}

    def running() -> bool:
        if now[0] >= 2:
            lines[:] = FROZEN_N3
        return now[0] < 30
    found = lost_wait.watch(lambda: list(lines), lost, lambda: ["n2", "n3"], 3, running, clock=lambda: now[0],
                            sleep=sleep)
    assert found == (["n3"], {"n3": "ranks 3, 4, 5 stopped beating"})
    assert reads[0] == 2 and now[0] - 2 >= lost_wait.GRACE_S  # no read before a task ended; the grace kept
    now[0], lines[:] = 0.0, []
    assert lost_wait.watch(lambda: FROZEN_N3[:1], lost, lambda: ["n2", "n3"], 3, lambda: now[0] < 10,
                           clock=lambda: now[0], sleep=sleep) is None  # task 0 and 2 of n2 never ended


def _declare(run_dir: Path, key: tuple[int, int, int], ranks: list[int], host: str) -> None:
    """A survivor's declaration of a whole node, as :mod:`hpc_ddp.rank.watch.declaration` writes it."""
    path = layout.declared(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lost.padded({"rank": ranks[0], "ranks": ranks, "host": host, "by_rank": 0,
                                  "attempt": attempt_tag(*key)}))


def _fake_srun(folder: Path, ended_after: float | None) -> Path:
    """An executable named srun that says the survivors on n2 ended, then waits for n3 as srun does for a
    frozen node (forever, or ``ended_after`` seconds and exit 1)."""
    srun = folder / "srun"
    # it waits without a child process (a sleep would hold srun's stderr open, and take the name srun)
    wait = f'[ -p "$0.fifo" ] || mkfifo "$0.fifo"; read -t {ended_after or 600} <> "$0.fifo"; exit 1'
    srun.write_text("#!/bin/bash\n" + "".join(f"echo '{line}' >&2\n" for line in FROZEN_N3) + wait + "\n")
    srun.chmod(0o755)
    return srun


def test_the_batch_shells_own_step_is_ended_with_137_once_its_survivors_are_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(lost_wait, "GRACE_S", 0.5)
    _declare(tmp_path, (7, 0, 1), [3, 4, 5], "n3")
    until = lost_wait.until_lost(tmp_path, (7, 0, 1), ["n2", "n3"], 3, 3)
    start = time.monotonic()
    code, lines = run_srun([str(_fake_srun(tmp_path, None))], {"PATH": "/usr/bin:/bin"}, until=until)
    assert code == 137 and lines == FROZEN_N3 and time.monotonic() - start < 60
    assert "srun still waits for n3 (n3: ranks 3, 4, 5 stopped beating" in capfd.readouterr().err
    # another attempt's declaration is not this step's: srun ends by itself
    until = lost_wait.until_lost(tmp_path, (7, 0, 2), ["n2", "n3"], 3, 3)
    assert run_srun([str(_fake_srun(tmp_path, 1.5))], {"PATH": "/usr/bin:/bin"}, until=until)[0] == 1


def test_the_watcher_beside_submitits_srun_ends_it_and_the_shell_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch shell whose stderr is a file runs an srun that never ends; the watcher, started before it, finds
    it as the shell's child, reads its lines from that file and kills it: the shell's next line runs with
    $? = 137 (submitit's script goes on to the supervise line)."""
    monkeypatch.setattr(lost_wait, "GRACE_S", 0.5)
    _declare(tmp_path, (7, 0, 0), [3, 4, 5], "n3")
    err, code = tmp_path / "7_0_log.err", tmp_path / "code"
    err.write_text("an earlier attempt's line\nsrun: error: n3: tasks 3-5: Killed\n")
    shell = subprocess.Popen(["bash", "-c", f"exec 2>>{err}; sleep 1; {_fake_srun(tmp_path, None)}; "
                                            f"echo $? > {code}"])
    said: list[str] = []
    ended = lost_wait.watch_first_step(tmp_path, (7, 0, 0), 3, 3, lambda: ["n2", "n3"], said.append,
                                       shell_pid=shell.pid, stderr=err, appear_s=30)
    assert shell.wait(timeout=30) == 0 and ended
    assert code.read_text().strip() == "137" and "srun still waits for n3" in said[0]


def test_the_watcher_leaves_an_srun_that_ends_by_itself_and_one_it_cannot_read(tmp_path: Path) -> None:
    err = tmp_path / "err"
    err.touch()
    shell = subprocess.Popen(["bash", "-c", f"exec 2>>{err}; sleep 1; {_fake_srun(tmp_path, 1)}; exit $?"])
    assert not lost_wait.watch_first_step(tmp_path, (7, 0, 0), 3, 3, lambda: ["n2", "n3"], print,
                                          shell_pid=shell.pid, stderr=err, appear_s=30)
    assert shell.wait(timeout=30) == 1  # nobody declared n3: srun ended as srun does
    piped = subprocess.Popen(["bash", "-c", "sleep 5"], stderr=subprocess.PIPE)
    done = threading.Event()
    threading.Thread(target=lambda: (lost_wait.watch_first_step(tmp_path, (7, 0, 0), 3, 3, list, print,
                                                                 shell_pid=piped.pid, stderr=Path(sys.executable
                                                                                                 + ".nope")),
                                     done.set())).start()
    assert done.wait(10)  # no file to read srun's lines from: nothing to watch, it returns at once
    piped.kill()


def test_a_node_slurm_finds_not_answering_counts_as_lost_and_a_drained_one_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut-off node may still reach the run dir and beat there: nobody declares it, but slurmctld flags it
    NOT_RESPONDING after a missed ping, long before it marks it down; a drained node still runs its tasks."""
    show = ("NodeName=n2 Arch=x86_64 State=MIXED Partitions=debug\n"
            "NodeName=n3 Arch=x86_64 State=MIXED+NOT_RESPONDING Partitions=debug\n"
            "NodeName=n4 Arch=x86_64 State=MIXED+DRAIN Partitions=debug\n"
            "NodeName=n5 Arch=x86_64 State=DOWN* Partitions=debug\n")
    assert lost_wait.not_answering(show) == {"n3": "Slurm says State=MIXED+NOT_RESPONDING",
                                             "n5": "Slurm says State=DOWN*"}
    monkeypatch.setattr(lost_wait, "GRACE_S", 0.5)
    asked: list[list[str]] = []

    def slurm_says(nodes: list[str]) -> dict[str, str]:
        asked.append(list(nodes))
        return lost_wait.not_answering(show)
    until = lost_wait.until_lost(tmp_path, (7, 0, 0), ["n2", "n3"], 3, 3, slurm_says)  # nobody declared n3
    code, _ = run_srun([str(_fake_srun(tmp_path, None))], {"PATH": "/usr/bin:/bin"}, until=until)
    assert code == 137 and asked[0] == ["n2", "n3"]
