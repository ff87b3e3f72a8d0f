"""The package shows where code runs (docs/layout.md), and the move kept every path users and jobs depend on.

- The import contracts (.importlinter) hold, and a wrong import (the login node importing rank code; inside a
  rank, an import up its layers, between watch and salvage, or of watch from outside attempt; an import of
  the package root; either of the two circles the layout opened) breaks them.
- No module of the package imports itself back through others: the import graph has no cycle.
- 0.1's module paths still import, as the same module objects, with a DeprecationWarning naming the new path.
- ``hpc_ddp.session`` stays the context manager after its module is imported (it became the module before).
- A job submitted before the move still runs after it: submitit's pickled callable (kept in
  tests/golden/before_layout_move) resolves, and the sbatch scripts emitted then run on the real cluster
  (tests/cluster/test_submit_slurm.py submits them; here, the entry points they name).
"""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BEFORE = ROOT / "tests" / "golden" / "before_layout_move"
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(LINT, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)})


def broken_by(tmp_path: Path, module: str, wrong: str, said: str, arrow: str) -> None:
    """A copy of the package where ``module`` makes the ``wrong`` import: lint-imports fails, saying ``said``
    and showing the ``arrow``."""
    shutil.copytree(ROOT / "hpc_ddp", tmp_path / "hpc_ddp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    source = tmp_path / "hpc_ddp" / module
    source.write_text(source.read_text() + f"\n\ndef _wrong() -> None:\n    {wrong}  # noqa\n")
    proc = lint(tmp_path)
    assert proc.returncode != 0
    assert said in proc.stdout and arrow in proc.stdout, proc.stdout[-3000:]


def test_the_import_contracts_hold() -> None:
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") >= 13


def test_the_login_node_importing_rank_code_breaks_them(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "hpc_ddp", tmp_path / "hpc_ddp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    status = tmp_path / "hpc_ddp" / "login" / "status" / "cli.py"
    status.write_text(status.read_text() + "\n\ndef _wrong() -> None:\n    from hpc_ddp.rank.loop import run  # noqa\n")
    proc = lint(tmp_path)
    assert proc.returncode != 0
    assert "hpc_ddp.login is not allowed to import hpc_ddp.rank" in proc.stdout
    assert "hpc_ddp.login.status.cli -> hpc_ddp.rank.loop.run" in proc.stdout


@pytest.mark.parametrize("module, wrong, said, arrow", [
    # a resume importing the run API: the jit -> restore -> run -> jit circle the layout opened
    ("rank/state/restore.py", "from hpc_ddp.rank.loop import run", "hpc_ddp.rank.state is not allowed to import "
     "hpc_ddp.rank.loop", "hpc_ddp.rank.state.restore -> hpc_ddp.rank.loop.run"),
    # a sink importing the process groups: siblings on one layer are independent
    ("rank/metrics/sinks.py", "from hpc_ddp.rank.group import control", "hpc_ddp.rank.metrics is not allowed to "
     "import hpc_ddp.rank.group", "hpc_ddp.rank.metrics.sinks -> hpc_ddp.rank.group.control"),
    # saving after a failure importing what notices one: down the layers, but they stay apart
    ("rank/salvage/jit.py", "from hpc_ddp.rank.watch import liveness", "hpc_ddp.rank.salvage is not allowed to "
     "import hpc_ddp.rank.watch", "hpc_ddp.rank.salvage.jit -> hpc_ddp.rank.watch.liveness"),
    # the run API or the front door importing what notices a failure: down the layers, but only
    # the attempt wires watch/
    ("rank/loop/run.py", "from hpc_ddp.rank.watch import liveness",
     "hpc_ddp.rank.loop is not allowed to import hpc_ddp.rank.watch",
     "hpc_ddp.rank.loop.run -> hpc_ddp.rank.watch.liveness"),
    ("rank/worker.py", "from hpc_ddp.rank.watch import watchdog",
     "hpc_ddp.rank.worker is not allowed to import hpc_ddp.rank.watch",
     "hpc_ddp.rank.worker -> hpc_ddp.rank.watch.watchdog")])
def test_an_import_up_the_ranks_layers_breaks_them(tmp_path: Path, module: str, wrong: str, said: str,
                                                   arrow: str) -> None:
    broken_by(tmp_path, module, wrong, said, arrow)


CYCLE = """
import graphlib, grimp
graph = grimp.build_graph("hpc_ddp", cache_dir=None)
try:
    graphlib.TopologicalSorter({m: graph.find_modules_directly_imported_by(m) for m in graph.modules}).prepare()
except graphlib.CycleError as err:
    print(" -> ".join(reversed(err.args[1])))
"""


def a_cycle(cwd: Path) -> str:
    """One cycle of imports between the package's modules (``a -> b -> a``, TYPE_CHECKING and function-level
    imports included, as import-linter counts them); "" when there is none."""
    proc = subprocess.run([sys.executable, "-c", CYCLE], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_no_module_imports_itself_back_through_others() -> None:
    assert a_cycle(ROOT) == ""


@pytest.mark.parametrize("module, wrong, said, arrow, circle", [
    # core asking the package root for the version: the arrow up that core/version.py removed
    ("core/helptext.py", "from hpc_ddp import __version__", "hpc_ddp.core.helptext is not allowed to import "
     "hpc_ddp:", "hpc_ddp.core.helptext -> hpc_ddp (l.", False),
    # the survivors' files reading the snapshots' manifests themselves: the circle losses.jit_fields opened
    ("rundir/jit_files.py", "from hpc_ddp.rundir.snapshot import committed", "hpc_ddp.rundir.jit_files is not "
     "allowed to import hpc_ddp.rundir.snapshot", "hpc_ddp.rundir.jit_files -> hpc_ddp.rundir.snapshot", True),
    # ... or through losses, which reads them (the committed steps: rundir/snapshot/steps.py)
    ("rundir/jit_files.py", "from hpc_ddp.rundir import losses", "hpc_ddp.rundir.jit_files is not allowed to "
     "import hpc_ddp.rundir.snapshot:", "hpc_ddp.rundir.jit_files -> hpc_ddp.rundir.losses", True),
    # the first-boundary hook naming the run API's class: the circle its FirstBoundary Protocol opened
    ("rank/loop/compiling.py", "from hpc_ddp.rank.loop.run import Run", "hpc_ddp.rank.loop.compiling is not "
     "allowed to import hpc_ddp.rank.loop.run", "hpc_ddp.rank.loop.compiling -> hpc_ddp.rank.loop.run", True)])
def test_an_import_of_the_root_or_back_round_a_circle_breaks_them(tmp_path: Path, module: str, wrong: str,
                                                                 said: str, arrow: str, circle: bool) -> None:
    broken_by(tmp_path, module, wrong, said, arrow)
    assert bool(a_cycle(tmp_path)) is circle


@pytest.mark.parametrize("old, new, name", [
    ("config", "hpc_ddp.core.config", "RunConfig"), ("slurm_env", "hpc_ddp.core.slurm_env", "from_environ"),
    ("sampler", "hpc_ddp.rank.loop.sampler", "ShardSampler"), ("distributed", "hpc_ddp.rank.group.distributed", "all_mean"),
    ("snapshot", "hpc_ddp.rundir.snapshot", "committed_steps"), ("metrics_file", "hpc_ddp.rundir.metrics_file", "read"),
    ("local", "hpc_ddp.rehearsal.local", "rehearse"), ("heal", "hpc_ddp.shell.heal", "plan"),
    # a 0.2 path that issue 56 moved into its family's folder
    ("rundir.snapshot_steps", "hpc_ddp.rundir.snapshot.steps", "committed_steps")])
def test_an_old_path_imports_the_module_at_its_new_path_and_says_so(old: str, new: str, name: str) -> None:
    code = (f"import warnings, importlib\nwarnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as seen:\n"
            f"    from hpc_ddp.{old} import {name} as found\n"
            f"assert found is getattr(importlib.import_module({new!r}), {name!r})\n"
            f"import hpc_ddp.{old} as old_module\n"
            f"assert old_module is importlib.import_module({new!r})\n"
            f"print([str(w.message) for w in seen if w.category is DeprecationWarning])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"hpc_ddp.{old} moved to {new}" in proc.stdout and "import it from there" in proc.stdout


def test_a_split_module_answers_every_name_from_its_successors() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from hpc_ddp.preemption import EXIT_REQUEUE, StopFlag, read_attempts, requeue  # noqa: F401
        from hpc_ddp.liveness import EXIT_LOST, Liveness, lost_ranks  # noqa: F401
        from hpc_ddp.tracking import missing_extras, open_sinks  # noqa: F401
    from hpc_ddp.core.stopping import StopFlag as moved
    from hpc_ddp.rundir.losses import lost_ranks as losses

    assert StopFlag is moved and lost_ranks is losses and EXIT_REQUEUE == 3 and EXIT_LOST == 6
    said = [str(w.message) for w in seen if w.category is DeprecationWarning]
    assert any(m.startswith("hpc_ddp.liveness.lost_ranks moved to hpc_ddp.rundir.losses.lost_ranks in hpc_ddp 0.2") for m in said)
    assert any(m.startswith("hpc_ddp.liveness.EXIT_LOST moved to hpc_ddp.core.codes.EXIT_LOST") for m in said)
    assert any(m.startswith("hpc_ddp.preemption.StopFlag moved to hpc_ddp.core.stopping.StopFlag") for m in said)
    assert all(w.filename == __file__ for w in seen if w.category is DeprecationWarning)  # the importer's line


def test_the_one_old_path_not_kept_says_why() -> None:
    """``hpc_ddp.session`` is the context manager: serving a module there would bring 0.1's bug back."""
    with pytest.raises(ModuleNotFoundError, match="hpc_ddp.session is the context manager"):
        import hpc_ddp.session  # noqa: F401


def test_hpc_ddp_session_is_the_context_manager_even_after_its_module_is_imported() -> None:
    code = ("import hpc_ddp, inspect\nfirst = hpc_ddp.session\nimport hpc_ddp.rank.attempt.session\n"
            "print(inspect.isfunction(first), inspect.isfunction(hpc_ddp.session), first is hpc_ddp.session)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["True", "True", "True"], proc.stderr[-3000:]


SCRIPT = '''
import sys, torch
import hpc_ddp

for name in ("first", "second"):
    with hpc_ddp.session(overrides=[f"name={name}", f"run_dir={sys.argv[1]}/{name}", "train.max_steps=3",
                                    "snapshot.every_steps=null", "dist.backend=gloo"]) as run:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = run.resume(model=model, optimizer=optimizer)
        while step < 3:
            model(torch.ones(4, 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if run.boundary(step):
                break
        run.finish()
print("two sessions")
'''


@pytest.mark.slow
def test_two_sessions_in_one_process(tmp_path: Path) -> None:
    from hpc_ddp.rehearsal.local import free_port

    script = tmp_path / "two_sessions.py"
    script.write_text(SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and "two sessions" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name in ("first", "second"):
        assert (tmp_path / name / "DONE.json").exists()


def test_a_job_pickled_before_the_move_finds_its_callable() -> None:
    """submitit pickled ``hpc_ddp.worker.job_main`` by its path; the path is an entry point that never moves,
    and new jobs pickle the same path."""
    import hpc_ddp.worker

    with (BEFORE / "submitted.pkl").open("rb") as f:
        submission = pickle.load(f)
    assert submission.function is hpc_ddp.worker.job_main and submission.args == ("/RUN_DIR/config.yaml",)
    assert hpc_ddp.worker.job_main.__module__ == "hpc_ddp.worker"


def test_the_entry_points_old_batch_scripts_name_still_run() -> None:
    """Every ``-m hpc_ddp.X`` the scripts emitted before the move name answers ``--help`` from another
    directory, with no deprecation warning (they are entry points, not moved modules)."""
    named = set()
    for script in ("srun.sbatch", "torchrun.sbatch"):
        text = (BEFORE / script).read_text()
        named |= set(re.findall(r"-m (hpc_ddp\.\w+)", text))
    assert {"hpc_ddp.supervise", "hpc_ddp.worker"} <= named
    for module in sorted(named | {"hpc_ddp.submit", "hpc_ddp.status", "hpc_ddp.whoami"}):
        proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-m", module, "--help"],
                              cwd="/", capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0 and "usage:" in proc.stdout, (module, proc.stderr[-2000:])
