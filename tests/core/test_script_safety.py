"""Nothing a config value holds becomes a command of the job's batch script (issue 61).

Every field that reaches a script gets hostile values (a newline, ``$(...)``, backticks, ``;``, quotes): each
is refused at config time with its key named, or lands in every script (both templates, submitit's, a job
array's) only quoted: the ``#SBATCH`` block stays whole, sbatch reads the value back as it was, and the script,
run by bash with stub ``srun``/``scontrol``/``python`` on the PATH, never creates the marker file. The CLI's
``--emit-sbatch`` and ``--dry-run`` are tried the same way; then the smaller items (non-UTF-8, huge counts, umask).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from hpc_ddp.core.config import load_config
from hpc_ddp.core.errors import ConfigError
from hpc_ddp.core.shell_safe import sbatch_read, sbatch_value
from hpc_ddp.login.dry_run import submitit_script
from hpc_ddp.login.sbatch import render
from hpc_ddp.login.submit import main as submit

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.yaml"
PAYLOADS = ["x\ntouch {m}\n#", "x\rtouch {m}", "x\ttouch", "$(touch {m})", "$(touch$IFS{m})", "`touch {m}`",
            "`touch$IFS{m}`", "x;touch {m}", "x;touch$IFS{m}", "'; touch {m}; '", '"; touch {m}; "',
            "x#$(touch$IFS{m})", "a\\"]
APPTAINER: dict[str, Any] = {"runtime": "apptainer", "image": "/img.sif"}
# config key -> the YAML that puts value v in it
FIELDS: dict[str, Callable[[str], dict[str, Any]]] = {
    "run_dir": lambda v: {"run_dir": f"/runs/{v}"},
    "name": lambda v: {"name": v},
    **{f"slurm.{k}": (lambda k: lambda v: {"slurm": {k: v}})(k) for k in ("partition", "account", "qos", "constraint")},
    "slurm.srun_args": lambda v: {"slurm": {"srun_args": [v]}},
    "slurm.sbatch_extra": lambda v: {"slurm": {"sbatch_extra": {"mail-user": v}}},
    "slurm.container.image": lambda v: {"slurm": {"container": {"runtime": "apptainer", "image": v}}},
    "slurm.container.mounts": lambda v: {"slurm": {"container": {**APPTAINER, "mounts": [f"/data/{v}"]}}},
    "slurm.container.args": lambda v: {"slurm": {"container": {**APPTAINER, "args": [v]}}},
    "slurm.container.python": lambda v: {"slurm": {"container": {**APPTAINER, "python": v}}},
    "pyxis:slurm.container.image": lambda v: {"slurm": {"container": {"runtime": "pyxis", "image": v}}},
    "pyxis:slurm.container.args": lambda v: {"slurm": {"container": {"runtime": "pyxis", "image": "i", "args": [v]}}},
    "dist.nccl_env": lambda v: {"dist": {"nccl_env": {"NCCL_DEBUG": v}}},
}
STUB = '#!/bin/bash\n[ "$1" = --help ] && echo --container-image\nfor a in "$@"; do printf "%s\\0" "$a"; done >> "$ARGV_LOG"\n'


def config(tmp: Path, extra: dict[str, Any]) -> Path:
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"task": "examples.mlp:MLPTask", "max_steps": 10}, **extra}))
    return path


def scripts(cfg: Any, workdir: str) -> dict[str, str]:
    """Every script a config renders to: both templates, submitit's for one run and for a job array."""
    config_path = f"{cfg.run_dir}/config.yaml"
    return {"srun": render(cfg, config_path, python="python", workdir=workdir),
            "torchrun": render(cfg, config_path, python="python", launcher="torchrun", workdir=workdir),
            "submitit": submitit_script(cfg, python="python", workdir=workdir),
            "submitit_array": submitit_script(cfg, array=2, python="python", cfgs=[cfg, cfg], workdir=workdir)}


def stubs(tmp: Path) -> Path:
    """A bin/ of commands that log their argv (NUL-separated) and do nothing: srun, scontrol, python, runtimes."""
    folder = tmp / "bin"
    folder.mkdir(exist_ok=True)
    for name in ("srun", "scontrol", "sbatch", "python", "python3", "apptainer", "singularity"):
        (folder / name).write_text(STUB)
        (folder / name).chmod(0o755)
    return folder


