"""shell: the batch shell's decisions. One process per job, started by sbatch, outliving every step.

``supervise`` runs each step (srun), ``settle`` writes its ledger line and requeues, ``heal``
chooses the next step's nodes. Pure rules where they can be (``shell_rules``, ``heal``). Imports
core and rundir; never torch, never rank code.
"""
