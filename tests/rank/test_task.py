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


def test_build_dataset_must_return_a_map_style_dataset() -> None:
    """Issue 57: the tutorial's DataLoader, or an iterable, returned from build_dataset: a TaskError naming
    build_dataset and the fix (exit 2, never retried), not a batch-size hint or a TypeError."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from hpc_ddp.rank.loop.task import build_dataset

    data = TensorDataset(torch.zeros(4, 1))

    class Returns:
        def __init__(self, made: object) -> None:
            self.made = made

        def build_dataset(self, cfg: object) -> object:
            return self.made

    assert build_dataset(Returns(data), None) is data  # type: ignore[arg-type]
    with pytest.raises(TaskError) as info:
        build_dataset(Returns(DataLoader(data, batch_size=2)), None)  # type: ignore[arg-type]
    assert "Returns.build_dataset returned a DataLoader" in str(info.value) and "loader.dataset" in str(info.value)
    assert info.value.key == "train.task"

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([])

    for made in (Stream(), iter([1, 2])):
        with pytest.raises(TaskError, match="not a map-style dataset"):
            build_dataset(Returns(made), None)  # type: ignore[arg-type]
