"""Values that reach a batch script: one line each, and quoted wherever a shell or sbatch reads
them.

A config value lands in the job's script in three ways, and each has its rule:

- **a shell word** (the srun line, ``CONFIG=``, the supervise line): :func:`shlex.quote` (callers
  use ``shlex.join``), so ``$(...)``, backticks, ``;`` and quotes stay text.
- **an ``#SBATCH --opt=value`` line**: bash skips it as a comment, sbatch parses it itself (no
  expansion): whitespace ends the value, an unquoted ``#`` starts a comment, ``"`` quotes and ``\\``
  escapes. Since Slurm 17.11 ``'`` quotes too, before it was literal; so :func:`sbatch_value` uses
  double quotes and escapes ``\\ " ' #`` with a backslash, which every version reads back as the
  same text.
- **the user's own shell lines** (``slurm.setup``): kept as they are, each one line of its own.

What no quoting can carry is a line break: bash ends the ``#SBATCH`` comment there and runs the rest
as a command (``run_dir: "/x\\ntouch /x/pwned\\n#"`` did). So every string of the config that can
reach a script is refused at config-check time when it holds a control character
(:func:`check_one_line`), and the renderers check the values they put in once more
(:func:`one_line`). Pure: stdlib only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from hpc_ddp.core.errors import ConfigError, explain

# C0 controls (newline, CR, tab, ...), DEL, and the C1 controls (a terminal that shows the script
# reads 0x9b as the start of an escape sequence)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_NAMES = {"\n": "a newline (\\n)", "\r": "a carriage return (\\r)", "\t": "a tab (\\t)",
          "\x00": "a NUL byte"}
# Keys whose strings never reach a script: argv items handed to train.script by exec (a multi-line
# argument is legitimate there), the progress regex, and the user's own settings (environment
# variables).
NOT_IN_SCRIPTS = ("train.args", "train.resume_args", "train.script_progress", "user")
SHELL_LINES = "slurm.setup"  # the user's own commands: a tab is harmless in them
# Keys that land on #SBATCH lines. submitit quotes its values with '...', inside which sbatch reads
# a backslash as an escape (so 'a\' is an unmatched quote): no quoting of ours gets one through, so
# it is refused there.
SBATCH_KEYS = ("name", "run_dir", "slurm.partition", "slurm.account", "slurm.qos",
               "slurm.constraint",
               "slurm.sbatch_extra")
# what needs no quoting, in bash or in sbatch (shlex's set)
_SAFE = re.compile(r"[\w@%+=:,./-]*", re.ASCII)


def bad_char(text: str, allow: str = "") -> tuple[int, str] | None:
    """(index, character) of the first control character in ``text`` not in ``allow``; None if there
    is none."""
    for match in _CONTROL.finditer(text):
        if match.group() not in allow:
            return match.start(), match.group()
    return None


def char_name(char: str) -> str:
    return _NAMES.get(char, f"the control character U+{ord(char):04X}")


def one_line(where: str, value: str, allow: str = "", key: str | None = None) -> str:
    """``value`` unchanged if it holds no control character (but those in ``allow``); else a
    :class:`ConfigError` naming ``where``, the character and its position, and the fix."""
    found = bad_char(value, allow)
    if found is None:
        return value
    index, char = found
    raise ConfigError(explain(
        f"{where} holds {char_name(char)} at character {index}: " + (
            "it would end its line of the job's batch script, and bash would run what follows as a "
            "command"
            if char in "\n\r\x0b\x0c" else "a value with it has no safe place on a line of the "
                                           "job's batch script"),
        found=value,
        expected="one-line text without control characters"
        + (" (a tab is fine)" if "\t" in allow else ""),
        hint=f"remove it from {where}" + (" (one shell line per list item)"
                                          if where.startswith(SHELL_LINES) else "")
        + ("; in YAML, a double-quoted \\n or \\t is a control character, a single-quoted one is "
           "text"
           if char in "\n\t\r" else "")), key=key or where.split("[")[0])


def setup_line(where: str, line: str) -> str:
    """One of the user's shell lines: one line (a tab is fine), and not ending in a backslash, which
    would join the script's next line to it."""
    one_line(where, line, allow="\t", key=SHELL_LINES)
    trailing = len(line) - len(line.rstrip("\\"))
    if trailing % 2:
        raise ConfigError(explain(
            f"{where} ends in a backslash, which would join the batch script's next line to it",
            found=line,
            expected="a complete shell command on one line",
            hint=f"remove the trailing backslash from {where}"),
            key=SHELL_LINES)
    return line


def strings(value: Any, path: str, key: str = "") -> Iterator[tuple[str, str, str]]:
    """(where, config key, text) for every string in ``value``: a dataclass's fields (each its own
    key), mapping keys and values and list items (``slurm.setup[2]``,
    ``slurm.sbatch_extra.mail-user``: the key is still ``slurm.setup``, ``slurm.sbatch_extra``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            name = f"{path}.{f.name}" if path else f.name
            yield from strings(getattr(value, f.name), name, name)
    elif isinstance(value, str):
        yield path, key or path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k, f"a key of {path}", key or path)
            yield from strings(v, f"{path}.{k}", key or path)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from strings(item, f"{path}[{i}]", key or path)


def check_one_line(cfg: Any) -> None:
    """Every string of the config that can reach a batch script is one line; ``slurm.setup``'s lines
    are the user's own commands, kept as they are, one line each (see :func:`setup_line`)."""
    for where, key, text in strings(cfg, ""):
        if key in NOT_IN_SCRIPTS or key.startswith(tuple(f"{k}." for k in NOT_IN_SCRIPTS)):
            continue
        if key == SHELL_LINES:
            setup_line(where, text)
        else:
            one_line(where, text, key=key)
        if key in SBATCH_KEYS and "\\" in text:
            raise ConfigError(explain(
                f"{where} holds a backslash, which sbatch cannot read back from the job's #SBATCH "
                "line: submitit "
                "quotes the value with '...', and inside quotes sbatch takes a backslash as an "
                "escape", found=text,
                expected="text without a backslash", hint=f"remove the backslash from {where} (a "
                                                          "path: use /)"),
                key=key)


def sbatch_value(value: str, where: str = "an #SBATCH value") -> str:
    """``value`` as sbatch reads it back from an ``#SBATCH --opt=VALUE`` line: as is when it needs
    no quoting (the usual case: the golden files keep their look), else in double quotes with ``\\ "
    ' #`` escaped. A line break cannot be carried, and is refused."""
    one_line(where, value)
    if _SAFE.fullmatch(value):
        return value
    return '"' + re.sub(r"""([\\"'#])""", r"\\\1", value) + '"'


def sbatch_read(value: str) -> str:
    """What sbatch (17.11 and later) makes of one option's text: quotes and escapes removed, an
    unquoted ``#`` ending it; for tests, the inverse of :func:`sbatch_value`."""
    out, quote, escape = [], "", False
    for char in value:
        if escape:
            out.append(char)
            escape = False
        elif char == "\\":
            escape = True
        elif quote:
            if char == quote:
                quote = ""
            else:
                out.append(char)
        elif char in "\"'":
            quote = char
        elif char == "#" or char.isspace():
            break
        else:
            out.append(char)
    return "".join(out)
