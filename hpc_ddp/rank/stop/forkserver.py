"""Imported by a multiprocessing forkserver alone (the session puts it in the server's preload
list).

Slurm signals every process of a step, the forkserver included; a forkserver killed by the stop
signal takes the DataLoader workers it forked with it (they take it for their parent and exit when
it is gone), one step before the rank's stop snapshot. Importing this module makes the server ignore
the stop signals (:mod:`hpc_ddp.rank.stop.shield`).

It also makes sure the server exits when its rank does, even a rank killed with SIGKILL: each child
of the server lets go of the server's "alive" pipe
(:func:`hpc_ddp.rank.stop.shield.release_alive_pipe`), which it would otherwise hold, keeping the
server alive for as long as it lives itself while it lives for as long as the server does. Never
import it anywhere else: the importing process stops obeying SIGTERM.
"""

from __future__ import annotations

from hpc_ddp.rank.stop.shield import release_alive_pipe_in_children, shield

shield()
release_alive_pipe_in_children()
