"""The rehearsal's warm start (hpc_ddp.rehearsal.local_warm, hpc_ddp.rank.warm): a rank forked from a process
that imported torch once is, to the launcher and to itself, the fresh interpreter it replaces; a rank that
could differ at import, or a warm process that is gone, gets a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rehearsal import local_warm
from tests.helpers import ROOT, alive_with, wait_until

CHILD = [sys.executable, "-m", "tests.tasks.warm_child"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "WARM_MARK": "common", **extra}


def _finish(proc: subprocess.Popen[bytes] | local_warm.Started, limit_s: float = 120) -> int:
    assert wait_until(lambda: proc.poll() is not None, limit_s), "the rank did not end"
    code = proc.poll()
    assert code is not None
    return code


def test_a_warm_rank_is_the_fresh_interpreter_it_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    config = tmp_path / "run" / "config.yaml"
    with local_warm.warm_starts(config, environ={}):
        log = tmp_path / "rank-1.log"
        with open(log, "ab") as out:
            one = local_warm.start([*CHILD, "3"], _env(SLURM_PROCID="1"), out)
        zero = local_warm.start([*CHILD, "0"], _env(SLURM_PROCID="0"), subprocess.PIPE)
        assert isinstance(one, local_warm.Started) and isinstance(zero, local_warm.Started)
        assert (_finish(one), _finish(zero)) == (3, 0)  # its exit code, from the process that reaped it
        assert zero.stdout is not None
        said = [json.loads(zero.stdout.read()), json.loads(log.read_text())]
        zero.stdout.close()
        # its own session (signals and SIGSTOP by process group, as before), its environment, its argv, a
        # __main__ of its module, the working directory, the warm process's imports (frozen there); NumPy's and torch's
        # unseeded draws their own (a module-level torch.randn was the same on every forked rank, not on the cluster's)
        assert [(s["sid"] == s["pid"], s["per_rank"], s["mark"], s["argv"], s["main"], s["spec"], s["frozen"])
                for s in said] == [(True, "0", "common", ["0"], "__main__", "tests.tasks.warm_child", True),
                                   (True, "1", "common", ["3"], "__main__", "tests.tasks.warm_child", True)]
        assert said[0]["cwd"] == str(ROOT) and said[0]["numpy_draw"] != said[1]["numpy_draw"]
        assert said[0]["torch_draw"] != said[1]["torch_draw"]
        # a variable read at import that differs: a fresh interpreter (nothing frozen: not a fork of the warm one)
        cold = local_warm.start([*CHILD, "0"], _env(WARM_MARK="other"), subprocess.PIPE)
        assert isinstance(cold, subprocess.Popen) and _finish(cold) == 0
        assert json.loads(cold.stdout.read())["frozen"] is False  # type: ignore[union-attr]
        cold.stdout.close()  # type: ignore[union-attr]
        # ps shows the run's config in every rank's command line (tests.helpers.alive_with finds them)
        waiting = local_warm.start([*CHILD, "wait"], _env(), subprocess.DEVNULL)
        assert wait_until(lambda: waiting.pid in alive_with(str(config)), 30)
        os.killpg(waiting.pid, signal.SIGKILL)
        assert _finish(waiting) == -signal.SIGKILL
    assert wait_until(lambda: alive_with(str(config)) == [], 10)  # the warm process ended with the rehearsal


def test_a_gone_warm_process_takes_its_ranks_and_the_next_rank_starts_cold(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    with local_warm.warm_starts(tmp_path / "config.yaml", environ={}):
        waiting = local_warm.start([*CHILD, "wait"], _env(), subprocess.DEVNULL)
        assert isinstance(waiting, local_warm.Started)
        [slot] = local_warm._SLOTS
        assert slot.warm is not None
        slot.warm.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG), and read as SIGKILLed
        assert _finish(waiting, 30) == -signal.SIGKILL
        after = local_warm.start([*CHILD, "0"], _env(), subprocess.DEVNULL)
        assert isinstance(after, subprocess.Popen) and _finish(after) == 0


def test_every_rank_of_every_node_of_a_rehearsal_fits_the_warm_process_its_first_rank_started() -> None:
    """The variables the launcher sets per rank and per node (SLURMD_NODENAME: node 1's ranks started cold, and
    a 2 x 2 rehearsal forked only half its ranks) are not compared; every other one is."""
    from hpc_ddp.rehearsal.local import rank_environs

    environs = rank_environs(2, 2, job_id=7, restart_count=1, port=29500, base={"PYTHONPATH": "x"})
    common = local_warm._common(environs[0])
    assert all(local_warm._common(e) == common for e in environs) and common["PYTHONPATH"] == "x"
    assert local_warm._common({**environs[3], "PYTHONPATH": "y"}) != common


def test_cold_starts_when_asked() -> None:
    with local_warm.warm_starts(Path("config.yaml"), environ={local_warm.COLD_VAR: "1"}):
        proc = local_warm.start([*CHILD, "0"], _env(), subprocess.DEVNULL)
        assert isinstance(proc, subprocess.Popen) and _finish(proc) == 0