def run_script(text: str, tmp: Path) -> list[str]:
    """Run ``text`` with bash (after ``bash -n``) in ``tmp`` with the stubs first on the PATH; the argv items
    the stubs got."""
    script, log = tmp / "job.sbatch", tmp / "argv.log"
    script.write_text(text)
    log.write_text("")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, text
    env = {"PATH": f"{stubs(tmp)}:/usr/bin:/bin", "HOME": str(tmp), "ARGV_LOG": str(log)}
    done = subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.stderr, text)
    return log.read_text().split("\0")


def sbatch_block(text: str) -> list[str]:
    """The script's #SBATCH lines, checked to be one block: from the first to the last, every line is one."""
    lines = text.split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
    end = next(i for i in range(first, len(lines)) if not lines[i].startswith("#SBATCH "))
    assert not any(line.startswith("#SBATCH") for line in lines[end:]), text
    return lines[first:end]


def sbatch_values(block: list[str]) -> list[str]:
    return [sbatch_read(line.split("=", 1)[1]) for line in block if "=" in line]


def test_each_hostile_value_is_refused_with_its_key_or_stays_quoted_text(tmp_path: Path) -> None:
    marker, accepted, refused = tmp_path / "MARK", [], []
    for field, put in FIELDS.items():
        key = field.split(":")[-1]
        for payload in PAYLOADS:
            value = payload.format(m=marker)
            try:
                cfg = load_config([config(tmp_path, put(value))])
            except ConfigError as err:
                assert err.key == key and key in str(err), (field, value, err.key, str(err))
                assert any(c in value for c in "\n\r\t\\") or err.key != "run_dir", (value, str(err))
                refused.append((field, value))
                continue
            assert not any(c in value for c in "\n\r\t"), (field, value)  # a control character never passes
            accepted.append((field, value))
            for name, text in scripts(cfg, str(tmp_path)).items():
                values = sbatch_values(sbatch_block(text))
                argv = run_script(text, tmp_path)
                assert not marker.exists(), (field, value, name, text)
                if key != "dist.nccl_env":  # not in the script: exported by the worker, from Python
                    # whole: an argv item a stub got, a value sbatch reads, or a variable's (torchrun's RANK_PYTHON)
                    assert any(value in v for v in values + argv) or f"={shlex.quote(value)}\n" in text, (
                        field, value, name, text, values, argv)
    assert ("run_dir", f"/runs/$(touch {marker})") not in refused  # spaces and $(...) in a path are fine
    assert len(accepted) > 40 and len(refused) > 30, (accepted, refused)


@pytest.mark.parametrize("value", ["echo hi\ntouch {m}", "echo hi\r", "echo hi \\"])
def test_a_setup_line_is_one_line_of_its_own_or_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([config(tmp_path, {"slurm": {"setup": [value.format(m=tmp_path / "MARK")]}})])
    assert info.value.key == "slurm.setup" and "slurm.setup[0]" in str(info.value)


def test_setup_lines_are_kept_as_the_users_own_commands(tmp_path: Path) -> None:
    lines = ["echo \"$(date)\" 'quoted; text'", "export A=1\t# a tab is fine", "echo 'ends in two' \\\\"]
    cfg = load_config([config(tmp_path, {"slurm": {"setup": lines}})])
    for name, text in scripts(cfg, str(tmp_path)).items():
        assert all(line in text.split("\n") for line in lines), name
        run_script(text, tmp_path)


@pytest.mark.parametrize("value", ["plain/a-b_c.d:1@2%j", "a b", "a#b", "it's", 'say "hi"', "back\\slash", "$(x) `y`"])
def test_sbatch_reads_a_quoted_value_back_as_it_was(value: str) -> None:
    assert sbatch_read(sbatch_value(value)) == value
    assert old_sbatch_read(sbatch_value(value)) == value  # Slurm before 17.11: only " quotes, # always a comment


def old_sbatch_read(text: str) -> str:
    out, quoted, escape = [], False, False
    for char in text:
        if escape:
            out.append(char)
            escape = False
        elif char == "\\":
            escape = True
        elif char == '"':
            quoted = not quoted
        elif char == "#" or (char.isspace() and not quoted):
            break
        else:
            out.append(char)
    return "".join(out)


def test_a_run_dir_with_spaces_and_quotes_is_one_output_value(tmp_path: Path) -> None:
    run_dir = f"{tmp_path}/my runs/it's #1"
    cfg = load_config([config(tmp_path, {"run_dir": run_dir})])
    for name, text in scripts(cfg, str(tmp_path)).items():  # a job array's logs are in the sweep's folder
        logs = f"{Path(run_dir).parent if name == 'submitit_array' else run_dir}/slurm/%"
        assert any(v.startswith(logs) for v in sbatch_values(sbatch_block(text))), name


