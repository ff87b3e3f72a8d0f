"""The one config schema of a run, and loading it from YAML files and ``key=value`` overrides.

One module per job; the names other code imports are exported here, where they always were:

- :mod:`~hpc_ddp.core.config.load`: merging a profile, the YAML files and the overrides against
  the schema (:func:`load_config`, :func:`profile_yaml`); a file or override is read by
  :mod:`~hpc_ddp.core.config.inputs`, omegaconf's errors are worded by
  :mod:`~hpc_ddp.core.config.translate`, and :mod:`~hpc_ddp.core.config.save` writes a config
  back (:func:`to_yaml`, :func:`save_config`).
- :mod:`~hpc_ddp.core.config.schema` and :mod:`~hpc_ddp.core.config.cluster`: one dataclass per
  section, every key documented (docs/config.md is generated from them).
- :mod:`~hpc_ddp.core.config.rules` and :mod:`~hpc_ddp.core.config.checks`: what the schema's
  types cannot say, each key's range or format and the rules across keys.
- :mod:`~hpc_ddp.core.config.env` (``${oc.env:VAR}`` kept out of the run dir),
  :mod:`~hpc_ddp.core.config.items` (``train.args.3=VALUE``), :mod:`~hpc_ddp.core.config.hints`
  ("did you mean") and :mod:`~hpc_ddp.core.config.diff` (what changed between two configs).

``omegaconf`` lives only in this folder. Pure: no torch.
"""

from __future__ import annotations

from hpc_ddp.core.config.diff import config_diff, describe_diff, flat_values
from hpc_ddp.core.config.load import load_config, profile_yaml
from hpc_ddp.core.config.save import save_config, to_yaml
from hpc_ddp.core.config.schema import (ContainerConfig, DistConfig, MetricsConfig, RunConfig,
                                        SlurmConfig, SnapshotConfig, TrainConfig, schema_node,
                                        schema_rows)

__all__ = ["ContainerConfig", "DistConfig", "MetricsConfig", "RunConfig", "SlurmConfig",
           "SnapshotConfig", "TrainConfig", "config_diff", "describe_diff", "flat_values",
           "load_config", "profile_yaml", "save_config", "schema_node", "schema_rows", "to_yaml"]
