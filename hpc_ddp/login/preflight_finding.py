"""One preflight result (:mod:`hpc_ddp.login.preflight`): its level, the config key, what is wrong and the fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One preflight result; ``level`` is "error" (stops the submit) or "warning"."""

    level: str
    key: str
    message: str
    hint: str

    def __str__(self) -> str:
        return f"{self.level} [{self.key}]: {self.message}\nHINT: {self.hint}"
