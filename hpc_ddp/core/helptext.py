"""A module docstring as ``--help`` shows it: plain text, not the reST that the API reference
renders.

Double backticks become plain words and roles such as ``:mod:`x``` their target, so a user
reading ``--help`` in a terminal sees ``python -m hpc_ddp.status RUN_DIR``, not markup.
"""

from __future__ import annotations

import re
from typing import Any

from hpc_ddp.core.version import VERSION

_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc):`~?([^`]+)`")


def for_help(doc: str | None) -> str:
    text = _ROLE.sub(r"\1", doc or "")
    return text.replace("``", "")


def add_version(parser: Any) -> None:
    """``--version`` on every command: which hpc_ddp answered (and which Python), for a bug
    report."""
    import platform

    parser.add_argument("--version", action="version",
                        version=f"hpc_ddp {VERSION} (Python {platform.python_version()})")
