"""login: what runs on the login node: ``submit``, ``status``, ``whoami``, preflight, the sbatch
renderer, sweeps.

It must start fast and never import torch (tests/login/test_no_torch.py) or rank code. It imports
core, rundir, and the rehearsal (``submit --local`` plays the job on this machine).
"""
