"""rehearsal: one machine plays a whole job (``submit --local``): N nodes x M tasks as processes.

It sets the same Slurm variables a job gets, injects preemptions, time-outs, failures and
freezes, and heals with the batch shell's rules. It starts ranks as processes and never
imports rank code (or torch). Imports core, rundir and shell.
"""
