"""The login-node path never imports torch (it costs seconds on a shared login node)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE_PLACES = ("core", "rundir", "login", "shell", "rehearsal")  # docs/layout.md: only rank code imports torch


def torch_free_modules() -> list[str]:
    """The entry points, and every module of the places that run without torch (found, not listed: a new
    module is checked the day it lands)."""
    import importlib
    import pkgutil

    found = ["hpc_ddp", "hpc_ddp.compat", "hpc_ddp.submit", "hpc_ddp.status", "hpc_ddp.supervise", "hpc_ddp.worker",
             "hpc_ddp.whoami", "hpc_ddp.slurm_local", "hpc_ddp.slurm_local.__main__", "hpc_ddp.rank.loop.task",
             "hpc_ddp.preemption", "hpc_ddp.config", "hpc_ddp.profiles"]
    for place in TORCH_FREE_PLACES:
        package = importlib.import_module(f"hpc_ddp.{place}")
        # and the modules of its folders (login/status/, login/preflight/, ...)
        found += [m.name for m in pkgutil.walk_packages(package.__path__, f"hpc_ddp.{place}.")]
    return found


LIGHT = torch_free_modules()


@pytest.mark.parametrize("module", LIGHT)
def test_import_does_not_pull_in_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_loading_a_config_and_deriving_ranks_does_not_import_torch(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train: {task: a.b:C, max_steps: 1}\n")
    code = ("import sys\nfrom hpc_ddp.core.config import load_config\nfrom hpc_ddp.whoami import main\n"
            f"load_config([{str(cfg)!r}])\nmain(['--simulate', '2x2'])\n"
            f"from hpc_ddp.submit import main as submit\nsubmit([{str(cfg)!r}, '--dry-run'])\n"
            f"submit([{str(cfg)!r}, '--dry-run', '--multirun', 'train.lr=1,2'])\n"
            "try:\n    submit(['--help'])\nexcept SystemExit:\n    pass\n"
            "from hpc_ddp.status import main as status\nstatus([str(__import__('pathlib').Path('.'))])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
