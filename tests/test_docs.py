"""Docs that are generated or quoted must match the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "dev" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert (ROOT / "docs" / "config.md").read_text() == module.render(), (
        "docs/config.md is stale; refresh it with: python dev/config_reference.py > docs/config.md")


def test_readme_commands_exist_and_ci_runs_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^bash (dev/\S+\.sh)", readme, flags=re.M)
    assert commands == ["dev/demo.sh", "dev/test.sh"]
    assert all((ROOT / c).is_file() for c in commands)
    assert "exec bash dev/test.sh" in (ROOT / ".ci" / "run").read_text()
