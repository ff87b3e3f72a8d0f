"""Who may write the run dir: it is created ``run_dir_mode`` (0700 by default, whatever the umask),
and a run dir, ``slurm/`` or ``compile_cache/`` that others can write although ``run_dir_mode`` does
not say so is worth a warning, at submit (preflight) and when rank 0 starts an attempt.

Whoever can write the run dir runs code as its owner: ``config.yaml`` names the program every rank
imports, submitit's pickles under ``slurm/`` are unpickled by the job, and ``compile_cache/`` holds
the Python sources, shared objects and pickles that torch.compile loads (docs/security.md). Stdlib
only.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from hpc_ddp.core.errors import ConfigError, explain

DEFAULT = "0700"
_MODE = re.compile(r"[02][0-7]{3}")


def check_run_dir_mode(text: object) -> int:
    """``run_dir_mode`` as a mode, or a :class:`ConfigError` that says what to write."""
    value = str(text)
    if not _MODE.fullmatch(value):
        hint = "quote it, e.g. run_dir_mode: '0750' (on the command line: run_dir_mode=\"'0750'\")"
        if re.fullmatch(r"[0-7]{3}", value):  # 750 written without its leading 0
            hint = (f"write the mode with its leading 0, quoted: run_dir_mode: '0{value}' (on the "
                    f"command line: run_dir_mode=\"'0{value}'\")")
        elif value.isdigit() and not value.startswith("0") and re.fullmatch(r"0o[0-7]{3,4}",
                                                                            oct(int(value))):
            hint = (f"YAML reads an unquoted 0{oct(int(value))[2:]} as the number {value}: {hint}")
        raise ConfigError(explain("run_dir_mode is not a folder mode of four octal digits",
                                  found=value,
                                  expected="'0700' (the default: only you), '0750' (your group "
                                  "reads), '0770' (your group writes too) or the same with setgid, "
                                  "'2770'",
                                  hint=hint),
                          key="run_dir_mode")
    mode = int(value, 8)
    if mode & 0o700 != 0o700 or mode & 0o002:
        why = ("others could write it, and so run code as you" if mode & 0o002
               else "you could not use it yourself")
        raise ConfigError(explain(f"run_dir_mode {value} is refused: {why}", found=value,
                                  expected="a mode with rwx for you (7 first) and no write for "
                                  "others (the last digit 0, 1, 4 or 5)",
                                  hint="share with a group instead: run_dir_mode: '0770' "
                                       "(docs/security.md)"
                                  if mode & 0o002 else "your own digit must be 7: e.g. "
                                                       "run_dir_mode: '0700'"),
                          key="run_dir_mode")
    return mode


def make_run_dir(path: Path, setting: str = DEFAULT) -> None:
    """Create the run dir with ``setting``'s mode (its parents as the umask says); an existing one
    is left as it is (:func:`loose_folders` says when others can write it). A setgid bit it inherits
    is kept."""
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = check_run_dir_mode(setting)
    try:
        os.mkdir(path, 0o700)  # never looser than asked between the mkdir and the chmod
    except FileExistsError:
        return  # another submit made it a moment ago
    # a setgid parent: its group's files stay its group's
    inherited = os.stat(path).st_mode & stat.S_ISGID
    os.chmod(path, mode | inherited)


def loose_folders(folders: Iterable[Path], setting: str = DEFAULT) -> list[tuple[str, str]]:
    """``(what, fix)`` for each existing folder of ``folders`` (:func:`run_dir_folders`) that its
    group or everyone may write beyond what ``setting`` (run_dir_mode) allows: the folder, its mode,
    the fix."""
    try:
        allowed = check_run_dir_mode(setting)
    except ConfigError:
        allowed = int(DEFAULT, 8)
    found = []
    for folder in folders:
        try:
            mode = stat.S_IMODE(os.stat(folder).st_mode)
        except OSError:
            continue
        loose = mode & 0o022 & ~allowed
        if not loose:
            continue
        who = "everyone" if loose & 0o002 else "its group"
        share = ("" if loose & 0o002 else ", or, to share the run with your group on purpose, set "
                 f"run_dir_mode: '0{(allowed | 0o070) & 0o777:o}'")
        found.append((f"{folder} can be written by {who} (mode {mode:04o}), and whoever can write "
                      "it can run code "
                      "as you (config.yaml names the program, submitit's pickles and "
                      "torch.compile's cache are "
                      f"loaded from the run dir: docs/security.md)", f"chmod go-w {folder}{share}"))
    return found


def run_dir_folders(run_dir: Path | str) -> list[Path]:
    """The folders whose writers run code as the run's owner: the run dir, its slurm/ and
    compile_cache/ (the names are :mod:`hpc_ddp.rundir.layout`'s)."""
    return [Path(run_dir), Path(run_dir) / "slurm", Path(run_dir) / "compile_cache"]
