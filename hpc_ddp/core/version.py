"""hpc_ddp's version, in one place: ``hpc_ddp.__version__``, every command's ``--version`` and
setup.cfg (``version = attr: hpc_ddp.core.version.VERSION``) read it here.

In core, not the package root, so that core imports nothing above it (``--version`` is added by
:mod:`hpc_ddp.core.helptext`), and a plain assignment, so that setuptools reads it without importing
the package.
"""

from __future__ import annotations

VERSION = "0.2.0"
