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


def test_every_code_fence_line_is_a_bare_fence_or_names_a_language() -> None:
    """A fence with text after it (```` ``` The flight recorder...````) opens a block instead of closing one, and
    the rest of the page renders as code; mkdocs --strict does not see it (issue 36, docs/faults.md)."""
    root = Path(__file__).resolve().parent.parent
    bad = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("```") and not re.fullmatch(r"```[A-Za-z0-9_+-]*", stripped):
                bad.append(f"{page.relative_to(root)}:{number}: {stripped[:60]}")
    assert not bad, "fence lines with text after them:\n" + "\n".join(bad)
