"""rundir: the run directory's files, the only contract between the places.

Where every file lives (:mod:`layout`), the ledger of attempts, the run lock, the snapshot
format and its slicing, flight-recorder dumps, lost-rank markers and metrics.jsonl. Written by
ranks, the batch shell and the rehearsal; read by all of them and by the login node. Imports
core; torch only inside the functions that load or save tensors.
"""
