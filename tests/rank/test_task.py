"""Loading train.task: what works, and an error that names train.task for every way it fails."""

from __future__ import annotations

import sys

import pytest

from hpc_ddp.rank.loop.task import TaskError, load_task


def test_loads_and_instantiates_a_class() -> None:
    task = load_task("examples.simple:SimpleTask")
    assert type(task).__name__ == "SimpleTask"


@pytest.mark.parametrize(("path", "words"), [
    ("examples.simple", "'package.module:ClassName'"),
    ("no_such_pkg.mod:Task", "no module named 'no_such_pkg'"),
    ("examples.simple:SimpleTsk", "did you mean examples.simple:SimpleTask?"),
    ("examples.simple:Nothing_like_it_at_all", "it defines:"),
    ("tests.tasks:NoLoss", "missing build_dataset, build_optimizer, loss"),
])
def test_errors_name_train_task(path: str, words: str) -> None:
    with pytest.raises(TaskError) as info:
        load_task(path)
    assert info.value.key == "train.task" and words in str(info.value) and "HINT:" in str(info.value)


def test_a_module_that_raises_on_import(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_task_mod.py").write_text("import missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match="install 'missing_dependency_xyz'"):
        load_task("broken_task_mod:Task")
    (tmp_path / "raising_task_mod.py").write_text("raise ValueError('boom at import')\n")
    with pytest.raises(TaskError, match="raised ValueError: boom at import"):
        load_task("raising_task_mod:Task")
    sys.modules.pop("raising_task_mod", None)