def cli_script(tmp: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = submit(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("mode", ["--emit-sbatch", "--dry-run"])
def test_the_cli_refuses_a_line_break_and_writes_nothing(tmp_path: Path, mode: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    marker, job = tmp_path / "pwned", tmp_path / "job.sbatch"
    path = config(tmp_path, {"run_dir": f"{tmp_path}/r2\ntouch {marker}\n#"})
    args = [str(path), *([mode, str(job)] if mode == "--emit-sbatch" else [mode]), "--no-preflight"]
    code, out, err = cli_script(tmp_path, args, capsys)
    assert code == 2 and "run_dir holds a newline" in err and "HINT:" in err
    assert not job.exists() and not marker.exists() and "#SBATCH" not in out
    assert not (tmp_path / "r2\ntouch").exists()


@pytest.mark.parametrize("mode", ["--emit-sbatch", "--dry-run"])
def test_the_cli_quotes_shell_text_in_a_run_dir_and_never_runs_it(tmp_path: Path, mode: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    marker, job = tmp_path / "pwned", tmp_path / "job.sbatch"
    run_dir = f"{tmp_path}/r $(touch {marker}) `touch {marker}`;touch {marker} 'q\" #x"
    path = config(tmp_path, {"run_dir": run_dir, "slurm": {"partition": "p$(touch$IFS" + f"{marker})"}})
    args = [str(path), *([mode, str(job)] if mode == "--emit-sbatch" else [mode]), "--no-preflight"]
    code, out, err = cli_script(tmp_path, args, capsys)
    assert code == 0, err
    text = job.read_text() if mode == "--emit-sbatch" else out[out.index("#!/bin/bash"):out.index("\nrun ")]
    for python in (shlex.quote(sys.executable), sys.executable):  # the stub python, not the real one
        text = text.replace(python, "python")
    values = sbatch_values(sbatch_block(text))
    assert any(v.startswith(f"{run_dir}/slurm/") for v in values) and f"p$(touch$IFS{marker})" in values
    run_script(text, tmp_path)
    assert not marker.exists()


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  task: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config([path])
    message = str(info.value)
    assert str(path) in message and "offset 18 (line 2)" in message and "UTF-8" in message and "HINT:" in message


@pytest.mark.parametrize("slurm, key", [({"nodes": 10**23}, "slurm.nodes"), ({"nodes": "1-100000000000"}, "slurm.nodes"),
                                        ({"tasks_per_node": 10**9}, "slurm.tasks_per_node"),
                                        ({"spare_nodes": 10**12}, "slurm.spare_nodes")])
def test_huge_counts_are_refused_with_the_bound(tmp_path: Path, slurm: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([config(tmp_path, {"slurm": slurm, "train": {"loop": "examples.own_loop:main"}})])
    assert info.value.key == key and "at most" in str(info.value)


def test_dry_run_of_the_largest_job_shows_a_few_ranks_and_ends(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = submit([str(MLP), "--dry-run", "--no-preflight", f"run_dir={tmp_path}/r", "slurm.nodes=65536",
                   "slurm.tasks_per_node=8"])
    out = capsys.readouterr().out
    assert code == 0 and len(out.splitlines()) < 200  # a few ranks, not one line (or one step of work) per rank
    assert "  ... 524278 more ranks ..." in out and "\n524287  7 " in out and "\n8  " not in out


def test_dry_run_of_a_wide_range_shows_a_few_batch_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert submit([str(MLP), "--dry-run", "--no-preflight", f"run_dir={tmp_path}/r", "slurm.nodes=1-40",
                   "train.task=null", "train.loop=examples.own_loop:main"]) == 0
    out = capsys.readouterr().out
    assert "  ... 30 more node counts ..." in out and "  40 nodes -> 80 ranks" in out and "  9 nodes" not in out


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700), (0o027, 0o750)])
def test_emit_sbatch_honours_the_umask(tmp_path: Path, umask: int, mode: int,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.sbatch"
    before = os.umask(umask)
    try:
        code = submit([str(MLP), "--emit-sbatch", str(job), "--no-preflight", f"run_dir={tmp_path}/r"])
    finally:
        os.umask(before)
    assert code == 0, capsys.readouterr().err
    assert job.stat().st_mode & 0o777 == mode
