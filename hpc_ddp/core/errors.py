"""The one exception family of hpc_ddp.

Every error a user can cause is an :class:`HpcDdpError` whose message says what
was wrong, where (the config key or environment variable), what was found, what
was expected, and how to fix it.  Callers that want to react programmatically
read ``.key`` instead of parsing the message.
"""

from __future__ import annotations

import re

# "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] ": where in torch's C++ tree the message was
# made
_SOURCE_PREFIX = re.compile(r"^\[[^\]\s]+\.(?:cc|cpp|cxx|cu|h|hpp):\d+\]\s*")


class HpcDdpError(Exception):
    """Base class of every error hpc_ddp raises on purpose.

    ``key`` names the config key (``train.lr``) or environment variable
    (``SLURM_PROCID``) at fault, when there is one.
    """

    #: False: the same input fails the same way again (a bad config, task or environment), so a job
    #: that hits it is never requeued. True for failures of the world outside (a full disk).
    retry_may_help = False

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ConfigError(HpcDdpError):
    """A config file, a ``key=value`` override or a value in the schema is wrong."""


class SlurmEnvError(HpcDdpError):
    """The Slurm, torchrun or MASTER_* variables cannot give a consistent rank layout."""


class UsageError(HpcDdpError, ValueError):
    """A training program used hpc_ddp's API the wrong way (an argument of the wrong kind, calls out
    of order). Deterministic like a config error: exit 2, recorded once, never requeued. Also a
    ValueError, which is what such a mistake raised before it had a class of its own."""


class ClusterError(HpcDdpError):
    """The throw-away local Slurm cluster could not be started, checked or stopped."""


def a_type(value: object) -> str:
    """"a list", "an int": a value's type name with its article, for messages."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def explain(
    what: str,
    *,
    found: object = None,
    expected: str | None = None,
    hint: str | None = None,
) -> str:
    """Format an error message in the house style: what, found, expected, HINT.

    ``found`` is shown with ``repr`` so that empty strings and stray spaces are visible.
    """
    parts = [what]
    if found is not None:
        parts.append(f"found {found!r}")
    if expected:
        parts.append(f"expected {expected}")
    message = "; ".join(parts) + "."
    if hint:
        message += f"\nHINT: {hint}"
    return message


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """An error's first line for a ledger line, an offer or a log line: without the C++ source
    location that gloo and c10d put in front ("[../third_party/gloo/.../pair.cc:553] Connection
    closed by peer"), which names torch's build tree rather than what went wrong; the exception's
    class name when it has no message."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    return _SOURCE_PREFIX.sub("", text.splitlines()[0])[:limit]
