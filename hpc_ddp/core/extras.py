"""Which optional packages the ``metrics.*`` sinks need, checked without importing them (the login
node checks at submit; rank 0 again when a sink opens). No torch.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hpc_ddp.core.errors import ConfigError, explain


# key: (module, extra)
EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def missing_extras(metrics: Any) -> list[str]:
    """The ``metrics.*`` sinks switched on whose package is not installed (checked without importing
    it)."""
    return [key for key, (module, _) in EXTRAS.items()
            if getattr(metrics, key, False) and importlib.util.find_spec(module) is None]


def require_extras(metrics: Any) -> None:
    """Raise :func:`missing_error` for the first ``metrics.*`` sink switched on without its
    package."""
    for key in missing_extras(metrics):
        raise missing_error(key)


def missing_error(key: str) -> ConfigError:
    module, extra = EXTRAS[key]
    return ConfigError(explain(f"metrics.{key}=true needs the {module} package, which is not "
                               "installed",
                               hint=f"pip install 'hpc_ddp[{extra}]' (on the login node and in the "
                                    "job's "
                               f"environment), or set metrics.{key}=false"), key=f"metrics.{key}")
