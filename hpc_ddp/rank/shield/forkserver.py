"""Imported by a multiprocessing forkserver alone (the session puts it in the server's preload list).

Slurm signals every process of a step, the forkserver included; a forkserver killed by the stop
signal takes the DataLoader workers it forked with it (they take it for their parent and exit when
it is gone), one step before the rank's stop snapshot. Importing this module makes the server ignore
the stop signals (:mod:`hpc_ddp.rank.shield.loader`); it still exits when the rank does (its pipe to
the rank closes). Never import it anywhere else: the importing process stops obeying SIGTERM.
"""

from __future__ import annotations

from hpc_ddp.rank.shield.loader import shield

shield()
