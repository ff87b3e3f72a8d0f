"""One preflight result (:mod:`hpc_ddp.login.preflight`): its level, the config key, what is wrong
and the fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One preflight result; ``level`` is "error" (stops the submit), "warning", or "note" (what was
    planned for)."""

    level: str
    key: str
    message: str
    hint: str

    def __str__(self) -> str:
        return f"{self.level} [{self.key}]: {self.message}" + (f"\nHINT: {self.hint}" if self.hint
                                                               else "")
