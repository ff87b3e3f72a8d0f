"""dev/gpu_check.sh where no GPU is: it runs from a fresh clone and says, per part, that the part needs a GPU, and
runs nothing (issue 58: on a lent GPU its first run must be its last; here it must not pretend)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PARTS = ["survivor", "pair", "tests", "b15", "nccl", "pipeline", "mingpt", "gpu"]


def _check(out: Path, python: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "dev" / "gpu_check.sh"), str(out), *args], cwd=out.parent,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": python}, capture_output=True, text=True,
                          timeout=120)


def test_without_a_gpu_every_part_says_it_needs_one_and_nothing_runs(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: dev/gpu_check.sh would run its parts (tests/gpu is the place)")
    proc = _check(tmp_path / "out", sys.executable)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert lines == [f"{part}: needs a GPU (no CUDA device): not run" for part in DEFAULT_PARTS]
    assert proc.stdout.splitlines() == lines and sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["log.txt", "summary.txt"]


def test_a_python_without_torch_is_named_and_chosen_parts_are_listed(tmp_path: Path) -> None:
    fake = tmp_path / "python-without-torch"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I -c 'import sys; sys.modules[\"torch\"] = None; "
                    "exec(sys.argv[1])' \"$2\"\n")  # `python -c CODE` with torch unimportable
    fake.chmod(0o755)
    proc = _check(tmp_path / "out", str(fake), "pair,mingpt")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{part}: needs a GPU ({fake} cannot import torch): not run"
                                        for part in ("pair", "mingpt")]
