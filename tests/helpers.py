"""Small helpers shared by the tests that wait on real jobs."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float, poll: float = 0.2) -> bool:
    """Poll ``predicate`` until it is truthy or ``timeout`` seconds pass; return its last value as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return bool(predicate())
