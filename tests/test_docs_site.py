"""The documentation site: it builds strictly, every page is in the navigation, and what it tells a
reader to run (the quickstart's commands, the Python snippets) works."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.core.config import schema_rows

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP = "<!-- doc-test: skip"


def _dev(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def nav_pages() -> list[str]:
    return re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)


def test_every_page_is_in_the_navigation_and_every_entry_exists() -> None:
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav_pages()) == pages


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("mkdocs and mkdocs-material are in the dev extra: pip install -e '.[dev]'")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "quickstart" / "index.html").exists()


CODE_WIDTH = 90  # characters of code the theme shows at 1280 px beside both sidebars (docs/stylesheets/extra.css)


def doc_lines() -> Iterator[tuple[str, str, bool]]:
    """("page:line", text, inside a fenced code block) for every line of every docs page."""
    for page in sorted(DOCS.rglob("*.md")):
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside = not inside
            else:
                yield f"{page.relative_to(DOCS)}:{number}", line, inside


def test_no_code_line_is_wider_than_the_theme_shows() -> None:
    """A command cut off at the edge, or behind a scrollbar, is a command a reader copies wrong."""
    wide = [f"{where} ({len(line)} characters)" for where, line, code in doc_lines() if code and len(line) > CODE_WIDTH]
    assert wide == [], f"code lines wider than {CODE_WIDTH} characters: {wide}"


def test_nested_lists_are_indented_so_they_render_nested() -> None:
    """Python-Markdown nests a list only under a 4-space indent; a 2-space one is flattened into its parent."""
    flat = [where for where, line, code in doc_lines() if not code and re.match(r"^ {1,3}([-*]|\d+\.) ", line)]
    assert flat == [], f"indent these nested items by 4 spaces: {flat}"


def test_every_config_key_is_in_the_reference() -> None:
    page = (DOCS / "config.md").read_text()
    assert [key for key, *_ in schema_rows() if f"`{key}`" not in page] == []


def test_the_library_reference_is_current_and_complete() -> None:
    module = _dev("api_reference")
    assert module.missing_docstrings() == []
    assert (DOCS / "reference.md").read_text() == module.render(), (
        "docs/reference.md is stale; refresh it with: python dev/api_reference.py > docs/reference.md")


def python_snippets() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in re.finditer(r"(?:(<!-- doc-test: skip[^\n]*-->)\n)?```python\n(.*?)```", text, flags=re.S):
            if not match.group(1):
                found.append((f"{page.relative_to(DOCS)}:{text[:match.start()].count(chr(10)) + 1}", match.group(2)))
    return found


@pytest.mark.parametrize(("where", "code"), python_snippets(), ids=[w for w, _ in python_snippets()])
def test_python_snippets_run(where: str, code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-2000:]}"


def quickstart_commands(section: str) -> list[list[str]]:
    """The `.venv/bin/python -m hpc_ddp...` lines of one quickstart section, as argument lists."""
    text = (DOCS / "quickstart.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():  # a command continued with a backslash
            if line.startswith(".venv/bin/python -m hpc_ddp.") and "slurm_local" not in line:
                commands.append(shlex.split(line.split("  #", 1)[0]))
    return commands


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable if a == ".venv/bin/python" else a.replace("runs/", f"{tmp_path}/") for a in argv]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_quickstart_dry_run_and_rehearsal_work_as_written(tmp_path: Path) -> None:
    commands = quickstart_commands("2. A first dry run and a local rehearsal")
    assert [c[2] for c in commands] == ["hpc_ddp.submit", "hpc_ddp.submit", "hpc_ddp.status"]
    outputs = []
    for argv in commands:
        proc = _run(argv, tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs.append(proc.stdout)
    # as the page says: the next boundary after the signal, 41, or 42 when the signal arrives during that boundary
    assert re.search(r"preemption +0->(41|42) .*\n.*finished +\1->100", outputs[-1]), outputs[-1]
    page = (DOCS / "quickstart.md").read_text()
    assert "at step 41" in page and "at 42 when" in page

