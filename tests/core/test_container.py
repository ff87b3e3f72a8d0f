"""slurm.container and --cpus-per-task: the one builder (:mod:`hpc_ddp.core.container`), every path that uses
it (submitit's first step, the supervise line, both templates, the heal steps, the probes, --dry-run), the
config's errors, the batch script's runtime check run by a real bash, and the login node's warnings. The
real-cluster runs are in tests/cluster/test_heal_slurm.py (a stand-in apptainer wraps every rank of the first step,
of a heal step and of the probes, for submit's path and both templates)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.core.container import binds, container_name, probe_tail, rank_python, runtime_check, step_argv, wrap
from hpc_ddp.core.errors import ConfigError
from hpc_ddp.login.dry_run import submitit_script
from hpc_ddp.login.preflight import check_container
from hpc_ddp.login.sbatch import render, submitit_parameters, submitit_python
from tests.shell.test_supervise import FakeSlurm, FakeSrun, make

ROOT = Path(__file__).resolve().parents[2]
WORKER = ["python3", "-m", "hpc_ddp.worker", "--config", "/runs/a/config.yaml"]


def config(*overrides: str):
    return load_config([ROOT / "examples" / "mlp.yaml"], ["run_dir=/runs/a", *overrides])


def apptainer(*more: str, runtime: str = "apptainer"):
    return config(f"slurm.container.runtime={runtime}", "slurm.container.image=/img/pt.sif", *more)


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
def test_apptainer_and_singularity_wrap_the_rank_command(runtime: str) -> None:
    cpu = apptainer("slurm.cpus_per_task=4", runtime=runtime)
    assert step_argv(cpu.slurm, WORKER, ["/runs/a", "/home/me/code"], "/home/me/code") == [
        "srun", "--kill-on-bad-exit=1", "--cpus-per-task=4", "--overlap",
        runtime, "exec", "--bind", "/runs/a,/home/me/code", "/img/pt.sif", *WORKER]
    gpu = apptainer("slurm.gpus_per_node=4", "slurm.tasks_per_node=4", "slurm.srun_args=[--cpu-bind=cores]",
                    "slurm.container.mounts=[/scratch/data:/data:ro, /opt/x]", "slurm.container.args=[--writable-tmpfs]",
                    runtime=runtime)
    assert step_argv(gpu.slurm, WORKER, ["/runs/a"]) == [
        "srun", "--kill-on-bad-exit=1", "--cpus-per-task=1", "--overlap", "--cpu-bind=cores",
        runtime, "exec", "--nv", "--bind", "/runs/a,/scratch/data:/data:ro,/opt/x", "--writable-tmpfs", "/img/pt.sif",
        *WORKER]  # --nv on a GPU partition; the user's srun_args after ours; args before the image
    assert probe_tail(gpu.slurm, ["/runs/a"]) == ["--cpus-per-task=1", "--overlap", runtime, "exec", "--nv", "--bind",
                                                  "/runs/a,/scratch/data:/data:ro,/opt/x", "--writable-tmpfs",
                                                  "/img/pt.sif", "true"]
    assert rank_python(gpu.slurm, "/venv/bin/python") == "python3"


def test_pyxis_gives_srun_the_container_and_leaves_the_command_alone() -> None:
    cfg = config("slurm.container.runtime=pyxis", "slurm.container.image=nvcr.io#nvidia/pytorch:24.05-py3",
                 "slurm.gpus_per_node=2", "slurm.tasks_per_node=2", "slurm.cpus_per_task=8",
                 "slurm.container.mounts=[/scratch:/scratch]", "slurm.container.args=[--container-env=HOME]",
                 "slurm.srun_args=[--cpu-bind=cores]")
    options = ["--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
               f"--container-name={container_name('nvcr.io#nvidia/pytorch:24.05-py3')}",
               "--container-mounts=/runs/a:/runs/a,/home/me:/home/me,/scratch:/scratch",
               "--container-workdir=/home/me", "--container-env=HOME"]
    assert step_argv(cfg.slurm, WORKER, ["/runs/a", "/home/me"], "/home/me") == [
        "srun", "--kill-on-bad-exit=1", "--cpus-per-task=8", "--overlap", *options, "--cpu-bind=cores", *WORKER]
    assert probe_tail(cfg.slurm, ["/runs/a", "/home/me"], "/home/me") == ["--cpus-per-task=1", "--overlap", *options, "true"]
    bare = config("slurm.container.runtime=pyxis", "slurm.container.image=img.sqsh")
    assert step_argv(bare.slurm, ["true"]) == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=1", "--overlap",
                                               "--container-image=img.sqsh",
                                               f"--container-name={container_name('img.sqsh')}", "true"]
    # issue 57: one container per job and image (pyxis re-imported an unnamed one for every step)
    assert container_name("img.sqsh").startswith("hpc_ddp-") and container_name("a") != container_name("b")


def test_without_a_container_only_the_cpus_are_added() -> None:
    cfg = config("slurm.cpus_per_task=6")
    assert step_argv(cfg.slurm, WORKER, ["/runs/a"], "/w") == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=6",
                                                               "--overlap", *WORKER]
    assert step_argv(cfg.slurm, WORKER, cpus=24)[2] == "--cpus-per-task=24"  # torchrun: the node's task
    assert wrap(cfg.slurm, WORKER, ["/runs/a"]) == WORKER and runtime_check(cfg.slurm) == []
    assert rank_python(cfg.slurm, "/venv/bin/python") == "/venv/bin/python"


def test_binds_mount_each_path_once_and_none_inside_another() -> None:
    assert binds(["/home/me/code/runs/a", "/home/me/code", "/home/me/code/"]) == ["/home/me/code"]
    assert binds(["/runs/a", "/runs/ab", ""]) == ["/runs/a", "/runs/ab"]


def test_submits_first_step_and_the_supervised_one_agree() -> None:
    """submitit's srun (its python is the wrapped command) and the supervise line's step are the same step."""
    cfg = apptainer("slurm.cpus_per_task=3", "slurm.srun_args=[--cpu-bind=cores]")
    script = submitit_script(cfg, python="/venv/bin/python", workdir="/home/me")
    first = next(line for line in script.splitlines() if line.startswith("srun "))
    teardown = script.splitlines()[-1]
    wrapper = "apptainer exec --bind /runs/a,/home/me /img/pt.sif python3"
    assert first.endswith(f"--kill-on-bad-exit=1 --cpus-per-task=3 --overlap --cpu-bind=cores {wrapper} -u -m "
                          "submitit.core._submit /runs/a/slurm")
    assert teardown.startswith("/venv/bin/python -m hpc_ddp.supervise --exit-code $? /runs/a/config.yaml -- ")
    assert teardown.endswith(f"srun --kill-on-bad-exit=1 --cpus-per-task=3 --overlap --cpu-bind=cores {wrapper} -m "
                             "hpc_ddp.worker --config /runs/a/config.yaml")
    setup = script.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert setup[1] == "export SRUN_CPUS_PER_TASK=3" and setup[-2].startswith("command -v apptainer")  # [0]: the trap
    # last: the watcher that ends submitit's srun once only declared-lost nodes are left (hpc_ddp.shell.lost_wait)
    assert setup[-1] == "/venv/bin/python -m hpc_ddp.supervise --watch /runs/a/config.yaml &"
    assert submitit_python(cfg, "/venv/bin/python", "/home/me") == wrapper
    spare = submitit_parameters(apptainer("slurm.spare_nodes=1", "slurm.nodes=2"), ["/runs/a/config.yaml"])
    assert spare["srun_args"][:5] == ["--kill-on-bad-exit=1", "--cpus-per-task=1", "--nodes=2", "--ntasks=4",
                                      "--relative=1"]


def test_a_job_array_mounts_the_folder_of_its_runs() -> None:
    cfg = apptainer()
    assert "--bind /runs,/w /img/pt.sif" in submitit_python(cfg, "python", "/w", array=True)
    script = submitit_script(cfg, array=2, python="python", cfgs=[cfg, cfg], workdir="/w")
    assert script.splitlines()[-1].endswith("--bind /runs,/w /img/pt.sif python3 -m hpc_ddp.worker --config "
                                            "'{config}'")


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_both_templates_wrap_their_step_and_export_the_cpus(launcher: str) -> None:
    cfg = apptainer("slurm.tasks_per_node=2", "slurm.cpus_per_task=3", "slurm.gpus_per_node=2",
                    "slurm.setup=[module load apptainer]")
    text = render(cfg, "/runs/a/config.yaml", python="/venv/bin/python", launcher=launcher, workdir="/home/me")
    cpus = 6 if launcher == "torchrun" else 3  # torchrun: one task per node, with the node's CPUs
    program = 'bash -c "$NODE_SCRIPT"' if launcher == "torchrun" else '"$RANK_PYTHON" -m hpc_ddp.worker'
    assert (f"  srun --kill-on-bad-exit=1 --cpus-per-task={cpus} --overlap apptainer exec --nv --bind /runs/a,/home/me "
            f"/img/pt.sif {program}") in text
    assert f"\nexport SRUN_CPUS_PER_TASK={cpus}\n" in text and f"#SBATCH --cpus-per-task={cpus}" in text
    assert "\nRANK_PYTHON=python3\n" in text and "\nPYTHON=/venv/bin/python\n" in text
    setup = text.split("# --- setup", 1)[1].split("# --- end of setup ---")[0].splitlines()[1:]
    assert setup[0] == "module load apptainer" and setup[1].startswith("command -v apptainer")  # after the user's
    if launcher == "torchrun":
        assert 'exec "$RANK_PYTHON" -m torch.distributed.run' in text and "export CONFIG PYTHON RANK_PYTHON" in text


def test_heal_steps_keep_the_container_and_probes_run_in_it(tmp_path: Path) -> None:
    """The supervisor's next step is the supervised command with a new shape (the container comes with it);
    its probes are built from the config by the same builder."""
    slurm = FakeSlurm(["n1", "n2", "n3"])
    cfg_args = ["slurm.container.runtime=apptainer", "slurm.container.image=/img/pt.sif", "slurm.spare_nodes=1"]
    command = step_argv(apptainer().slurm, WORKER, [str(tmp_path / "run")])
    sup = make(tmp_path, *cfg_args, slurm=slurm, srun=FakeSrun(), command=command)
    sup.workdir = "/home/me"
    argv = sup.step_argv(["n3"])
    assert argv[:5] == ["srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--nodelist=n3"]
    assert argv[5:] == command[1:] and "apptainer" in argv
    calls: list[list[str]] = []
    sup.runner = lambda argv, **kw: (calls.append(list(argv)), slurm(argv, **kw))[1]
    assert sup.probe(["n2", "n3"]) and slurm.probes == [["n2", "n3"]]
    assert calls[0][-8:] == ["--cpus-per-task=1", "--overlap", "apptainer", "exec", "--bind", f"{tmp_path / 'run'},/home/me",
                             "/img/pt.sif", "true"]  # a probe needs one CPU, in the container


def run_check(cfg, path: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "check.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(runtime_check(cfg.slurm)) + "\necho checked\n")
    return subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True, timeout=30,
                          env={"PATH": path})


def test_the_batch_script_stops_with_the_key_when_the_runtime_is_missing(tmp_path: Path) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    missing = run_check(apptainer(), f"{tools}:/usr/bin:/bin", tmp_path)
    assert missing.returncode == 2 and "checked" not in missing.stdout
    assert ("hpc_ddp: error: slurm.container.runtime=apptainer, but the command apptainer is not on the PATH of "
            f"the job ({tools}:/usr/bin:/bin). HINT: load it in slurm.setup") in missing.stderr
    fake = tools / "apptainer"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert run_check(apptainer(), f"{tools}:/usr/bin:/bin", tmp_path).stdout == "checked\n"
    srun = tools / "srun"
    pyxis = config("slurm.container.runtime=pyxis", "slurm.container.image=img.sqsh")
    srun.write_text("#!/bin/sh\necho 'Usage: srun [OPTIONS...]'\n")
    srun.chmod(0o755)
    plain = run_check(pyxis, f"{tools}:/usr/bin:/bin", tmp_path)
    assert plain.returncode == 2 and "slurm.container.runtime=pyxis, but the srun of this cluster" in plain.stderr
    srun.write_text("#!/bin/sh\necho 'Options provided by plugins:'\necho '      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH'\n")
    assert run_check(pyxis, f"{tools}:/usr/bin:/bin", tmp_path).stdout == "checked\n"


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["slurm.container.runtime=docker"], "slurm.container.runtime", "expected one of pyxis, apptainer, singularity"),
    (["slurm.container.runtime=apptainer"], "slurm.container.image", "needs an image"),
    (["slurm.container.image=/img/pt.sif"], "slurm.container.runtime", "no runtime runs it"),
    (["slurm.container.runtime=pyxis", "slurm.container.image=x", "slurm.container.mounts=[$SCRATCH:/data]"],
     "slurm.container.mounts", "${oc.env:SCRATCH}"),
    (["slurm.container.runtime=pyxis", "slurm.container.image=x", "slurm.container.mounts=['/a,/b']"],
     "slurm.container.mounts", "no commas"),
    (["slurm.container.runtime=pyxis", "slurm.container.image=x", "slurm.container.python=''"],
     "slurm.container.python", "python3"),
    (["slurm.container.runtim=pyxis"], "slurm.container.runtim", "did you mean slurm.container.runtime"),
    # issue 57: a script's arguments put in the container's, with no container: never silently ignored
    (["slurm.container.args=[--epochs,3]"], "slurm.container.args", "train.args"),
    (["slurm.container.mounts=[/data]"], "slurm.container.mounts", "nothing would use it"),
    # issue 57: --cleanenv hides SLURM_*: every task a world of one, N trainings in one run dir
    (["slurm.container.runtime=apptainer", "slurm.container.image=/i.sif", "slurm.container.args=[--cleanenv]"],
     "slurm.container.args", "world of one"),
    (["slurm.container.runtime=singularity", "slurm.container.image=/i.sif", "slurm.container.args=[-C]"],
     "slurm.container.args", "drop -C"),
    # --contain: a /dev/shm per task, the node's ranks never see each other's beats (the rank checks it too)
    (["slurm.container.runtime=apptainer", "slurm.container.image=/i.sif", "slurm.container.args=[--contain]"],
     "slurm.container.args", "/dev/shm of its own"),
])
def test_bad_container_settings_name_the_key_and_the_fix(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(*overrides)
    assert err.value.key == key and words in str(err.value) and "HINT" in str(err.value), str(err.value)


def test_a_later_null_drops_an_earlier_container(tmp_path: Path) -> None:
    (tmp_path / "cluster.yaml").write_text("slurm:\n  container:\n    runtime: apptainer\n    image: /img/pt.sif\n")
    (tmp_path / "here.yaml").write_text("slurm:\n  container: null\n")
    files = [ROOT / "examples" / "mlp.yaml", tmp_path / "cluster.yaml"]
    assert load_config(files).slurm.container.runtime == "apptainer"
    assert load_config([*files, tmp_path / "here.yaml"]).slurm.container.runtime is None
    assert load_config(files, ["slurm.container=null"]).slurm.container.image == ""


def test_preflight_warns_of_a_runtime_or_image_this_node_lacks(tmp_path: Path) -> None:
    cfg = apptainer()
    found = check_container(cfg, which=lambda name: None)
    assert [(f.level, f.key) for f in found] == [("warning", "slurm.container.runtime"),
                                                 ("warning", "slurm.container.image")]
    image = tmp_path / "pt.sif"
    image.write_text("")
    cfg = apptainer(f"slurm.container.image={image}")
    assert check_container(cfg, which=lambda name: f"/usr/bin/{name}") == []


def test_dry_run_shows_the_wrapped_steps_and_the_probe(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--dry-run", "--no-preflight",
                           f"run_dir={tmp_path / 'run'}", "slurm.container.runtime=singularity",
                           "slurm.container.image=/img/pt.sif", "slurm.cpus_per_task=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    wrapper = f"singularity exec --bind {shlex.quote(str(tmp_path / 'run'))},{ROOT} /img/pt.sif python3"
    assert f"--cpus-per-task=2 --overlap {wrapper} -u -m submitit.core._submit" in proc.stdout
    assert f"--cpus-per-task=2 --overlap {wrapper} -m hpc_ddp.worker --config" in proc.stdout
    assert "container: singularity, image /img/pt.sif: every step of the job runs in it" in proc.stdout
    assert f"--cpus-per-task=1 --overlap {wrapper.removesuffix(' python3')} true" in proc.stdout


def test_the_rehearsal_says_it_runs_outside_the_container(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local", "slurm.nodes=1",
                           "slurm.tasks_per_node=1", "train.max_steps=2", f"run_dir={tmp_path / 'run'}",
                           "slurm.container.runtime=apptainer", "slurm.container.image=/img/pt.sif"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "on this machine; run dir" in proc.stdout and "outside slurm.container (apptainer: on the cluster only)" \
        in proc.stdout


def test_no_container_adds_no_key_to_what_a_snapshot_records() -> None:
    """A snapshot's config from before containers shows no change against a run without one; with one, its
    keys are recorded, so a --resume in another image says so."""
    from hpc_ddp.core.config import flat_values

    assert not any(key.startswith("slurm.container") for key in flat_values(config()))
    assert flat_values(apptainer())["slurm.container.image"] == "/img/pt.sif"
